package driver

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
)

// BenchmarkNodeGetVolumeStatsInProcess measures the driver's own cost of
// NodeGetVolumeStats on a published ext4 volume, without gRPC (test/e2e has the
// end-to-end figure beside a bare statfs).
func BenchmarkNodeGetVolumeStatsInProcess(b *testing.B) {
	testutil.RequireRoot(b)
	testutil.RequireCommands(b, "mkfs.ext4", "blkid")
	root := b.TempDir()
	p, err := pool.Open(pool.Config{Name: "p", Path: filepath.Join(root, "pool")})
	if err != nil {
		b.Fatal(err)
	}
	d, err := New(Options{Name: "x", NodeID: "n", Mode: ModeAll, Pools: []*pool.Pool{p}, StatsHealthTTL: 5 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	vc := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	v, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "a", CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20}, VolumeCapabilities: []*csi.VolumeCapability{vc}})
	if err != nil {
		b.Fatal(err)
	}
	id := v.GetVolume().GetVolumeId()
	st, tg := filepath.Join(root, "st"), filepath.Join(root, "tg")
	if _, err := d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: st, VolumeCapability: vc}); err != nil {
		b.Fatal(err)
	}
	defer d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: st})
	if _, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: st, TargetPath: tg, VolumeCapability: vc}); err != nil {
		b.Fatal(err)
	}
	defer d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: tg})
	req := &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: tg}
	b.ResetTimer()
	for b.Loop() {
		if _, err := d.NodeGetVolumeStats(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
}
