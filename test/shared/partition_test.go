package shared

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
	"github.com/poolcsi/poolcsi/test/support/cephfs"
)

// Short leases, so the test does not wait the production minute and a half:
// the timeline is the same, scaled.
var leaseArgs = []string{"--lease-duration=6s", "--lease-renew-interval=1s", "--lease-margin=3s"}

const (
	leaseDuration = 6 * time.Second
	leaseExpiry   = 9 * time.Second // duration plus margin
	blockSize     = 4096
)

// TestPartitionedNodeNeverWritesLate: node A writes steadily, block after
// block, each stamped with its sequence number and the time it was issued, into
// an image volume of a shared pool; A's pool is then cut while A's driver and
// writer keep running. A cannot renew its lease and fences itself; the
// controller, asked to force-detach the volume from A (Kubernetes'
// out-of-service path), waits until A's lease has expired by its own clock;
// node B then publishes, stages and writes; A's pool comes back, and A's stale
// mounts are cleaned up. The volume holds B's data, and every block of A's in
// it was issued before B's first write: nothing A wrote reached it late.
//
//   - btrfs: each node has its own mount of the pool (a bind mount for A);
//     cutting A covers its mount with an empty tmpfs, so A's lease writes
//     fail while its loop device still reaches the filesystem: only A's own
//     fence stops its writes.
//   - cephfs: A's ceph-fuse is paused (SIGSTOP): everything A does on the
//     pool hangs, the MDS hears nothing from A; it is evicted as the MDS does
//     a silent client (here at once, instead of waiting out autoclose), and
//     resumed after B has written: blocklisted, its late writes are refused.
func TestPartitionedNodeNeverWritesLate(t *testing.T) {
	for _, b := range backends {
		t.Run(b, func(t *testing.T) { testPartition(t, b) })
	}
}

