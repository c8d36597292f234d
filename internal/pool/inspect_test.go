package pool

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestOpenExistingAndLeftovers(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	v, err := p.Reserve(ctx, Spec{Name: "ok", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.MarkReady(v); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Reserve(ctx, Spec{Name: "stuck", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB}); err != nil {
		t.Fatal(err)
	}
	vols := filepath.Join(p.Path, "volumes")
	os.Mkdir(filepath.Join(vols, ".deleting-"+KeyForName("gone")), 0o750)
	os.Mkdir(filepath.Join(vols, KeyForName("nometa")), 0o750)
	os.WriteFile(filepath.Join(vols, "stray"), nil, 0o600)

	q, err := OpenExisting(p.Path)
	if err != nil || q.Name != p.Name {
		t.Fatalf("OpenExisting = %+v, %v", q, err)
	}
	if _, err := OpenExisting(t.TempDir()); err == nil {
		t.Fatal("a directory without pool.json was opened")
	}
	now := time.Now()
	if got, _ := q.Leftovers(now); len(got) != 3 {
		t.Fatalf("leftovers now = %+v, want 3 (deleting, no metadata, stray)", got)
	}
	if got, _ := q.Leftovers(now.Add(2 * StaleCreate)); len(got) != 4 {
		t.Fatalf("leftovers later = %+v, want the stuck create too", got)
	}
}
