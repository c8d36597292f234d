package driver

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestStopDuringAdoptionKeepsTheLease: a node plugin that stops while its
// start-up pass recording devices staged before the records existed
// (AdoptDevices) has not finished, or could not list the kernel's devices,
// holds a device of the pool its records do not list yet: it must leave its
// lease to expire, never mark it released (another node would take the
// volume at once, beside this node's device: two writers). With the pass
// over and nothing staged, the stop releases the lease.
func TestStopDuringAdoptionKeepsTheLease(t *testing.T) {
	for _, tc := range []struct {
		name string
		// staged: the node holds a device of the pool without a record.
		staged bool
		// setup makes the kernel's list, the adoption's first step, hang
		// or fail; it returns what ends the hang.
		setup        func(t *testing.T, n *leaseNode, id string) (unblock func())
		wantReleased bool
	}{
		{"adoption hangs on an unrecorded device", true, func(t *testing.T, n *leaseNode, _ string) func() {
			block := make(chan struct{})
			n.host.Faults.OnCall("List", func() { <-block })
			var once sync.Once
			return func() { once.Do(func() { close(block) }) }
		}, false},
		{"adoption cannot list the devices", true, func(t *testing.T, n *leaseNode, _ string) func() {
			n.host.Faults.FailFrom("List", 1, errors.New("sysfs does not answer"))
			return func() {}
		}, false},
		{"adoption meets an unrecorded device the kernel cannot identify", true, func(t *testing.T, n *leaseNode, _ string) func() {
			// Its backing file's filesystem hangs: the kernel names the
			// file but not its identity, so nothing tells it is not ours.
			n.host.SetUnidentified(n.pools.Pool("shared").Path(), mount.ErrNotIdentified)
			return func() {}
		}, false},
		{"adoption cannot lock the volume of an unrecorded device", true, func(t *testing.T, n *leaseNode, id string) func() {
			// A call on the volume holds its lock through the adoption.
			release, err := n.lockFor(id, "test")
			if err != nil {
				t.Fatal(err)
			}
			var once sync.Once
			return func() { once.Do(release) }
		}, false},
		{"adoption over, nothing staged", false, func(*testing.T, *leaseNode, string) func() { return func() {} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var a *leaseNode
			var id string
			if tc.staged {
				_, a, _, _, id, _ = stagedOnA(t)
				vid, _ := pool.ParseVolumeID(id)
				recs, err := a.VolumeRecords(vid)
				if err != nil || len(recs) != 1 {
					t.Fatalf("records: %+v %v", recs, err)
				}
				// As staged by a node plugin from before the records.
				if err := a.opts.State.Delete(layout.StagesKind, recs[0].Key()); err != nil {
					t.Fatal(err)
				}
			} else {
				a = newLeaseNode(t, newLeasePool(t), "node-a")
			}
			unblock := tc.setup(t, a, id)
			t.Cleanup(unblock)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = a.leases.Run(ctx) }()
			t.Cleanup(func() { cancel(); unblock(); <-done })
			// Stop once the first renewal has landed (a lease never
			// renewed is never released anyway).
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				if s := a.leases.States(); len(s) == 1 && s[0].Age >= 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the lease keeper did not renew")
				}
			}
			cancel()
			<-done
			l, ok, err := a.pools.Pool("shared").Leases().Read("node-a")
			if err != nil || !ok {
				t.Fatalf("lease: %+v %v %v", l, ok, err)
			}
			if l.Released != tc.wantReleased {
				t.Fatalf("lease released %t on the way out, want %t", l.Released, tc.wantReleased)
			}
		})
	}
}
