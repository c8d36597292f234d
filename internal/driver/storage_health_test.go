package driver

import (
	"context"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// hangPoolChecks makes every pool check block until the test ends, and
// counts the checks started.
func hangPoolChecks(t *testing.T) *atomic.Int32 {
	t.Helper()
	var started atomic.Int32
	unblock := make(chan struct{})
	old := checkPoolReady
	checkPoolReady = func(p *pool.Pool) (health.PoolSpace, error) {
		started.Add(1)
		<-unblock
		return old(p)
	}
	t.Cleanup(func() { close(unblock); checkPoolReady = old })
	return &started
}

// storageHealth calls NodeGetStorageHealth, failing the test if it does not
// return within 10 s (a hung pool check held it).
func storageHealth(t *testing.T, d *leaseNode) *csi.NodeGetStorageHealthResponse {
	t.Helper()
	type answer struct {
		resp *csi.NodeGetStorageHealthResponse
		err  error
	}
	ch := make(chan answer, 1)
	go func() {
		resp, err := d.NodeGetStorageHealth(context.Background(), &csi.NodeGetStorageHealthRequest{})
		ch <- answer{resp, err}
	}()
	select {
	case a := <-ch:
		if a.err != nil {
			t.Fatal(a.err)
		}
		return a.resp
	case <-time.After(10 * time.Second):
		t.Fatal("NodeGetStorageHealth blocked on a pool that does not answer")
		return nil
	}
}

func hasReason(resp *csi.NodeGetStorageHealthResponse, reason, text string) bool {
	return slices.ContainsFunc(resp.GetBackendHealth(), func(b *csi.NodeGetStorageHealthResponse_StorageBackendHealth) bool {
		return b.GetReason() == reason && strings.Contains(b.GetMessage(), text)
	})
}

// TestStorageHealthReportsFenceWithoutThePool: a node that fenced itself off
// a pool reports so in NodeGetStorageHealth without checking that pool (it
// fenced because the pool stopped answering); a pool that hangs, not fenced,
// is reported as not answering once its check's time is up, and a hung check
// is not started again while it is outstanding. Before, every pool was
// checked first, synchronously: a hung pool held the call, and the fence's
// report, for good.
func TestStorageHealthReportsFenceWithoutThePool(t *testing.T) {
	ctx := context.Background()
	dir, a, b, _, _, _ := stagedOnA(t)
	dev := mustFind(t, a.host, dir)
	a.cut()
	a.clock.add(lease.Default.Duration)
	a.leases.FenceExpired(ctx)
	waitFenced(t, a.host, dev)
	old := poolCheckTimeout
	poolCheckTimeout = 50 * time.Millisecond
	t.Cleanup(func() { poolCheckTimeout = old })
	started := hangPoolChecks(t)

	if resp := storageHealth(t, a); !hasReason(resp, health.ReasonNodeFenced, "pool shared") {
		t.Fatalf("the fenced node's storage health: %+v", resp)
	}
	if n := started.Load(); n != 0 {
		t.Fatalf("%d checks of the fenced pool started", n)
	}
	// Node B is not fenced: its hung pool is reported as not answering.
	for range 3 {
		if resp := storageHealth(t, b); !hasReason(resp, health.ReasonPoolUnavailable, "does not answer") {
			t.Fatalf("storage health with a hung pool: %+v", resp)
		}
	}
	if n := started.Load(); n != 1 {
		t.Fatalf("%d checks of one hung pool started, want 1", n)
	}
}