func testPartition(t *testing.T, backend string) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid")
	ctx := context.Background()
	root := csiproc.ShortRoot(t, "pcpart-")
	t.Cleanup(func() {
		// A test that failed half way leaves node A's fenced mounts: taken
		// down here, after the drivers stopped, so the next run starts clean
		// (the leak check still reports what a passing run would have left).
		if t.Failed() {
			releaseUnder(root)
		}
	})
	var aPool, bPool string
	var cut, restore func()
	evict := func() {}
	switch backend {
	case "btrfs":
		testutil.RequireCommands(t, "mkfs.btrfs")
		mnt := testutil.LoopFS(t, root, "btrfs", 512*mib)
		bPool = filepath.Join(mnt, "pool")
		aPool = filepath.Join(root, "a-pool")
		for _, d := range []string{bPool, aPool} {
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		run(t, "mount", "--bind", bPool, aPool)
		cover := false
		t.Cleanup(func() {
			if cover {
				_ = unix.Unmount(aPool, 0)
			}
			_ = unix.Unmount(aPool, 0)
		})
		cut = func() { run(t, "mount", "-t", "tmpfs", "-o", "size=1m", "cut", aPool); cover = true }
		restore = func() { run(t, "umount", aPool); cover = false }
	case "cephfs":
		c := cephfs.Shared(t)
		dir, err := os.MkdirTemp(c.Mounts[0], "partition-")
		if err != nil {
			t.Fatal(err)
		}
		aPool, bPool = dir, filepath.Join(c.Mounts[1], filepath.Base(dir))
		paused := false
		t.Cleanup(func() {
			if paused {
				_ = c.ResumeClient(0)
			}
			// Node A gets a working client back for the tests after.
			if _, err := c.EvictClient(ctx, 0); err != nil {
				t.Errorf("evict node A: %v", err)
			}
			if err := c.Remount(ctx, 0); err != nil {
				t.Errorf("remount node A: %v", err)
			}
		})
		cut = func() {
			if err := c.PauseClient(0); err != nil {
				t.Fatal(err)
			}
			paused = true
		}
		// What the MDS does to a client that stays silent past
		// session_autoclose: evict it and blocklist it (here once A's lease
		// has run out, rather than after 300 s). Until then A's capabilities
		// hold the volume's lock and image: nothing of another node's gets
		// through.
		evict = func() {
			if _, err := c.EvictClient(ctx, 0); err != nil {
				t.Fatal(err)
			}
		}
		restore = func() {
			if err := c.ResumeClient(0); err != nil {
				t.Fatal(err)
			}
			paused = false
		}
	default:
		t.Fatalf("unknown backend %q", backend)
	}
	if out, err := exec.Command(csiproc.Binary(t), "pool", "init", "--path", bPool, "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}
	dA := csiproc.Start(t, csiproc.Options{NodeID: "node-a", Pools: []string{"shared=" + aPool + ",shared"}, Args: leaseArgs})
	dB := csiproc.Start(t, csiproc.Options{NodeID: "node-b", Pools: []string{"shared=" + bPool + ",shared"}, Args: leaseArgs})
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	v := must(dB.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-part", VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 * mib}}))(t).GetVolume()
	id := v.GetVolumeId()
	// A failure after the fence leaves node A's fenced device, whose backing
	// file releaseUnder cannot match once A's pool is detached: it would fail
	// every later run's check that the unstage took it (the key is the same).
	t.Cleanup(func() {
		if t.Failed() {
			releaseVolume(id)
		}
	})
	must(dB.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-a", VolumeCapability: vc}))(t)
	aDir := filepath.Join(root, "node-a")
	stagingA, targetA := filepath.Join(aDir, "staging"), filepath.Join(aDir, "target")
	must(dA.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: stagingA, VolumeCapability: vc}))(t)
	must(dA.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: stagingA, TargetPath: targetA, VolumeCapability: vc}))(t)

	w := startWriter(t, filepath.Join(targetA, "a.dat"))
	w.waitAcked(t, 20)
	cutAt := time.Now()
	cut()
	t.Logf("%s: node A's pool cut after %d acknowledged writes", backend, w.acked())

	// The controller (node B's) is asked to force-detach at once, and keeps
	// being asked, as the external-attacher retries.
	var detachedAt time.Time
	evicted := false
	for deadline := time.Now().Add(leaseExpiry + 90*time.Second); ; time.Sleep(500 * time.Millisecond) {
		if !evicted && time.Since(cutAt) > leaseDuration {
			evict()
			evicted = true
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := dB.Controller().ControllerUnpublishVolume(cctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
		cancel()
		if err == nil {
			detachedAt = time.Now()
			break
		}
		// UNAVAILABLE: A's lease is not expired yet; ABORTED or
		// DEADLINE_EXCEEDED: A's client still holds the volume's lock.
		if c := status.Code(err); c != codes.Unavailable && c != codes.Aborted && c != codes.DeadlineExceeded {
			t.Fatalf("force-detach: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("force-detach never allowed: %v", err)
		}
	}
	if waited := detachedAt.Sub(cutAt); waited < leaseExpiry {
		t.Fatalf("the volume was force-detached %s after the cut, before A's lease (%s) could have expired", waited, leaseExpiry)
	}
	// A fences at its lease's duration after its last renewal (at the cut at
	// the latest), by its own clock; the controller lets B take the volume
	// only at duration plus margin, the margin being what a late timer or a
	// clock's drift may eat. So the safety line is the expiry: a write of A's
	// acknowledged past it fails the test; one past the duration only, a
	// timer that fired late on a loaded machine (26 ms were seen), is logged.
	lastAck := w.lastAck()
	if !lastAck.Before(cutAt.Add(leaseExpiry)) {
		t.Fatalf("node A's last write was acknowledged %s after the cut, past its lease's expiry (%s), when the controller may give the volume to another node", lastAck.Sub(cutAt), leaseExpiry)
	}
	if late := lastAck.Sub(cutAt.Add(leaseDuration)); late >= 0 {
		t.Logf("%s: node A's last write was acknowledged %s past its lease's duration, inside the margin (a fence timer late under load)", backend, late)
	}
	t.Logf("%s: force-detach allowed %s after the cut; A's last acknowledged write %s after it", backend, detachedAt.Sub(cutAt).Round(time.Millisecond), lastAck.Sub(cutAt).Round(time.Millisecond))
	if backend == "cephfs" {
		restore() // B cannot take the image's capabilities from A until the MDS evicts A
		restore = func() {}
	}
	// On this one machine both nodes share one kernel: B must not find A's
	// loop device before A's fence has emptied it (on two machines B never
	// sees A's devices at all).
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(dA.Log(), "Fenced a loop device"); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("node A's fence of its loop device never finished")
		}
	}

	// Node B takes the volume and writes.
	must(dB.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-b", VolumeCapability: vc}))(t)
	bDir := filepath.Join(root, "node-b")
	stagingB, targetB := filepath.Join(bDir, "staging"), filepath.Join(bDir, "target")
	must(dB.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: stagingB, VolumeCapability: vc}))(t)
	must(dB.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: stagingB, TargetPath: targetB, VolumeCapability: vc}))(t)
	seen := readBlocks(t, filepath.Join(targetB, "a.dat"))
	bFirst := time.Now()
	bData := bytes.Repeat([]byte("node B's data "), 4096)
	if err := os.WriteFile(filepath.Join(targetB, "b.dat"), bData, 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, "sync", "-f", filepath.Join(targetB, "b.dat"))

	// A's pool comes back; A, still running, gets time to write anything it
	// held back, and then cleans up as kubelet does after the pods went.
	restore()
	time.Sleep(3 * time.Second)
	w.stop()
	if _, err := dA.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetA}); err != nil {
		t.Errorf("node A rejoining: unpublish: %v", err)
	}
	if _, err := dA.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagingA}); err != nil {
		t.Errorf("node A rejoining: unstage: %v", err)
	}
	if strings.Contains(dA.Log(), "Fencing this node off the pool") == false {
		t.Error("node A never fenced itself")
	}
	// Its fenced device went with the unstage, even where the pool's client
	// was evicted (the kernel then cannot stat the backing file, so only
	// sysfs tells a fenced device), and left no read-only flag behind.
	if devs := fencedDevices(id); len(devs) > 0 {
		t.Errorf("node A rejoining: unstage left the fenced loop device(s) %v of the volume attached", devs)
	}

	// What the volume holds, read on B once more from a fresh stage.
	must(dB.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetB}))(t)
	must(dB.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagingB}))(t)
	must(dB.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: stagingB, VolumeCapability: vc}))(t)
	must(dB.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: stagingB, TargetPath: targetB, VolumeCapability: vc}))(t)
	if got, err := os.ReadFile(filepath.Join(targetB, "b.dat")); err != nil || !bytes.Equal(got, bData) {
		t.Fatalf("node B's data: %d bytes, %v", len(got), err)
	}
	final := readBlocks(t, filepath.Join(targetB, "a.dat"))
	for seq, at := range final {
		if !at.Before(bFirst) {
			t.Errorf("block %d of node A, issued %s after node B's first write, reached the volume", seq, at.Sub(bFirst))
		}
		if _, ok := seen[seq]; !ok {
			t.Errorf("block %d of node A arrived after node B took the volume", seq)
		}
	}
	t.Logf("%s: node A's %d blocks on the volume, none late; node B's data intact", backend, len(final))
	must(dB.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetB}))(t)
	must(dB.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagingB}))(t)
	must(dB.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-b"}))(t)
	must(dB.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}))(t)
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// writer writes block after block, each "A <seq> <unix nanoseconds>" and
// synced, and remembers which writes were acknowledged.
type writer struct {
	mu      sync.Mutex
	seq     int
	last    time.Time
	stopped chan struct{}
	done    chan struct{}
}

