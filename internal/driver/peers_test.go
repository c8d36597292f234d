package driver

import (
	"context"
	"testing"
	"time"
)

// TestSilentNodeIsVisible: the controller's watch shows, per pool and node,
// how long a node's lease has not changed and how many image volumes it holds
// staged read-write: a node plugin that stopped renewing while its node runs
// (which the lease cannot fence) is visible before a force-detach matters.
func TestSilentNodeIsVisible(t *testing.T) {
	ctx := context.Background()
	_, a, b, _, _, _ := stagedOnA(t)
	peer := func() PeerLease {
		t.Helper()
		b.leases.WatchPeers(ctx)
		for _, pl := range b.PeerLeases() {
			if pl.Pool == "shared" && pl.Node == "node-a" {
				return pl
			}
		}
		t.Fatalf("node-a is not watched: %+v", b.PeerLeases())
		return PeerLease{}
	}
	if pl := peer(); pl.Unchanged != 0 || pl.Stages != 1 || !pl.Present {
		t.Fatalf("first look: %+v", pl)
	}
	b.clock.add(40 * time.Second) // A's plugin is down: no renewal
	if pl := peer(); pl.Unchanged != 40*time.Second || pl.Stages != 1 {
		t.Fatalf("after 40 s without a renewal: %+v", pl)
	}
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	if pl := peer(); pl.Unchanged != 0 || pl.Stages != 1 {
		t.Fatalf("after a renewal: %+v", pl)
	}
}
