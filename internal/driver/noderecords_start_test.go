package driver

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestDropStaleRecordsLocksOnlyStale: the lease keeper's start-up pass over
// the stage records locks no volume whose recorded device the kernel shows
// attached. The kernel's listing may wait for a hung backing file anywhere on
// the node; a staged volume locked meanwhile turned its calls away (ABORTED
// for seconds after each restart) and kept the restart's thaw of a filesystem
// left frozen by a crash from running. A stale record still goes.
func TestDropStaleRecordsLocksOnlyStale(t *testing.T) {
	ctx := context.Background()
	dir := newLeasePool(t)
	a := newLeaseNode(t, dir, "node-a")
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	vc := mountCap(rwo, "ext4")
	var ids []string
	for _, name := range []string{"staged", "gone"} {
		resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
		if err != nil {
			t.Fatal(err)
		}
		id := resp.GetVolume().GetVolumeId()
		ids = append(ids, id)
		if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(a.root, name), VolumeCapability: vc}); err != nil {
			t.Fatal(err)
		}
	}
	staged, gone := ids[0], ids[1]
	goneVID, _ := pool.ParseVolumeID(gone)
	recs, err := a.VolumeRecords(goneVID)
	if err != nil || len(recs) != 1 {
		t.Fatalf("records of %s: %+v %v", gone, recs, err)
	}
	// A crash between the detach and the record's deletion.
	if _, err := a.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: gone, StagingTargetPath: filepath.Join(a.root, "gone")}); err != nil {
		t.Fatal(err)
	}
	if err := a.opts.State.Put(layout.StagesKind, recs[0].Key(), recs[0]); err != nil {
		t.Fatal(err)
	}

	var lockedWhileListing []string
	a.host.Faults.OnCall("List", func() {
		for _, id := range []string{staged, gone} {
			if release, err := a.locks.acquire(id, "probe"); err != nil {
				lockedWhileListing = append(lockedWhileListing, id)
			} else {
				release()
			}
		}
	})
	a.leases.DropStaleRecords(ctx)
	for _, id := range lockedWhileListing {
		if id == staged {
			t.Errorf("the staged volume %s was locked while the kernel's devices were listed", staged)
		}
	}
	if recs, _ := a.VolumeRecords(goneVID); len(recs) != 0 {
		t.Errorf("stale record kept: %+v", recs)
	}
	stagedVID, _ := pool.ParseVolumeID(staged)
	if recs, _ := a.VolumeRecords(stagedVID); len(recs) != 1 {
		t.Errorf("records of the staged volume: %+v", recs)
	}
}

// TestStaleRecordsDoNotHoldUpTheFence: the lease keeper's start-up pass over
// the stage records may take long (a listing of the kernel's devices waits for
// every hung backing file on the node, and it locks and lists again for each
// stale record); the fence must not wait behind it. Before, the pass ran
// before the keeper's first renewal and fence check: a node whose pool was
// lost did not fence for as long as the pass lasted.
func TestStaleRecordsDoNotHoldUpTheFence(t *testing.T) {
	dir, a, _, _, _, _ := stagedOnA(t)
	dev := mustFind(t, a.host, dir)
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	// The start-up pass's listing does not return while the test runs.
	hold := make(chan struct{})
	var first sync.Once
	a.host.Faults.OnCall("List", func() {
		slow := false
		first.Do(func() { slow = true })
		if slow {
			<-hold
		}
	})
	a.cut()
	a.host.LosePath(dir)
	a.clock.add(lease.Default.Duration)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = a.leases.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		close(hold)
		<-done
	})
	// The keeper checks its leases every second (half the interval, at most).
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if f, _ := a.host.Fenced(dev); f {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("not fenced 5 s after the lease ran out, while the start-up pass over the stage records was under way")
		}
	}
}