func startWriter(t *testing.T, path string) *writer {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{stopped: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		defer f.Close()
		buf := make([]byte, blockSize)
		for seq := 1; ; seq++ {
			select {
			case <-w.stopped:
				return
			default:
			}
			clear(buf)
			copy(buf, fmt.Sprintf("A %d %d\n", seq, time.Now().UnixNano()))
			if _, err := f.WriteAt(buf, int64(seq)*blockSize); err != nil {
				time.Sleep(50 * time.Millisecond)
				continue
			}
			if err := f.Sync(); err != nil {
				time.Sleep(50 * time.Millisecond)
				continue
			}
			w.mu.Lock()
			w.seq, w.last = seq, time.Now()
			w.mu.Unlock()
			time.Sleep(10 * time.Millisecond)
		}
	}()
	t.Cleanup(w.stop)
	return w
}

func (w *writer) acked() int { w.mu.Lock(); defer w.mu.Unlock(); return w.seq }

func (w *writer) lastAck() time.Time { w.mu.Lock(); defer w.mu.Unlock(); return w.last }

func (w *writer) waitAcked(t *testing.T, n int) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); w.acked() < n; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("only %d writes acknowledged", w.acked())
		}
	}
}

// stop ends the writer; a write stuck in the kernel (a hung pool) is left to
// end on its own.
func (w *writer) stop() {
	select {
	case <-w.stopped:
	default:
		close(w.stopped)
	}
	select {
	case <-w.done:
	case <-time.After(5 * time.Second):
	}
}

