package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/poolcsi/poolcsi/test/csiproc"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// fsOverhead bounds what a filesystem keeps for itself (journal, metadata; xfs
// about 10% for its log at these sizes) when its statfs total is compared with
// the volume's size.
const fsOverhead = 0.85

// TestOnlineExpand grows a published volume holding data, the way Kubernetes
// does for a PVC in use: ControllerExpandVolume, then NodeExpandVolume on the
// publish path. ext4 is not here: online resize2fs needs CAP_SYS_RESOURCE,
// which this sandbox lacks (TestOfflineExpand covers ext4).
func TestOnlineExpand(t *testing.T) {
	for _, tc := range []struct {
		fs    string
		tools []string
	}{
		{"xfs", []string{"mkfs.xfs", "xfs_growfs"}},
		{"btrfs", []string{"mkfs.btrfs", "btrfs"}},
	} {
		t.Run(tc.fs, func(t *testing.T) {
			e := newEnv(t, tc.tools...)
			vc := csiproc.MountCap(tc.fs, csiproc.RWO)
			id := e.create("online-"+tc.fs, vc, 300*mib)
			e.stage(id, vc)
			e.publish(id, vc, false)
			data := filepath.Join(e.target(id), "data")
			sum := writeRandom(t, data, 40*mib)
			before := e.totalBytes(id, e.target(id))

			resp := e.controllerExpand(id, 600*mib)
			if resp.GetCapacityBytes() != 600*mib || !resp.GetNodeExpansionRequired() {
				t.Fatalf("ControllerExpandVolume = %v, want 600 MiB and node expansion required", resp)
			}
			// The filesystem does not move before the node step.
			if got := e.totalBytes(id, e.target(id)); got != before {
				t.Errorf("stats total changed from %d to %d before NodeExpandVolume", before, got)
			}
			for i := range 2 { // the second call is the idempotent retry
				if got := e.nodeExpand(id, e.target(id), 600*mib); got != 600*mib {
					t.Fatalf("NodeExpandVolume call %d = %d bytes, want %d", i+1, got, 600*mib)
				}
			}
			after := e.totalBytes(id, e.target(id))
			if after <= before || float64(after) < fsOverhead*float64(600*mib) || after > 600*mib {
				t.Errorf("stats total %d -> %d after growing to %d", before, after, 600*mib)
			}
			if got := e.totalBytes(id, e.staging(id)); got != after {
				t.Errorf("staging path reports %d bytes, publish path %d", got, after)
			}
			if got := checksum(t, data, -1); got != sum {
				t.Errorf("data checksum changed by expansion: %s, want %s", got, sum)
			}
			// A read-only publish beside it: its path is accepted, and growth goes
			// through the read-write staging mount.
			roTarget := filepath.Join(e.root, "target", "ro")
			t.Cleanup(func() {
				e.drv.Node().NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: roTarget})
			})
			if err := e.tryPublish(id, roTarget, vc, true); err != nil {
				t.Fatalf("read-only NodePublishVolume: %v", err)
			}
			if got := e.nodeExpand(id, roTarget, 600*mib); got != 600*mib {
				t.Errorf("NodeExpandVolume on a read-only publish path = %d, want %d", got, 600*mib)
			}
			if _, err := e.drv.Node().NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: roTarget}); err != nil {
				t.Fatal(err)
			}
			// Re-stage: the grown filesystem and the data are on disk, not only in
			// the page cache.
			e.unpublish(id)
			e.unstage(id)
			e.stage(id, vc)
			e.publish(id, vc, false)
			if got := e.totalBytes(id, e.target(id)); got != after {
				t.Errorf("after re-stage stats total is %d, want %d", got, after)
			}
			if got := checksum(t, data, -1); got != sum {
				t.Errorf("data checksum after re-stage: %s, want %s", got, sum)
			}
		})
	}
}

