package shared

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
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

// freezeNode starts one node plugin over a shared pool on a loop-mounted
// btrfs, polling its freeze inbox every 20 ms, with an ext4 image volume
// staged and published; it returns the driver, the pool, the volume and its
// staging path.
func freezeNode(t *testing.T, root string) (d *csiproc.Driver, p *pool.Pool, id pool.VolumeID, staging string) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "mkfs.btrfs", "blkid")
	csiproc.CheckNoLeaks(t, root)
	poolDir := filepath.Join(testutil.LoopFS(t, root, "btrfs", 512*mib), "pool")
	if err := os.Mkdir(poolDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(csiproc.Binary(t), "pool", "init", "--path", poolDir, "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}
	d = csiproc.Start(t, csiproc.Options{NodeID: "node-1", SidecarDeadlines: true,
		Pools: []string{"shared=" + poolDir + ",shared"}, Args: []string{"--freeze-poll-interval=20ms"}})
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	vid := createVolume(t, d, "frozen", 64*mib, map[string]string{"pool": "shared", "layout": "image"}, vc).GetVolumeId()
	if err := publish(t, d, vid, "node-1", vc, false); err != nil {
		t.Fatal(err)
	}
	stagePublish(t, d, filepath.Join(root, "n1"), vid, vc)
	return d, must(pool.OpenExisting(poolDir))(t), must(pool.ParseVolumeID(vid))(t), filepath.Join(root, "n1", "staging")
}

// thawIfFrozen tells whether the filesystem mounted at mnt was frozen, and
// thaws it if it was.
func thawIfFrozen(t *testing.T, mnt string) bool {
	t.Helper()
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	err = unix.IoctlSetInt(int(f.Fd()), 0xC0045878, 0) // FITHAW
	if err != nil && !errors.Is(err, unix.EINVAL) {
		t.Fatalf("FITHAW %s: %v", mnt, err)
	}
	return err == nil
}

// setStagePath makes node-1's stage record of id name path, as any writer of
// the shared pool can; the record is restored in t.Cleanup.
func setStagePath(t *testing.T, p *pool.Pool, id pool.VolumeID, path string) {
	t.Helper()
	set := func(path string) error {
		return p.Update(context.Background(), id, func(v *pool.Volume) (bool, error) {
			for i := range v.Staged {
				if v.Staged[i].Node == "node-1" {
					v.Staged[i].Path = path
				}
			}
			return true, nil
		})
	}
	old := must(p.Load(id))(t).Staged[0].Path
	if err := set(path); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := set(old); err != nil {
			t.Errorf("restore the stage record: %v", err)
		}
	})
}

// TestFreezeLinkFlipNeverFreezesAnotherFilesystem: a pool writer points the
// volume's stage record (and its freeze requests) at a link in the pool that
// flips without pause between the volume's staging path and another
// filesystem (a second loop-mounted ext4, standing in for the host's), and
// sends requests with new nonces, round after round. The node freezes its
// own mount of the volume or nothing, never the other filesystem. Before, the
// node checked the path through the link and opened it again to freeze it:
// the other filesystem was frozen in about a third of the rounds.
func TestFreezeLinkFlipNeverFreezesAnotherFilesystem(t *testing.T) {
	root := t.TempDir()
	_, p, id, staging := freezeNode(t, root)
	otherDir := filepath.Join(root, "other")
	if err := os.Mkdir(otherDir, 0o755); err != nil {
		t.Fatal(err)
	}
	other := testutil.LoopFS(t, otherDir, "ext4", 32*mib)
	link := filepath.Join(p.Path(), "flip")
	setStagePath(t, p, id, link)
	stop := make(chan struct{})
	flipped := make(chan struct{})
	go func() {
		defer close(flipped)
		tmp := link + ".tmp"
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			_ = os.Remove(tmp)
			_ = os.Symlink(map[bool]string{true: staging, false: other}[i%2 == 0], tmp)
			_ = os.Rename(tmp, link)
		}
	}()
	defer func() { close(stop); <-flipped }()

	const rounds = 200
	var otherFrozen, volumeFrozen, refused int
	ack := filepath.Join(p.Path(), "freeze", "node-1", id.Key+".ack")
	for range rounds {
		nonce := pool.NewFreezeNonce()
		if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: id.String(), Node: "node-1", Path: link, Nonce: nonce}); err != nil {
			t.Fatal(err)
		}
		var a pool.FreezeAck
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
			got, ok, err := p.Freezes().ReadAck("node-1", id)
			if err == nil && ok && got.Nonce == nonce {
				a = got
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no answer to the freeze request (%v)", err)
			}
		}
		if thawIfFrozen(t, other) {
			otherFrozen++
		}
		switch a.State {
		case pool.FreezeFrozen:
			volumeFrozen++
		case pool.FreezeFailed:
			refused++
		}
		if err := p.Freezes().RemoveRequest("node-1", id); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
			if _, err := os.Stat(ack); os.IsNotExist(err) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the node did not clear its answer")
			}
		}
	}
	t.Logf("%d rounds: the volume frozen in %d, refused (budget) in %d; the other filesystem frozen in %d", rounds, volumeFrozen, refused, otherFrozen)
	if otherFrozen > 0 {
		t.Fatalf("the other filesystem was frozen in %d of %d rounds", otherFrozen, rounds)
	}
	if volumeFrozen == 0 {
		t.Fatal("the volume itself was never frozen")
	}
	if thawIfFrozen(t, staging) {
		t.Fatal("the volume was left frozen")
	}
}

// TestFreezeFIFORecordDoesNotBlockStart: a "frozen" record in the pool that
// names this node and a FIFO (as an older version wrote them, or any pool
// writer) does not keep a restarted node plugin from answering Probe, and
// the FIFO is never opened. Before, every start opened the path the record
// named before serving: the plugin never became ready.
func TestFreezeFIFORecordDoesNotBlockStart(t *testing.T) {
	root := t.TempDir()
	d, p, id, staging := freezeNode(t, root)
	fifo := filepath.Join(p.Path(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.Freezes().WriteRecord(id, "node-1", fifo); err != nil {
		t.Fatal(err)
	}
	d.Restart(t) // fails the test unless Probe answers within 30 s
	ctx, cancel := context.WithTimeout(context.Background(), csiproc.ProbeTimeout)
	defer cancel()
	if _, err := d.Identity().Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatalf("Probe: %v", err)
	}
	fd, err := unix.Open(fifo, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err == nil {
		unix.Close(fd)
		t.Fatal("the FIFO the record names was opened")
	}
	if !errors.Is(err, unix.ENXIO) {
		t.Fatal(err)
	}
	// The record only said which volume: this node's own mount of it is
	// thawed (it was not frozen), and the record goes.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if fs, err := p.Freezes().Records(); err == nil && len(fs) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the pool's freeze record was not cleared")
		}
	}
	if thawIfFrozen(t, staging) {
		t.Fatal("the volume was frozen")
	}
}
