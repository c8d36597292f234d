package driver

import (
	"context"
	"testing"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestAdoptDevicesAfterPluginRestart: after an upgrade the new node plugin runs in a
// new container, and the kernel shows the backing file of a loop device the old one
// attached without the pool's path, relative to the pool's filesystem (the old
// container's mount namespace is gone). The device is still adopted: it is known by
// its image's device and inode numbers, not by the path shown. TestUpgrade found it
// missed: 0.1.0 to 0.2.0 left the staged shared image without a record, unknown to
// the fence.
func TestAdoptDevicesAfterPluginRestart(t *testing.T) {
	ctx := context.Background()
	dir, a, _, _, id, _ := stagedOnA(t)
	dev := mustFind(t, a.host, dir)
	vid, _ := pool.ParseVolumeID(id)
	recs, err := a.VolumeRecords(vid)
	if err != nil || len(recs) != 1 {
		t.Fatalf("records: %+v %v", recs, err)
	}
	if err := a.opts.State.Delete(layout.StagesKind, recs[0].Key()); err != nil {
		t.Fatal(err)
	}
	a.host.LosePath(dir) // the kernel now shows /volumes/<key>/disk.img
	a.leases.AdoptDevices(ctx, a.pools.Pool("shared"))
	recs, err = a.VolumeRecords(vid)
	if err != nil || len(recs) != 1 || recs[0].Device != dev {
		t.Fatalf("records after the adoption: %+v %v, want one of %s", recs, err, dev)
	}
}
