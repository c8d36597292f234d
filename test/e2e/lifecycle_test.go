// Package e2e drives a real poolcsi process through the calls kubelet and the
// sidecars make, with real loop devices, filesystems and mounts.
package e2e

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/harness"
)

// env is one running driver on a temporary pool.
type env struct {
	root string
	pool string
	d    *harness.Driver
}

func newEnv(t *testing.T, commands ...string) *env {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, append([]string{"blkid"}, commands...)...)
	root := t.TempDir()
	harness.CheckNoLeaks(t, root)
	e := &env{root: root, pool: filepath.Join(root, "pool")}
	e.d = harness.Start(t, harness.Options{NodeID: "node-1", Pools: []string{"local=" + e.pool}})
	return e
}

func (e *env) create(t *testing.T, name string, size int64, vc *csi.VolumeCapability) *csi.Volume {
	t.Helper()
	resp, err := e.d.Controller().CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{vc},
	})
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	id := resp.GetVolume().GetVolumeId()
	t.Cleanup(func() {
		if _, err := e.d.Controller().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("cleanup DeleteVolume %s: %v", id, err)
		}
	})
	return resp.GetVolume()
}

func (e *env) stage(t *testing.T, id, staging string, vc *csi.VolumeCapability) {
	t.Helper()
	// Unstage is registered before staging, so a failure half way still releases
	// the loop device and the mount.
	t.Cleanup(func() {
		e.d.Node().NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	})
	if _, err := e.d.Node().NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc,
	}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
}

func (e *env) unstage(t *testing.T, id, staging string) {
	t.Helper()
	if _, err := e.d.Node().NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
}

func (e *env) publish(t *testing.T, id, staging, target string, vc *csi.VolumeCapability, readOnly bool) {
	t.Helper()
	t.Cleanup(func() {
		e.d.Node().NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	})
	if _, err := e.d.Node().NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc, Readonly: readOnly,
	}); err != nil {
		t.Fatalf("NodePublishVolume %s: %v", target, err)
	}
}

func (e *env) unpublish(t *testing.T, id, target string) {
	t.Helper()
	if _, err := e.d.Node().NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatalf("NodeUnpublishVolume %s: %v", target, err)
	}
}

// TestLifecycle walks a volume per filesystem through its whole life and checks
// that its data survives unstage and stage bit for bit.
func TestLifecycle(t *testing.T) {
	for _, fs := range []string{"xfs", "ext4", "btrfs"} {
		t.Run(fs, func(t *testing.T) {
			e := newEnv(t, "mkfs."+fs)
			vc := harness.MountCap(fs, harness.RWO)
			const size = 64 << 20
			vol := e.create(t, "pvc-lifecycle-"+fs, size, vc)
			if vol.GetCapacityBytes() < size {
				t.Fatalf("capacity %d below the %d asked", vol.GetCapacityBytes(), size)
			}
			id := vol.GetVolumeId()
			staging := filepath.Join(e.root, "staging")
			podA := filepath.Join(e.root, "pods", "a", "mount")
			podB := filepath.Join(e.root, "pods", "b", "mount")

			e.stage(t, id, staging, vc)
			e.publish(t, id, staging, podA, vc, false)
			e.publish(t, id, staging, podB, vc, false)
			sum := harness.WriteRandom(t, filepath.Join(podA, "data.bin"), 3_000_000)
			if got := harness.FileSum(t, filepath.Join(podB, "data.bin")); !harness.SameSum(got, sum) {
				t.Fatal("pod B reads other bytes than pod A wrote")
			}
			e.unpublish(t, id, podA)
			e.unpublish(t, id, podB)
			e.unstage(t, id, staging)
			for _, p := range []string{podA, podB} {
				if _, err := os.Stat(p); !os.IsNotExist(err) {
					t.Errorf("target %s still exists after unpublish: %v", p, err)
				}
			}

			e.stage(t, id, staging, vc)
			e.publish(t, id, staging, podA, vc, true)
			if got := harness.FileSum(t, filepath.Join(podA, "data.bin")); !harness.SameSum(got, sum) {
				t.Fatal("data changed across unstage and stage")
			}
			if err := os.WriteFile(filepath.Join(podA, "x"), []byte("x"), 0o600); err == nil {
				t.Error("a read-only publish accepted a write")
			}
			e.unpublish(t, id, podA)
			e.unstage(t, id, staging)
			if _, err := e.d.Controller().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Fatalf("DeleteVolume: %v", err)
			}
			if entries, _ := os.ReadDir(filepath.Join(e.pool, "volumes")); len(entries) != 0 {
				t.Fatalf("pool still holds %d entries after delete", len(entries))
			}
		})
	}
}

// TestRestartKeepsState restarts the driver while a volume is staged and
// published: everything it needs is in the pool and the kernel, so the new process
// tears the volume down and refuses to delete it while it is staged.
func TestRestartKeepsState(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := harness.MountCap("ext4", harness.RWO)
	id := e.create(t, "pvc-restart", 32<<20, vc).GetVolumeId()
	staging, target := filepath.Join(e.root, "staging"), filepath.Join(e.root, "pod")
	e.stage(t, id, staging, vc)
	e.publish(t, id, staging, target, vc, false)
	sum := harness.WriteRandom(t, filepath.Join(target, "f"), 1<<20)

	e.d.Restart(t)
	ctx := context.Background()
	if _, err := e.d.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("DeleteVolume of a staged volume after restart = %v, want FailedPrecondition", err)
	}
	// Repeated calls after the restart are recognised as already done.
	e.stage(t, id, staging, vc)
	e.publish(t, id, staging, target, vc, false)
	if !harness.SameSum(harness.FileSum(t, filepath.Join(target, "f")), sum) {
		t.Fatal("data changed across a driver restart")
	}
	e.unpublish(t, id, target)
	e.unstage(t, id, staging)
}
