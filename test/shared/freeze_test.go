package shared

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
)

// TestSnapshotFreezesOtherNode: node 1 stages an image volume of the shared
// pool and writes to it without pause (write and fsync); the controller of
// node 2 snapshots it. Node 1 freezes the filesystem for node 2's copy
// (docs/snapshots.md#freezing-across-nodes): the copy is a clean filesystem
// (no log or journal to replay), node 1's writer was held while node 1's
// answer in the pool said "frozen", and nothing is left frozen or requested.
// On btrfs only: the freeze is the volume's filesystem's, the pool's is
// beside the point, and CephFS is covered by the lease tests.
func TestSnapshotFreezesOtherNode(t *testing.T) {
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			testutil.RequireCommands(t, "mkfs."+fsType, "e2fsck", "xfs_repair")
			testCopyFreezesOtherNode(t, setup(t, "btrfs"), fsType, snapshotCopy)
		})
	}
}

// TestCloneFreezesOtherNode is TestSnapshotFreezesOtherNode for a clone
// (CreateVolume from a volume): its copy is frozen on the source's node too.
func TestCloneFreezesOtherNode(t *testing.T) {
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			testutil.RequireCommands(t, "mkfs."+fsType, "e2fsck", "xfs_repair")
			// Room for the source and its clone, 300 MiB each (XFS's smallest).
			testCopyFreezesOtherNode(t, setupSized(t, "btrfs", 1024*mib), fsType, cloneCopy)
		})
	}
}

// A copier has node 2's controller copy volume id of e's shared pool and
// returns the copy's image file.
type copier func(t *testing.T, e *env, id, name string, vc *csi.VolumeCapability) (image string)

func snapshotCopy(t *testing.T, e *env, id, name string, _ *csi.VolumeCapability) string {
	ctx := context.Background()
	snap := must(e.d2.Controller().CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: id}))(t)
	t.Cleanup(func() {
		if _, err := e.d2.Controller().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
			t.Errorf("delete snapshot: %v", err)
		}
	})
	return filepath.Join(e.poolDir, "snapshots", strings.SplitN(strings.SplitN(snap.GetSnapshot().GetSnapshotId(), "@", 2)[1], ".", 2)[0], "image")
}

func cloneCopy(t *testing.T, e *env, id, name string, vc *csi.VolumeCapability) string {
	ctx := context.Background()
	clone := must(e.d2.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: name, Parameters: map[string]string{"pool": "shared", "layout": "image"},
		VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 300 * mib},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}},
	}))(t).GetVolume().GetVolumeId()
	t.Cleanup(func() {
		if _, err := e.d2.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: clone}); err != nil {
			t.Errorf("delete clone: %v", err)
		}
	})
	p := must(pool.OpenExisting(e.poolDir))(t)
	return p.ImagePath(must(pool.ParseVolumeID(clone))(t))
}

func testCopyFreezesOtherNode(t *testing.T, e *env, fsType string, copyBy copier) {
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, fsType)
	id := createVolume(t, e.d1, "frozen-"+fsType, 300*mib, map[string]string{"pool": "shared", "layout": "image"}, vc).GetVolumeId()
	vid := must(pool.ParseVolumeID(id))(t)
	if err := publish(t, e.d1, id, "node-1", vc, false); err != nil {
		t.Fatal(err)
	}
	target := stagePublish(t, e.d1, filepath.Join(e.root, "n1"), id, vc)
	w := startFsyncWriter(t, filepath.Join(target, "log"))
	w.waitWrites(t, 20)

	ack := filepath.Join(e.poolDir, "freeze", "node-1", vid.Key+".ack")
	watch := watchFrozen(ack)
	image := copyBy(t, e, id, "copy-"+fsType, vc)
	// Node 1 thaws at its next poll after the request goes, then removes
	// its answer: the window is over once the answer is gone.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(ack); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("node 1 did not thaw and clear its answer")
		}
	}
	first, last, seen := watch()
	w.waitWrites(t, w.count()+5) // node 1 writes again: nothing left frozen
	writes := w.stop()
	if seen < 2 {
		t.Fatalf("node 1's answer was read as frozen %d times: the freeze window was not seen", seen)
	}
	// While the answer said frozen the filesystem was (node 1 writes
	// "frozen" after FIFREEZE and "thawed" before FITHAW): no write that
	// began after the first such reading can have ended before the last,
	// and one write was held across it.
	held := false
	for _, wr := range writes {
		if wr.start.After(first) && wr.end.Before(last) {
			t.Fatalf("a write began %s after the freeze was seen and ended %s before it was last seen", wr.start.Sub(first), last.Sub(wr.end))
		}
		held = held || (wr.start.Before(last) && wr.end.After(last))
	}
	if !held {
		t.Fatal("no write of node 1 was held by the freeze")
	}
	t.Logf("%s: node 1's writer: %d writes; its answer read frozen %d times", fsType, len(writes), seen)

	checkClean(t, fsType, image)
}