// TestOfflineExpand grows a volume while it is not staged; the next
// NodeStageVolume brings the filesystem to the recorded size (ext4 offline
// before mounting, xfs and btrfs right after). ext4 is the case that matters
// most: on this machine it cannot be grown online (no CAP_SYS_RESOURCE), and in
// Kubernetes an unused PVC waits in FileSystemResizePending until this stage.
func TestOfflineExpand(t *testing.T) {
	for _, tc := range []struct {
		fs    string
		tools []string
	}{
		{"ext4", []string{"mkfs.ext4", "e2fsck", "resize2fs"}},
		{"xfs", []string{"mkfs.xfs", "xfs_growfs"}},
		{"btrfs", []string{"mkfs.btrfs", "btrfs"}},
	} {
		t.Run(tc.fs, func(t *testing.T) {
			e := newEnv(t, tc.tools...)
			vc := csiproc.MountCap(tc.fs, csiproc.RWO)
			id := e.create("offline-"+tc.fs, vc, 300*mib)
			e.stage(id, vc)
			e.publish(id, vc, false)
			data := filepath.Join(e.target(id), "data")
			sum := writeRandom(t, data, 40*mib)
			before := e.totalBytes(id, e.target(id))
			e.unpublish(id)
			e.unstage(id)

			if resp := e.controllerExpand(id, 600*mib); resp.GetCapacityBytes() != 600*mib {
				t.Fatalf("ControllerExpandVolume = %v, want 600 MiB", resp)
			}
			e.stage(id, vc)
			e.publish(id, vc, false)
			after := e.totalBytes(id, e.target(id))
			if after <= before || float64(after) < fsOverhead*float64(600*mib) || after > 600*mib {
				t.Errorf("stats total %d -> %d after an offline expansion to %d", before, after, 600*mib)
			}
			if got := checksum(t, data, -1); got != sum {
				t.Errorf("data checksum changed by expansion: %s, want %s", got, sum)
			}
			// What kubelet does next for an offline expansion must be a no-op
			// success — except for ext4, whose online resize2fs this sandbox
			// refuses even when there is nothing to grow.
			if tc.fs != "ext4" {
				if got := e.nodeExpand(id, e.target(id), 600*mib); got != 600*mib {
					t.Errorf("NodeExpandVolume after stage = %d, want %d", got, 600*mib)
				}
			}
		})
	}
}

// TestBlockExpand grows a published raw block volume: the device at the
// publish path reports the new size, and the bytes written before are intact.
func TestBlockExpand(t *testing.T) {
	e := newEnv(t)
	vc := csiproc.BlockCap(csiproc.RWO)
	id := e.create("block", vc, 64*mib)
	e.stage(id, vc)
	e.publish(id, vc, false)
	dev := e.target(id)
	sum := writeRandom(t, dev, 8*mib)

	if resp := e.controllerExpand(id, 128*mib); resp.GetCapacityBytes() != 128*mib || !resp.GetNodeExpansionRequired() {
		t.Fatalf("ControllerExpandVolume = %v, want 128 MiB and node expansion required", resp)
	}
	if got := e.nodeExpand(id, dev, 128*mib); got != 128*mib {
		t.Fatalf("NodeExpandVolume = %d, want %d", got, 128*mib)
	}
	if got, err := mount.DeviceSize(dev); err != nil || got != 128*mib {
		t.Errorf("published device size = %d, %v; want %d", got, err, 128*mib)
	}
	if got := e.totalBytes(id, dev); got != 128*mib {
		t.Errorf("stats total = %d, want %d", got, 128*mib)
	}
	if got := checksum(t, dev, 8*mib); got != sum {
		t.Errorf("device content changed by expansion")
	}
	// The staging path of a block volume has nothing mounted, yet kubelet may
	// name it; it is the volume's.
	if got := e.nodeExpand(id, e.staging(id), 128*mib); got != 128*mib {
		t.Errorf("NodeExpandVolume on the staging path = %d, want %d", got, 128*mib)
	}
}

// TestBlockReadOnlyPublish checks that a read-only block publish cannot be
// written through its device node (a read-only bind mount alone would not stop
// that), and that a later read-write publish can write again.
func TestBlockReadOnlyPublish(t *testing.T) {
	e := newEnv(t)
	vc := csiproc.BlockCap(csiproc.RWO)
	id := e.create("block-ro", vc, 16*mib)
	e.stage(id, vc)
	e.publish(id, vc, true)
	dev := e.target(id)
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err == nil {
		_, err = f.Write(make([]byte, 4096))
		f.Close()
	}
	if !errors.Is(err, unix.EROFS) && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EACCES) {
		t.Errorf("write to a read-only published block device: %v, want EROFS/EPERM/EACCES", err)
	}
	// Kubelet bind-mounts the device node itself (from /dev, so read-write) under its
	// global map path for each block publish; a second read-only publish (two pods with
	// readOnly claims, the e2e suite's multiVolume spec) must still be accepted beside it.
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	node := fmt.Sprintf("/dev/loop%d", unix.Minor(st.Rdev))
	kubeletMap := filepath.Join(e.root, "map", "dev", "pod-1")
	if err := os.MkdirAll(filepath.Dir(kubeletMap), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kubeletMap, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(node, kubeletMap, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(kubeletMap, 0) })
	second := filepath.Join(e.root, "target", "second")
	t.Cleanup(func() { _ = unix.Unmount(second, 0); os.Remove(second) })
	wantCode(t, "second read-only publish beside kubelet's read-write map", e.tryPublish(id, second, vc, true), codes.OK)
	if err := unix.Unmount(second, 0); err != nil {
		t.Fatal(err)
	}
	// A read-write publish beside them cannot be honoured with a per-device flag.
	other := filepath.Join(e.root, "target", "other")
	t.Cleanup(func() { os.Remove(other) })
	wantCode(t, "read-write publish beside a read-only one", e.tryPublish(id, other, vc, false), codes.FailedPrecondition)
	if err := unix.Unmount(kubeletMap, 0); err != nil {
		t.Fatal(err)
	}

	e.unpublish(id)
	e.publish(id, vc, false)
	writeRandom(t, dev, 4096)
}

