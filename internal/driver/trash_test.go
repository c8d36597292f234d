package driver

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestTrashEmptier: the emptier removes at its start what a crash left in the
// trash, then what each delete queues, and once stopped leaves deletes to
// remove their data themselves.
func TestTrashEmptier(t *testing.T) {
	p, err := pool.Open(pool.Config{Name: "t", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	trash := filepath.Join(p.Path(), "trash")
	entries := func() int {
		des, err := os.ReadDir(trash)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		return len(des)
	}
	image := func(name string) pool.VolumeID {
		v, err := p.Reserve(ctx, pool.Spec{Name: name, Layout: pool.LayoutImage, AccessType: pool.AccessBlock, CapacityBytes: pool.MiB})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Images().Prepare(v); err != nil {
			t.Fatal(err)
		}
		id, err := pool.ParseVolumeID(v.ID)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	// What a crash after a delete's answer leaves: an entry no call holds.
	if err := os.MkdirAll(filepath.Join(trash, "v-crashed-1", "data"), 0o750); err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- trashEmptier{pools: func() []*pool.Pool { return []*pool.Pool{p} }}.Run(rctx) }()
	gone := func(what string) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			return entries() == 0, nil
		}); err != nil {
			t.Fatalf("%s: the trash still holds %d entries", what, entries())
		}
	}
	gone("at start")
	if err := p.Delete(ctx, image("a")); err != nil {
		t.Fatal(err)
	}
	gone("after a delete")
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := p.Delete(ctx, image("b")); err != nil {
		t.Fatal(err)
	}
	if n := entries(); n != 0 {
		t.Fatalf("a delete after the emptier stopped left %d entries in the trash", n)
	}
}
