package driver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/logrepeat"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestUninitialisedPoolLogsOnce: a shared pool that was never laid out fails every
// renewal for as long as the node runs. The log says so once, with the command that
// fixes it, then again only at logrepeat.Interval, and says when renewals work again.
func TestUninitialisedPoolLogsOnce(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "shared")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	n := newLeaseNode(t, dir, "node-a")
	var mu sync.Mutex
	var lines []string
	ctx := klog.NewContext(context.Background(), funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, args)
	}, funcr.Options{}))
	renew := func() error {
		done := make(chan error, 1)
		n.leases.RenewAsync(ctx, n.leases.SharedPools()[0], done)
		return <-done
	}
	logged := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), lines...)
	}
	for i := 0; i < 12; i++ { // a minute of renewals every 5 s
		if err := renew(); err == nil {
			t.Fatal("a renewal in a pool never laid out succeeded")
		}
		n.clock.add(5 * time.Second)
	}
	got := logged()
	if len(got) != 1 {
		t.Fatalf("%d log lines for 12 failed renewals, want 1:\n%s", len(got), strings.Join(got, "\n"))
	}
	if want := "poolcsi pool init --path " + dir + " --name shared"; !strings.Contains(got[0], want) {
		t.Errorf("the line does not name the fix %q:\n%s", want, got[0])
	}
	n.clock.add(logrepeat.Interval)
	if err := renew(); err == nil {
		t.Fatal("renewal succeeded")
	}
	if got := logged(); len(got) != 2 || !strings.Contains(got[1], `"failedUnloggedSinceLastLine"=11`) {
		t.Fatalf("after %s, want a second line counting the 11 unlogged failures:\n%s", logrepeat.Interval, strings.Join(got, "\n"))
	}
	if _, err := pool.Initialise(pool.Config{Name: "shared", Path: dir, Shared: true}); err != nil {
		t.Fatal(err)
	}
	if err := renew(); err != nil {
		t.Fatalf("renewal once the pool is laid out: %v", err)
	}
	if got := logged(); len(got) != 3 || !strings.Contains(got[2], "after failed renewals") || !strings.Contains(got[2], `"failures"=13`) {
		t.Fatalf("want a line saying the renewals work again after 13 failures:\n%s", strings.Join(got, "\n"))
	}
}