// TestExpandNoShrink: a request at or below the current size succeeds and
// changes nothing — not the answer, not the image, not volume.json.
func TestExpandNoShrink(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	id := e.create("noshrink", vc, 64*mib)
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(e.pool, "volumes", vid.Key)
	meta := func() []byte {
		b, err := os.ReadFile(filepath.Join(dir, "volume.json"))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	imageSize := func() int64 {
		fi, err := os.Stat(filepath.Join(dir, "disk.img"))
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	metaBefore := meta()
	for _, required := range []int64{1, 32 * mib, 64*mib - 1, 64 * mib} {
		resp := e.controllerExpand(id, required)
		if resp.GetCapacityBytes() != 64*mib {
			t.Errorf("expand to %d: capacity %d, want %d", required, resp.GetCapacityBytes(), 64*mib)
		}
	}
	if got := imageSize(); got != 64*mib {
		t.Errorf("image is %d bytes after shrink requests, want %d", got, 64*mib)
	}
	if got := meta(); !bytes.Equal(got, metaBefore) {
		t.Errorf("volume.json changed by shrink requests:\n%s\nwas\n%s", got, metaBefore)
	}
}

// TestExpandErrors: bad requests get the right code and change nothing.
func TestExpandErrors(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	id := e.create("errors", vc, 64*mib)
	unknown := "e2e." + strings.Repeat("0", 32)
	for _, tc := range []struct {
		name string
		req  *csi.ControllerExpandVolumeRequest
		want codes.Code
	}{
		{"no id", &csi.ControllerExpandVolumeRequest{CapacityRange: &csi.CapacityRange{RequiredBytes: mib}}, codes.InvalidArgument},
		{"bad id", &csi.ControllerExpandVolumeRequest{VolumeId: "e2e/../x", CapacityRange: &csi.CapacityRange{RequiredBytes: mib}}, codes.InvalidArgument},
		{"no range", &csi.ControllerExpandVolumeRequest{VolumeId: id}, codes.InvalidArgument},
		{"unknown volume", &csi.ControllerExpandVolumeRequest{VolumeId: unknown, CapacityRange: &csi.CapacityRange{RequiredBytes: 128 * mib}}, codes.NotFound},
		{"required above limit", &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 128 * mib, LimitBytes: 100 * mib}}, codes.InvalidArgument},
		{"current above limit", &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 32 * mib, LimitBytes: 32 * mib}}, codes.OutOfRange},
		{"above the largest volume", &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: pool.MaxCapacity + 1}}, codes.OutOfRange},
		{"more than the pool holds", &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: pool.MaxCapacity}}, codes.ResourceExhausted},
		{"other access type", &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 128 * mib}, VolumeCapability: csiproc.BlockCap(csiproc.RWO)}, codes.InvalidArgument},
	} {
		_, err := e.drv.Controller().ControllerExpandVolume(ctx(t), tc.req)
		wantCode(t, tc.name, err, tc.want)
	}
	vid, _ := pool.ParseVolumeID(id)
	if fi, err := os.Stat(filepath.Join(e.pool, "volumes", vid.Key, "disk.img")); err != nil || fi.Size() != 64*mib {
		t.Errorf("image after refused expansions: %v, %v; want 64 MiB", fi, err)
	}

	// NodeExpandVolume: missing fields, unknown volume, a path that is not the
	// volume's, and a volume that is not staged here.
	other := t.TempDir()
	for _, tc := range []struct {
		name string
		req  *csi.NodeExpandVolumeRequest
		want codes.Code
	}{
		{"no id", &csi.NodeExpandVolumeRequest{VolumePath: other}, codes.InvalidArgument},
		{"no path", &csi.NodeExpandVolumeRequest{VolumeId: id}, codes.InvalidArgument},
		{"unknown volume", &csi.NodeExpandVolumeRequest{VolumeId: unknown, VolumePath: other}, codes.NotFound},
		{"not staged", &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: other}, codes.NotFound},
	} {
		_, err := e.drv.Node().NodeExpandVolume(ctx(t), tc.req)
		wantCode(t, "NodeExpandVolume "+tc.name, err, tc.want)
	}
	e.stage(id, vc)
	_, err := e.drv.Node().NodeExpandVolume(ctx(t), &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: other})
	wantCode(t, "NodeExpandVolume on a path that is not the volume's", err, codes.NotFound)
	_, err = e.drv.Node().NodeExpandVolume(ctx(t), &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: e.staging(id), CapacityRange: &csi.CapacityRange{RequiredBytes: 128 * mib}})
	wantCode(t, "NodeExpandVolume beyond what the controller grew", err, codes.FailedPrecondition)
}