// readBlocks reads node A's blocks: sequence number to the time it was issued.
func readBlocks(t *testing.T, path string) map[int]time.Time {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]time.Time{}
	for off := 0; off+blockSize <= len(raw); off += blockSize {
		line, _, _ := bytes.Cut(raw[off:off+blockSize], []byte("\n"))
		f := strings.Fields(string(line))
		if len(f) != 3 || f[0] != "A" {
			continue
		}
		seq, err1 := strconv.Atoi(f[1])
		ns, err2 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil {
			t.Fatalf("a torn block at %d: %q", off, line)
		}
		out[seq] = time.Unix(0, ns)
	}
	return out
}

// fencedDevices lists the loop devices that sysfs shows fenced (a size limit of
// one byte) and backed by the image of volume id.
func fencedDevices(id string) []string {
	_, key, _ := strings.Cut(id, ".")
	suffix := "/volumes/" + key + "/disk.img"
	names, _ := filepath.Glob("/sys/block/loop*")
	var out []string
	for _, sys := range names {
		backing, _ := os.ReadFile(filepath.Join(sys, "loop", "backing_file"))
		limit, _ := os.ReadFile(filepath.Join(sys, "loop", "sizelimit"))
		if key != "" && strings.HasSuffix(strings.TrimSpace(string(backing)), suffix) && strings.TrimSpace(string(limit)) == "1" {
			out = append(out, "/dev/"+filepath.Base(sys))
		}
	}
	return out
}

// releaseUnder unmounts everything mounted below root, deepest first, and
// detaches the loop devices backed by files below it.
func releaseUnder(root string) {
	raw, _ := os.ReadFile("/proc/self/mountinfo")
	var points []string
	for _, line := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], root+"/") {
			points = append(points, f[4])
		}
	}
	for i := len(points) - 1; i >= 0; i-- {
		_ = unix.Unmount(points[i], unix.MNT_DETACH)
	}
	out, _ := exec.Command("losetup", "-a").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if dev, rest, ok := strings.Cut(line, ":"); ok && strings.Contains(rest, root+"/") {
			// A fenced device is read-only (BLKROSET), which outlives losetup -d.
			_ = exec.Command("blockdev", "--setrw", dev).Run()
			_ = exec.Command("losetup", "-d", dev).Run()
		}
	}
}