// checkClean runs the filesystem's checker read-only on a copied image: an
// ext4 copy made while the filesystem was frozen has no journal to replay; an
// XFS one is mounted once first (below).
func checkClean(t *testing.T, fsType, image string) {
	t.Helper()
	var cmd *exec.Cmd
	switch fsType {
	case "ext4":
		out, err := exec.Command("dumpe2fs", "-h", image).CombinedOutput()
		if err != nil {
			t.Fatalf("dumpe2fs: %v\n%s", err, out)
		}
		if strings.Contains(string(out), "needs_recovery") {
			t.Fatalf("the copy's journal needs recovery: it was not frozen\n%s", out)
		}
		cmd = exec.Command("e2fsck", "-f", "-n", image)
	case "xfs":
		// An XFS freeze quiesces the log but (Linux 6.x) leaves a record
		// a mount replays: replay it, as a restore's first stage does,
		// then check.
		mnt := filepath.Join(t.TempDir(), "copy")
		if err := os.Mkdir(mnt, 0o755); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("mount", "-o", "loop,nouuid", image, mnt).CombinedOutput(); err != nil {
			t.Fatalf("mount the copy: %v\n%s", err, out)
		}
		// The loop device goes with the unmount (autoclear).
		umount := func() error { return exec.Command("umount", mnt).Run() }
		t.Cleanup(func() { _ = umount() })
		if _, err := os.Stat(filepath.Join(mnt, "log")); err != nil {
			t.Fatalf("the copy lacks node 1's file: %v", err)
		}
		if err := umount(); err != nil {
			t.Fatalf("umount the copy: %v", err)
		}
		cmd = exec.Command("xfs_repair", "-n", "-f", image)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", cmd, err, out)
	}
}

// watchFrozen reads node 1's answer file without pause until the returned
// function is called, which reports the first and last time it read
// "frozen" (by this process's monotonic clock) and how many times.
func watchFrozen(path string) func() (first, last time.Time, seen int) {
	stop := make(chan struct{})
	done := make(chan struct{})
	var first, last time.Time
	var seen int
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			raw, err := os.ReadFile(path)
			if err != nil {
				time.Sleep(200 * time.Microsecond)
				continue
			}
			var a pool.FreezeAck
			if json.Unmarshal([]byte(strings.TrimSpace(string(raw))), &a) == nil && a.State == pool.FreezeFrozen {
				now := time.Now()
				if seen == 0 {
					first = now
				}
				last = now
				seen++
			}
			time.Sleep(200 * time.Microsecond)
		}
	}()
	return func() (time.Time, time.Time, int) {
		close(stop)
		<-done
		return first, last, seen
	}
}

type timedWrite struct{ start, end time.Time }

// fsyncWriter appends a block and fsyncs it, again and again, timing each.
type fsyncWriter struct {
	mu     sync.Mutex
	writes []timedWrite
	err    error
	stopCh chan struct{}
	done   chan struct{}
}

func startFsyncWriter(t *testing.T, path string) *fsyncWriter {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	w := &fsyncWriter{stopCh: make(chan struct{}), done: make(chan struct{})}
	block := make([]byte, 4096)
	go func() {
		defer close(w.done)
		defer f.Close()
		for {
			select {
			case <-w.stopCh:
				return
			default:
			}
			start := time.Now()
			_, err := f.Write(block)
			if err == nil {
				err = f.Sync()
			}
			end := time.Now()
			w.mu.Lock()
			w.writes = append(w.writes, timedWrite{start, end})
			w.err = err
			w.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	// Stopped before the unpublish and unstage registered earlier.
	t.Cleanup(func() { w.stop() })
	return w
}

func (w *fsyncWriter) count() int { w.mu.Lock(); defer w.mu.Unlock(); return len(w.writes) }

func (w *fsyncWriter) waitWrites(t *testing.T, n int) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); w.count() < n; time.Sleep(5 * time.Millisecond) {
		w.mu.Lock()
		err := w.err
		w.mu.Unlock()
		if err != nil {
			t.Fatalf("writer: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writer made %d writes, not %d: is the filesystem left frozen?", w.count(), n)
		}
	}
}

func (w *fsyncWriter) stop() []timedWrite {
	select {
	case <-w.stopCh:
	default:
		close(w.stopCh)
	}
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.writes
}