// TestExpandAcrossRestart stops the driver between ControllerExpandVolume and
// NodeExpandVolume; a new process, knowing only the pool, completes it.
func TestExpandAcrossRestart(t *testing.T) {
	e := newEnv(t, "mkfs.xfs", "xfs_growfs")
	vc := csiproc.MountCap("xfs", csiproc.RWO)
	id := e.create("restart", vc, 300*mib)
	e.stage(id, vc)
	e.publish(id, vc, false)
	data := filepath.Join(e.target(id), "data")
	sum := writeRandom(t, data, 8*mib)
	e.controllerExpand(id, 600*mib)

	e.drv.Restart(t)

	if got := e.nodeExpand(id, e.target(id), 600*mib); got != 600*mib {
		t.Fatalf("NodeExpandVolume after restart = %d, want %d", got, 600*mib)
	}
	if got := e.totalBytes(id, e.target(id)); float64(got) < fsOverhead*float64(600*mib) {
		t.Errorf("stats total after restart and expansion = %d, want about %d", got, 600*mib)
	}
	if got := checksum(t, data, -1); got != sum {
		t.Errorf("data checksum changed across restart and expansion")
	}
}

// TestExpandOnNode is the local-pool deployment with one cluster-wide resizer:
// the driver does not advertise controller expansion, so the resizer only marks
// the PVC, and kubelet's NodeExpandVolume grows image, loop device and
// filesystem on the node that holds the pool.
func TestExpandOnNode(t *testing.T) {
	e := newEnvArgs(t, []string{"--expand-on-node"}, "mkfs.xfs", "xfs_growfs")
	caps, err := e.drv.Controller().ControllerGetCapabilities(ctx(t), &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range caps.GetCapabilities() {
		if c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_EXPAND_VOLUME {
			t.Fatal("EXPAND_VOLUME advertised with --expand-on-node: the resizer would call a controller that cannot reach the pool")
		}
	}
	vc := csiproc.MountCap("xfs", csiproc.RWO)
	id := e.create("pvc-node-expand", vc, 300*mib)
	e.stage(id, vc)
	e.publish(id, vc, false)
	sum := writeRandom(t, filepath.Join(e.target(id), "data"), 8*mib)
	if got := e.nodeExpand(id, e.target(id), 600*mib); got != 600*mib {
		t.Fatalf("NodeExpandVolume answered %d bytes, want %d", got, 600*mib)
	}
	if total := e.totalBytes(id, e.target(id)); total < 500*mib {
		t.Fatalf("filesystem is %d bytes after growing to 600 MiB", total)
	}
	vol, err := e.drv.Controller().ControllerGetVolume(ctx(t), &csi.ControllerGetVolumeRequest{VolumeId: id})
	if err != nil || vol.GetVolume().GetCapacityBytes() != 600*mib {
		t.Fatalf("recorded capacity after node expansion: %v, %v", vol.GetVolume().GetCapacityBytes(), err)
	}
	if checksum(t, filepath.Join(e.target(id), "data"), -1) != sum {
		t.Fatal("data changed across the expansion")
	}
	// A retry, as kubelet makes, changes nothing.
	if got := e.nodeExpand(id, e.target(id), 600*mib); got != 600*mib {
		t.Fatalf("second NodeExpandVolume answered %d", got)
	}
}
