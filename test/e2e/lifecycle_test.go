package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestLifecycle walks a volume per filesystem through its whole life — create,
// stage, publish to two pods, write through one and read through the other,
// unpublish, unstage, stage again, read back bit for bit, delete.
func TestLifecycle(t *testing.T) {
	for _, fs := range []string{"xfs", "ext4", "btrfs"} {
		t.Run(fs, func(t *testing.T) {
			e := newEnv(t, "mkfs."+fs)
			vc := csiproc.MountCap(fs, csiproc.RWO)
			const size = 64 * mib
			vol := e.createVolume("pvc-lifecycle-"+fs, vc, size)
			if vol.GetCapacityBytes() < size {
				t.Fatalf("capacity %d below the %d asked", vol.GetCapacityBytes(), size)
			}
			id := vol.GetVolumeId()
			podA := filepath.Join(e.root, "pods", "a", "mount")
			podB := filepath.Join(e.root, "pods", "b", "mount")

			e.stage(id, vc)
			e.publishAt(id, podA, vc, false)
			e.publishAt(id, podB, vc, false)
			sum := writeRandom(t, filepath.Join(podA, "data.bin"), 3_000_000)
			if got := checksum(t, filepath.Join(podB, "data.bin"), -1); got != sum {
				t.Fatal("pod B reads other bytes than pod A wrote")
			}
			e.unpublishAt(id, podA)
			e.unpublishAt(id, podB)
			e.unstage(id)
			for _, p := range []string{podA, podB} {
				if _, err := os.Stat(p); !os.IsNotExist(err) {
					t.Errorf("target %s still exists after unpublish: %v", p, err)
				}
			}

			e.stage(id, vc)
			e.publishAt(id, podA, vc, true)
			if got := checksum(t, filepath.Join(podA, "data.bin"), -1); got != sum {
				t.Fatal("data changed across unstage and stage")
			}
			if err := os.WriteFile(filepath.Join(podA, "x"), []byte("x"), 0o600); err == nil {
				t.Error("a read-only publish accepted a write")
			}
			e.unpublishAt(id, podA)
			e.unstage(id)
			_, err := e.drv.Controller().DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id})
			if err != nil {
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
// recognises repeated calls, tears the volume down, and refuses to delete it while
// it is staged.
func TestRestartKeepsState(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	id := e.create("pvc-restart", vc, 32*mib)
	e.stage(id, vc)
	e.publish(id, vc, false)
	sum := writeRandom(t, filepath.Join(e.target(id), "f"), mib)

	e.drv.Restart(t)
	_, err := e.drv.Controller().DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id})
	wantCode(t, "DeleteVolume of a staged volume after restart", err, codes.FailedPrecondition)
	e.stage(id, vc)
	e.publish(id, vc, false)
	if checksum(t, filepath.Join(e.target(id), "f"), -1) != sum {
		t.Fatal("data changed across a driver restart")
	}
	e.unpublish(id)
	e.unstage(id)
}

// TestDeleteAfterCrash leaves a pool as a DeleteVolume killed between its rename
// and its removal would, and checks the CO's retry removes the data.
func TestDeleteAfterCrash(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	id := e.create("pvc-crash", csiproc.MountCap("ext4", csiproc.RWO), 16*mib)
	key := id[strings.IndexByte(id, '.')+1:]
	vols := filepath.Join(e.pool, "volumes")
	if err := os.Rename(filepath.Join(vols, key), filepath.Join(vols, ".deleting-"+key)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.drv.Controller().DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(vols); len(entries) != 0 {
		t.Fatalf("the retried delete left %d entries in %s", len(entries), vols)
	}
}
