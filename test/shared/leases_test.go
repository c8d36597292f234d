package shared

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestPlantedLeaseRecords: two node plugins share a btrfs pool; node A has an
// ext4 image staged read-write and a process writing to it, and renews its
// lease. Someone who can write the pool plants records into A's lease file,
// again and again, while node B's controller is asked, as the attacher does
// after the out-of-service taint, to force-detach the volume from A:
//
//   - "released": true, and durationSeconds 9223372036 (whose expiry
//     overflowed to "already expired"): the volume must not move for longer
//     than A's lease plus the margin (before, it moved at once, and two nodes
//     had the image mounted read-write);
//   - A's lease file replaced by a directory: A must repair it and keep
//     renewing, not fence itself (before, its volumes went EIO for good).
func TestPlantedLeaseRecords(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid", "mkfs.btrfs")
	ctx := context.Background()
	root := csiproc.ShortRoot(t, "pclease-")
	t.Cleanup(func() {
		if t.Failed() {
			releaseUnder(root)
		}
	})
	mnt := testutil.LoopFS(t, root, "btrfs", 512*mib)
	poolDir := filepath.Join(mnt, "pool")
	if err := os.Mkdir(poolDir, 0o755); err != nil {
		t.Fatal(err)
	}
	run(t, csiproc.Binary(t), "pool", "init", "--path", poolDir, "--name", "shared", "--not-a-mount-point-ok")
	dA := csiproc.Start(t, csiproc.Options{NodeID: "node-a", Pools: []string{"shared=" + poolDir + ",shared"}, Args: leaseArgs})
	dB := csiproc.Start(t, csiproc.Options{NodeID: "node-b", Pools: []string{"shared=" + poolDir + ",shared"}, Args: leaseArgs})
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	id := must(dB.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-planted", VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 * mib}}))(t).GetVolume().GetVolumeId()
	must(dB.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-a", VolumeCapability: vc}))(t)
	staging, target := filepath.Join(root, "a", "staging"), filepath.Join(root, "a", "target")
	must(dA.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}))(t)
	must(dA.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc}))(t)
	t.Cleanup(func() {
		_, _ = dA.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		_, _ = dA.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	})
	w := startWriter(t, filepath.Join(target, "a.dat"))
	w.waitAcked(t, 10)
	lease := filepath.Join(poolDir, "leases", "node-a")

	for _, planted := range []string{
		`{"node":"node-a","instance":"forged","counter":1,"durationSeconds":6,"released":true}`,
		`{"node":"node-a","instance":"forged","counter":1,"durationSeconds":9223372036}`,
	} {
		// The forger rewrites the record every 50 ms for longer than the
		// lease plus the margin, and the attacher asks every 300 ms.
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(50 * time.Millisecond):
				}
				_ = os.WriteFile(lease, []byte(planted), 0o644)
			}
		})
		for end := time.Now().Add(leaseExpiry + 3*time.Second); time.Now().Before(end); time.Sleep(300 * time.Millisecond) {
			_, err := dB.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
			if status.Code(err) != codes.Unavailable {
				close(stop)
				wg.Wait()
				t.Fatalf("force-detach of a volume whose holder renews, with %s planted in its lease: %v; want UNAVAILABLE", planted, err)
			}
		}
		close(stop)
		wg.Wait()
	}

	// A's lease file becomes a directory: A repairs it and keeps renewing.
	before := w.acked()
	if err := os.Remove(lease); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(lease, "planted"), 0o755); err != nil {
		t.Fatal(err)
	}
	time.Sleep(leaseDuration + 2*time.Second)
	if strings.Contains(dA.Log(), "Fencing this node off the pool") {
		t.Fatalf("node A fenced itself although the pool answered:\n%s", dA.Log())
	}
	if fi, err := os.Lstat(lease); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("node A's lease file after the repair: %v %v", fi, err)
	}
	if !strings.Contains(dA.Log(), "damaged while the pool answers") {
		t.Error("node A did not say it repaired its lease file")
	}
	w.waitAcked(t, before+10)
	if devs := fencedDevices(id); len(devs) > 0 {
		t.Fatalf("fenced devices of the volume: %v", devs)
	}
}
