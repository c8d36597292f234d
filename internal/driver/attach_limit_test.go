package driver

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// secondController is another controller process over td's pool directory:
// its own Pool value (caches, lock file descriptors) and its own in-process
// locks, as a replica on another node sharing the pool would have.
func secondController(t *testing.T, td *testDriver) *Driver {
	t.Helper()
	p, err := pool.Open(pool.Config{Name: td.pool.Name(), Path: td.pool.Path()})
	if err != nil {
		t.Fatal(err)
	}
	h := fake.New()
	d, err := New(Options{
		Name: "poolcsi.test", Version: "test", NodeID: "controller-2", Mode: ModeController, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: h, Loops: h, Devices: h, FS: h},
	})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func controllerPublish(d *Driver, id, node string) error {
	_, err := d.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{
		VolumeId: id, NodeId: node, VolumeCapability: mountCap(rwo, "ext4"),
	})
	return err
}

func controllerUnpublish(d *Driver, id, node string) error {
	_, err := d.ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: node})
	return err
}

// TestAttachLimitConcurrentControllers publishes many volumes to one node at
// once through two controllers sharing the pool: the node's limit must hold
// exactly, and every publish past it must be RESOURCE_EXHAUSTED.
func TestAttachLimitConcurrentControllers(t *testing.T) {
	const limit, volumes = 3, 10
	td := newTestDriver(t, testOpts{maxVols: limit, shared: true})
	other := secondController(t, td)
	var ids []string
	for i := range volumes {
		ids = append(ids, td.create(t, fmt.Sprintf("vol-%d", i), mountCap(rwo, "ext4"), nil))
	}
	var wg sync.WaitGroup
	errs := make([]error, volumes)
	for i, id := range ids {
		wg.Go(func() {
			d := td.Driver
			if i%2 == 1 {
				d = other
			}
			// A call that finds the volume busy in process answers ABORTED and
			// the sidecar retries: so does this.
			for {
				errs[i] = controllerPublish(d, id, "node-1")
				if status.Code(errs[i]) != codes.Aborted {
					return
				}
			}
		})
	}
	wg.Wait()
	var ok []string
	for i, err := range errs {
		switch status.Code(err) {
		case codes.OK:
			ok = append(ok, ids[i])
		case codes.ResourceExhausted:
		default:
			t.Errorf("publish %s: %v", ids[i], err)
		}
	}
	if len(ok) != limit {
		t.Fatalf("%d volumes published to a node with limit %d", len(ok), limit)
	}
	// Room is made by an unpublish through either controller.
	if err := controllerUnpublish(other, ok[0], "node-1"); err != nil {
		t.Fatal(err)
	}
	var free string
	for _, id := range ids {
		if err := controllerPublish(td.Driver, id, "node-1"); err == nil {
			free = id
			break
		}
	}
	if free == "" {
		t.Fatal("no publish succeeded after an unpublish made room")
	}
	for _, id := range ids {
		if id == free || id == ok[1] || id == ok[2] {
			continue
		}
		wantCode(t, controllerPublish(other, id, "node-1"), codes.ResourceExhausted)
	}
}

// TestAttachLimitIndexRepair checks that the index behind the limit is rebuilt
// from volume.json for a pool that lacks it, and that an entry standing for no
// publish record (a crash between entry and record) never refuses a publish.
func TestAttachLimitIndexRepair(t *testing.T) {
	td := newTestDriver(t, testOpts{maxVols: 2})
	a := td.create(t, "a", mountCap(rwo, "ext4"), nil)
	b := td.create(t, "b", mountCap(rwo, "ext4"), nil)
	c := td.create(t, "c", mountCap(rwo, "ext4"), nil)
	if err := controllerPublish(td.Driver, a, "node-1"); err != nil {
		t.Fatal(err)
	}
	// A pool an older version made: publish records, no index.
	nodes := filepath.Join(td.pool.Path(), "nodes")
	if err := os.RemoveAll(filepath.Join(nodes, "node-1.published")); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(nodes, ".published-index-v1")); err != nil {
		t.Fatal(err)
	}
	fresh := secondController(t, td)
	if err := controllerPublish(fresh, b, "node-1"); err != nil {
		t.Fatal(err)
	}
	wantCode(t, controllerPublish(fresh, c, "node-1"), codes.ResourceExhausted)
	if _, err := os.Stat(filepath.Join(nodes, "node-1.published", idKey(t, a))); err != nil {
		t.Errorf("rebuilt index lacks volume a: %v", err)
	}
	// b's record is lost (as if its save failed after its entry was made):
	// the entry is stale and must not hold the slot.
	vid, _ := pool.ParseVolumeID(b)
	if err := td.pool.Update(context.Background(), vid, func(v *pool.Volume) (bool, error) {
		v.ClearPublished("node-1")
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := controllerPublish(fresh, c, "node-1"); err != nil {
		t.Fatalf("publish beside a stale index entry: %v", err)
	}
	if _, err := os.Stat(filepath.Join(nodes, "node-1.published", idKey(t, b))); !os.IsNotExist(err) {
		t.Errorf("stale entry of b still there: %v", err)
	}
}

func idKey(t *testing.T, id string) string {
	t.Helper()
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	return vid.Key
}
