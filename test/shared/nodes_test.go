package shared

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// writeRandom writes n random bytes to path, fsyncs them and returns them.
func writeRandom(t *testing.T, path string, n int) []byte {
	t.Helper()
	data := make([]byte, n)
	rand.Read(data)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	return data
}

func wantFile(t *testing.T, path string, want []byte) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s: %d bytes that differ from the %d written", path, len(got), len(want))
	}
}

func unstageAll(t *testing.T, d *csiproc.Driver, dir, id string) {
	t.Helper()
	ctx := context.Background()
	must(d.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: filepath.Join(dir, "target")}))(t)
	must(d.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(dir, "staging")}))(t)
}

// TestStageOnAnotherNode moves an image volume from node 1 to node 2 the way a
// rescheduled pod does (unpublish, unstage, unpublish from node 1; publish and
// stage on node 2) and reads there, through the other node's view of the pool,
// exactly what node 1 wrote.
func TestStageOnAnotherNode(t *testing.T) { onEachBackend(t, testStageOnAnotherNode) }

func testStageOnAnotherNode(t *testing.T, e *env) {
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	id := createVolume(t, e.d1, "moving", 64*mib, map[string]string{"pool": "shared"}, vc).GetVolumeId()
	if err := publish(t, e.d1, id, "node-1", vc, false); err != nil {
		t.Fatal(err)
	}
	n1 := filepath.Join(e.root, "n1")
	target := stagePublishNoCleanup(t, e.d1, n1, id, vc)
	data := writeRandom(t, filepath.Join(target, "data"), 5*int(mib))
	unstageAll(t, e.d1, n1, id)
	unpublish(t, e.d1, id, "node-1")

	start := time.Now()
	if err := publish(t, e.d2, id, "node-2", vc, false); err != nil {
		t.Fatal(err)
	}
	n2 := filepath.Join(e.root, "n2")
	target = stagePublishNoCleanup(t, e.d2, n2, id, vc)
	t.Logf("publish and stage on node 2: %s", time.Since(start))
	wantFile(t, filepath.Join(target, "data"), data)
	more := writeRandom(t, filepath.Join(target, "more"), int(mib))
	unstageAll(t, e.d2, n2, id)
	unpublish(t, e.d2, id, "node-2")

	// And back: node 1 sees what node 2 wrote.
	if err := publish(t, e.d1, id, "node-1", vc, false); err != nil {
		t.Fatal(err)
	}
	target = stagePublishNoCleanup(t, e.d1, n1, id, vc)
	wantFile(t, filepath.Join(target, "data"), data)
	wantFile(t, filepath.Join(target, "more"), more)
	unstageAll(t, e.d1, n1, id)
	unpublish(t, e.d1, id, "node-1")
}

// TestSnapshotAcrossNodes: node 2's controller snapshots a volume that is staged
// and written on node 1 (crash-consistent: it cannot freeze another node's
// filesystem), node 1's controller restores it, and node 2 stages the restored
// volume and finds the data that node 1 had synced.
func TestSnapshotAcrossNodes(t *testing.T) { onEachBackend(t, testSnapshotAcrossNodes) }

func testSnapshotAcrossNodes(t *testing.T, e *env) {
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	params := map[string]string{"pool": "shared"}
	src := createVolume(t, e.d1, "source", 64*mib, params, vc).GetVolumeId()
	if err := publish(t, e.d1, src, "node-1", vc, false); err != nil {
		t.Fatal(err)
	}
	target := stagePublish(t, e.d1, filepath.Join(e.root, "n1"), src, vc)
	data := writeRandom(t, filepath.Join(target, "data"), 3*int(mib))
	syncfs(t, target)

	snap := must(e.d2.Controller().CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: src}))(t).GetSnapshot()
	t.Cleanup(func() {
		if _, err := e.d1.Controller().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshotId()}); err != nil {
			t.Errorf("delete snapshot: %v", err)
		}
	})
	if !snap.GetReadyToUse() {
		t.Fatalf("snapshot not ready: %v", snap)
	}
	for _, d := range []*csiproc.Driver{e.d1, e.d2} {
		ls := must(d.Controller().ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: src}))(t)
		if len(ls.GetEntries()) != 1 || ls.GetEntries()[0].GetSnapshot().GetSnapshotId() != snap.GetSnapshotId() {
			t.Fatalf("ListSnapshots: %v, want the one snapshot", ls.GetEntries())
		}
	}

	restored := must(e.d1.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "restored", Parameters: params, VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange:       &csi.CapacityRange{RequiredBytes: 96 * mib},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshotId()}}},
	}))(t).GetVolume().GetVolumeId()
	t.Cleanup(func() {
		e.d1.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: restored})
		if _, err := e.d2.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: restored}); err != nil {
			t.Errorf("delete restored volume: %v", err)
		}
	})
	if err := publish(t, e.d2, restored, "node-2", vc, false); err != nil {
		t.Fatal(err)
	}
	t2 := stagePublish(t, e.d2, filepath.Join(e.root, "n2"), restored, vc)
	wantFile(t, filepath.Join(t2, "data"), data)
}

// TestHealthAcrossNodes: damage done to an image through one node's view of the
// pool is reported by the other node's controller, and its repair too; both
// nodes see their pool healthy.
func TestHealthAcrossNodes(t *testing.T) { onEachBackend(t, testHealthAcrossNodes) }

func testHealthAcrossNodes(t *testing.T, e *env) {
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	id := createVolume(t, e.d1, "watched", 32*mib, map[string]string{"pool": "shared"}, vc).GetVolumeId()
	health := func(d *csiproc.Driver) *csi.VolumeHealth {
		t.Helper()
		return must(d.Controller().ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: id}))(t).GetVolumeHealth()
	}
	for _, d := range []*csiproc.Driver{e.d1, e.d2} {
		if h := health(d); len(h.GetHealthStatuses()) != 0 {
			t.Fatalf("a new volume is unhealthy: %v", h)
		}
		// Only the shared pool's: node 1's local pool is on the host's disk,
		// which the machine's other work may fill.
		sh := must(d.Node().NodeGetStorageHealth(ctx, &csi.NodeGetStorageHealthRequest{}))(t)
		for _, b := range sh.GetBackendHealth() {
			if strings.Contains(b.GetMessage(), "pool shared") {
				t.Fatalf("storage health of the shared pool: %v", b)
			}
		}
	}
	vid, _ := pool.ParseVolumeID(id)
	p1, err := pool.OpenExisting(e.poolDir)
	if err != nil {
		t.Fatal(err)
	}
	img := p1.ImagePath(vid)
	if err := os.Truncate(img, 16*mib); err != nil {
		t.Fatal(err)
	}
	h := health(e.d2)
	if len(h.GetHealthStatuses()) == 0 || h.GetHealthStatuses()[0].GetReason() != "ImageTruncated" {
		t.Fatalf("node 2's controller after node 1's view of the image was truncated: %v, want ImageTruncated", h)
	}
	if err := os.Truncate(img, 32*mib); err != nil {
		t.Fatal(err)
	}
	if h := health(e.d2); len(h.GetHealthStatuses()) != 0 {
		t.Fatalf("node 2's controller after the repair: %v", h)
	}
	lh := must(e.d2.Controller().ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{}))(t)
	if len(lh.GetEntries()) != 0 {
		t.Fatalf("ControllerListVolumeHealth after the repair: %v", lh.GetEntries())
	}
}
