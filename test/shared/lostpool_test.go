package shared

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
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

// TestLostPoolNeverWritesLate: every way a node can lose a shared pool, with
// the real kernel. Two node plugins share a btrfs pool through their own
// mounts of it (node A through a bind mount, or a FUSE passthrough, bindfs,
// for the modes where the filesystem itself must hang or fail); A stages and
// publishes an ext4 image read-write and writes stamped blocks with
// O_DIRECT|O_SYNC (the writer of TestPartitionedNodeNeverWritesLate). A then
// loses its pool, in each mode, its node plugin optionally SIGKILLed and
// started again meanwhile. The controller (B's) is asked to force-detach at
// once and keeps being asked; B takes the volume and writes; A's pool comes
// back and A cleans up. No block of A's issued after B's first write may reach
// the volume, and none may arrive after B took it.
//
// Before the fence found its devices by its own records, "vanish" and
// "remount", with or without a restart, fenced nothing (the kernel shows the
// backing file of a detached mount without the pool's prefix), and A's writes
// reached the volume after B had it.
//
// Before a pool seen once was never laid out again and each renewal checked
// that the path shows the images of the node's attached devices,
// "cover-layout" (the cover of a pool with requireMount, which the driver
// may lay out by itself), with or without a restart, laid the pool out again
// in the cover and renewed A's lease there: A never fenced, and B took the
// volume beside A's live device.
//
// On the CephFS ("cephfs/..."), A's pool is a bind mount of a directory of
// its own ceph-fuse client's mount, B's the same directory through B's client;
// the FUSE modes act on A's ceph-fuse: paused (hang), or killed (eio), and
// evicted by the MDS at the lease's duration, as the MDS does a silent client.
func TestLostPoolNeverWritesLate(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid", "mkfs.btrfs")
	for _, b := range backends {
		modes := lostModes
		if b == "cephfs" {
			modes = cephLostModes
		}
		t.Run(b, func(t *testing.T) {
			for _, m := range modes {
				for _, restart := range []bool{false, true} {
					name := m.name
					if restart {
						name += "+restart"
					}
					t.Run(name, func(t *testing.T) { testLostPool(t, b, m, restart) })
				}
			}
		})
	}
}

// lostMode is one way for node A to lose its pool.
type lostMode struct {
	name string
	// fuse: A's pool is a bindfs passthrough of the btrfs pool, not a bind
	// mount.
	fuse bool
	// lose cuts A off its pool; evict, if set, runs at the lease duration
	// after the cut (what the storage does to a silent client: bindfs has
	// no server that could); back gives A its pool again, after the
	// force-detach went through when backEarly, else after B wrote.
	lose, evict, back func(t *testing.T, l *lostPool)
	backEarly         bool
	// layOut: A's pool is one the driver may lay out by itself (a config
	// file's pool with requireMount, as a mount stanza makes it), not one
	// an admin laid out once.
	layOut bool
}

// lostPool is the test's pool as node A sees it.
type lostPool struct {
	aPool, bPool string
	aSrc         string          // what A's bind mount at aPool shows (not in the btrfs FUSE modes)
	daemon       *exec.Cmd       // bindfs, for the btrfs FUSE modes
	ceph         *cephfs.Cluster // on the CephFS: A's client is client 0
	covered      int             // mounts stacked on aPool by lose
}

var lostModes = []lostMode{
	{name: "vanish", lose: lazyUnmount, back: remount},
	{name: "cover", lose: cover, back: uncover},
	// cover-layout: the cover of a pool the driver may lay out by itself. It
	// used to lay the pool out again in the empty tmpfs and renew A's lease
	// there: A never fenced while its device still wrote the pool.
	{name: "cover-layout", layOut: true, lose: cover, back: uncoverUntouched},
	{name: "remount", lose: lazyUnmount, back: remount, backEarly: true},
	{name: "readonly", lose: readOnly, back: uncover},
	{name: "hang", fuse: true, lose: func(t *testing.T, l *lostPool) {
		if err := l.daemon.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}, evict: killDaemon, back: remountFUSE},
	{name: "eio", fuse: true, lose: killDaemon, back: remountFUSE},
}

// cephLostModes are the modes on the CephFS. A's ceph-fuse, silent (paused or
// dead), keeps its capabilities on the image until the MDS evicts it, which
// evict does at the lease's duration: B could not take the image before. A
// paused client is let run again once the force-detach went through (the
// fence's ioctl may wait for it): evicted and blocklisted, nothing of its
// reaches the OSDs; a killed one is replaced by a new client after B wrote.
var cephLostModes = []lostMode{
	{name: "vanish", lose: lazyUnmount, back: remount},
	{name: "cover", lose: cover, back: uncover},
	{name: "remount", lose: lazyUnmount, back: remount, backEarly: true},
	{name: "readonly", lose: readOnly, back: uncover},
	{name: "hang", fuse: true, lose: func(t *testing.T, l *lostPool) {
		if err := l.ceph.PauseClient(0); err != nil {
			t.Fatal(err)
		}
	}, evict: evictCeph, back: func(t *testing.T, l *lostPool) {
		if err := l.ceph.ResumeClient(0); err != nil {
			t.Fatal(err)
		}
	}, backEarly: true},
	{name: "eio", fuse: true, lose: func(t *testing.T, l *lostPool) { l.ceph.KillClient(0) }, evict: evictCeph, back: remountCeph},
}

func cover(t *testing.T, l *lostPool) {
	run(t, "mount", "-t", "tmpfs", "-o", "size=1m", "cut", l.aPool)
	l.covered++
}

// readOnly: the pool answers reads, refuses writes: a read-only mount of it
// over A's (an export turned read-only). A's open image stays writable
// through the mount below, which its lease cannot reach.
func readOnly(t *testing.T, l *lostPool) {
	run(t, "mount", "--bind", "-o", "ro", l.bPool, l.aPool)
	l.covered++
}

func evictCeph(t *testing.T, l *lostPool) {
	if _, err := l.ceph.EvictClient(context.Background(), 0); err != nil {
		t.Fatalf("evict node A's client: %v", err)
	}
}

// remountCeph gives A a new ceph-fuse client, and its pool through it.
func remountCeph(t *testing.T, l *lostPool) {
	if err := unix.Unmount(l.aPool, unix.MNT_DETACH); err != nil {
		t.Fatalf("umount -l %s: %v", l.aPool, err)
	}
	if err := l.ceph.Remount(context.Background(), 0); err != nil {
		t.Fatalf("remount node A's client: %v", err)
	}
	remount(t, l)
}

func lazyUnmount(t *testing.T, l *lostPool) {
	if err := unix.Unmount(l.aPool, unix.MNT_DETACH); err != nil {
		t.Fatalf("umount -l %s: %v", l.aPool, err)
	}
}

func remount(t *testing.T, l *lostPool) { run(t, "mount", "--bind", l.aSrc, l.aPool) }

// uncover removes the covers. The driver's loops (lease renewals, the
// fence's checks, Probe) may hold a descriptor on the cover for a moment, so
// a busy unmount is tried again for a while before it is detached lazily,
// as an operator would.
func uncover(t *testing.T, l *lostPool) {
	for ; l.covered > 0; l.covered-- {
		var err error
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if err = unix.Unmount(l.aPool, 0); !errors.Is(err, unix.EBUSY) {
				break
			}
		}
		if errors.Is(err, unix.EBUSY) {
			t.Logf("the cover of %s stayed busy for 10 s: detaching it lazily", l.aPool)
			err = unix.Unmount(l.aPool, unix.MNT_DETACH)
		}
		if err != nil {
			t.Fatalf("umount %s: %v", l.aPool, err)
		}
	}
}

// uncoverUntouched is uncover, once it checked that node A wrote nothing
// into the cover (no pool laid out, no lease, no registration).
func uncoverUntouched(t *testing.T, l *lostPool) {
	if ents, err := os.ReadDir(l.aPool); err != nil || len(ents) != 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("node A wrote into the cover of its pool: %v (%v)", names, err)
	}
	uncover(t, l)
}

// killDaemon kills node A's FUSE daemon: the kernel then fails everything
// on the mount, and everything it had queued (ENOTCONN, EIO).
func killDaemon(t *testing.T, l *lostPool) {
	_ = l.daemon.Process.Signal(syscall.SIGKILL)
	_, _ = l.daemon.Process.Wait()
}

func remountFUSE(t *testing.T, l *lostPool) {
	if err := unix.Unmount(l.aPool, unix.MNT_DETACH); err != nil {
		t.Fatalf("umount -l %s: %v", l.aPool, err)
	}
	l.daemon = startBindfs(t, l.bPool, l.aPool)
}

// startBindfs mounts src at dst through bindfs in the foreground (the daemon
// is the process returned) and waits until the mount is there.
func startBindfs(t *testing.T, src, dst string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("bindfs", "-f", src, dst)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
	})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var st unix.Statfs_t
		if unix.Statfs(dst, &st) == nil && st.Type == 0x65735546 { // FUSE_SUPER_MAGIC
			return cmd
		}
		if time.Now().After(deadline) {
			t.Fatalf("bindfs %s %s never mounted", src, dst)
		}
	}
}

func testLostPool(t *testing.T, backend string, m lostMode, restart bool) {
	if m.fuse && backend == "btrfs" {
		testutil.RequireCommands(t, "bindfs", "fusermount3")
	}
	ctx := context.Background()
	root := csiproc.ShortRoot(t, "pclost-")
	t.Cleanup(func() {
		if t.Failed() {
			releaseUnder(root)
		}
	})
	l := &lostPool{aPool: filepath.Join(root, "a-pool")}
	if err := os.Mkdir(l.aPool, 0o755); err != nil {
		t.Fatal(err)
	}
	switch backend {
	case "btrfs":
		mnt := testutil.LoopFS(t, root, "btrfs", 512*mib)
		l.bPool = filepath.Join(mnt, "pool")
		l.aSrc = l.bPool
		if err := os.Mkdir(l.bPool, 0o755); err != nil {
			t.Fatal(err)
		}
	case "cephfs":
		l.ceph = cephfs.Shared(t)
		dir, err := os.MkdirTemp(l.ceph.Mounts[0], "lost-")
		if err != nil {
			t.Fatal(err)
		}
		l.aSrc, l.bPool = dir, filepath.Join(l.ceph.Mounts[1], filepath.Base(dir))
		if m.fuse {
			// Runs last: node A gets a working client back for the tests
			// after, once its pool's mount here is gone.
			t.Cleanup(func() {
				_ = l.ceph.ResumeClient(0)
				if _, err := l.ceph.EvictClient(ctx, 0); err != nil {
					t.Errorf("evict node A: %v", err)
				}
				if err := l.ceph.Remount(ctx, 0); err != nil {
					t.Errorf("remount node A: %v", err)
				}
			})
		}
	default:
		t.Fatalf("unknown backend %q", backend)
	}
	if m.fuse && backend == "btrfs" {
		l.daemon = startBindfs(t, l.bPool, l.aPool)
	} else {
		run(t, "mount", "--bind", l.aSrc, l.aPool)
	}
	t.Cleanup(func() {
		// Whatever is left on A's pool path, the last first.
		for range 4 {
			if unix.Unmount(l.aPool, unix.MNT_DETACH) != nil {
				break
			}
		}
	})
	if out, err := exec.Command(csiproc.Binary(t), "pool", "init", "--path", l.bPool, "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}
	aOpts := csiproc.Options{NodeID: "node-a", Pools: []string{"shared=" + l.aPool + ",shared"}, Args: leaseArgs}
	if m.layOut {
		conf := filepath.Join(root, "node-a.yaml")
		if err := os.WriteFile(conf, []byte("pools:\n- name: shared\n  path: "+l.aPool+"\n  shared: true\n  requireMount: true\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		aOpts.Pools, aOpts.Args = nil, append([]string{"--config", conf}, leaseArgs...)
	}
	dA := csiproc.Start(t, aOpts)
	if m.layOut {
		// The chart's livenessprobe asks node A's Probe every few seconds
		// (here every half second, 3 s deadline): Probe runs the pools'
		// checks, which is where a pool is laid out late.
		probeCtx, stopProbes := context.WithCancel(ctx)
		probed := make(chan struct{})
		t.Cleanup(func() { stopProbes(); <-probed })
		go func() {
			defer close(probed)
			for ; probeCtx.Err() == nil; time.Sleep(500 * time.Millisecond) {
				pctx, cancel := context.WithTimeout(probeCtx, csiproc.ProbeTimeout)
				_, _ = dA.Identity().Probe(pctx, &csi.ProbeRequest{})
				cancel()
			}
		}()
	}
	dB := csiproc.Start(t, csiproc.Options{NodeID: "node-b", Pools: []string{"shared=" + l.bPool + ",shared"}, Args: leaseArgs})
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	v := must(dB.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-lost", VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 * mib}}))(t).GetVolume()
	id := v.GetVolumeId()
	t.Cleanup(func() {
		if t.Failed() {
			releaseVolume(id)
		}
	})
	// A pool that is slow to answer (a CephFS client waits for another's
	// capabilities) is served before node A registered with it: the attacher
	// retries, as here.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		_, err := dB.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-a", VolumeCapability: vc})
		if err == nil {
			break
		}
		if status.Code(err) != codes.NotFound || time.Now().After(deadline) {
			t.Fatalf("publish to node A: %v", err)
		}
	}
	aDir := filepath.Join(root, "node-a")
	stagingA, targetA := filepath.Join(aDir, "staging"), filepath.Join(aDir, "target")
	must(dA.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: stagingA, VolumeCapability: vc}))(t)
	must(dA.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: stagingA, TargetPath: targetA, VolumeCapability: vc}))(t)

	w := startWriter(t, filepath.Join(targetA, "a.dat"))
	w.waitAcked(t, 20)
	cutAt := time.Now()
	m.lose(t, l)
	if restart {
		// A crash of A's node plugin while the pool is lost: the new one
		// cannot read the pool (its start hangs on a pool that hangs), and
		// must fence from its own records.
		dA.Kill()
		dA.Spawn(t)
	}
	t.Logf("%s: node A's pool lost after %d acknowledged writes", m.name, w.acked())

	// When A's fence decided, by its log, watched on its own: a
	// force-detach asked of a controller whose CephFS client waits for A's
	// capabilities blocks for seconds.
	fenced := make(chan time.Time, 1)
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	go func() {
		for ; watchCtx.Err() == nil; time.Sleep(50 * time.Millisecond) {
			if strings.Contains(dA.Log(), "Fencing this node off the pool") {
				fenced <- time.Now()
				return
			}
		}
	}()
	var detachedAt, fencedAt time.Time
	fencedBy := func() time.Time {
		if fencedAt.IsZero() {
			select {
			case fencedAt = <-fenced:
			default:
			}
		}
		return fencedAt
	}
	evicted := m.evict == nil
	for deadline := time.Now().Add(leaseExpiry + 60*time.Second); ; time.Sleep(250 * time.Millisecond) {
		if !evicted && time.Since(cutAt) > leaseDuration+1500*time.Millisecond {
			// The fence's decision came while the pool hung: it waited
			// for nothing of it.
			if fencedBy().IsZero() {
				t.Fatalf("node A had not fenced itself %s after the cut, its pool hanging", time.Since(cutAt).Round(time.Millisecond))
			}
			m.evict(t, l)
			evicted = true
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := dB.Controller().ControllerUnpublishVolume(cctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
		cancel()
		if err == nil {
			detachedAt = time.Now()
			break
		}
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
	if m.backEarly {
		m.back(t, l)
	}
	// One kernel for both nodes: B must not find A's device before A's
	// fence has emptied it (on two machines B never sees A's devices).
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(dA.Log(), "Fenced a loop device"); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("node A's fence of its loop device never finished\n%s", grepLog(dA.Log(), "ence"))
		}
	}
	lastAck := w.lastAck()

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
	t.Logf("%s: fence decided %s after the cut, force-detach allowed after %s, A's last acknowledged write after %s, B's first write after %s",
		m.name, since(fencedBy(), cutAt), since(detachedAt, cutAt), since(lastAck, cutAt), since(bFirst, cutAt))

	// A's pool comes back; A, still running, gets time to write anything
	// it held back, then cleans up as kubelet does.
	if !m.backEarly {
		m.back(t, l)
	}
	time.Sleep(3 * time.Second)
	w.stop()
	dA.WaitReady(t)
	if _, err := dA.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetA}); err != nil {
		t.Errorf("node A rejoining: unpublish: %v", err)
	}
	if _, err := dA.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagingA}); err != nil {
		t.Errorf("node A rejoining: unstage: %v", err)
	}
	if devs := fencedDevices(id); len(devs) > 0 {
		t.Errorf("node A rejoining: unstage left the fenced loop device(s) %v of the volume attached", devs)
	}
	if strings.Contains(dA.Log(), "FENCE FAILED CLOSED") {
		t.Errorf("node A's fence failed closed: its records did not find its device\n%s", grepLog(dA.Log(), "ence"))
	}

	must(dB.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetB}))(t)
	must(dB.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagingB}))(t)
	must(dB.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: stagingB, VolumeCapability: vc}))(t)
	must(dB.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: stagingB, TargetPath: targetB, VolumeCapability: vc}))(t)
	if got, err := os.ReadFile(filepath.Join(targetB, "b.dat")); err != nil || !bytes.Equal(got, bData) {
		t.Fatalf("node B's data: %d bytes, %v", len(got), err)
	}
	final := readBlocks(t, filepath.Join(targetB, "a.dat"))
	late := 0
	for seq, at := range final {
		if !at.Before(bFirst) {
			late++
			t.Errorf("block %d of node A, issued %s after node B's first write, reached the volume", seq, at.Sub(bFirst))
		}
		if _, ok := seen[seq]; !ok {
			t.Errorf("block %d of node A arrived after node B took the volume", seq)
		}
	}
	t.Logf("%s: node A's %d blocks on the volume, %d late; node B's data intact", m.name, len(final), late)
	must(dB.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: targetB}))(t)
	must(dB.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagingB}))(t)
	must(dB.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-b"}))(t)
	must(dB.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}))(t)
}

// releaseVolume detaches the loop devices of volume id's image that a failed
// run left: those of a lost pool show their backing file without the pool's
// path, which releaseUnder cannot match.
func releaseVolume(id string) {
	_, key, _ := strings.Cut(id, ".")
	names, _ := filepath.Glob("/sys/block/loop*")
	for _, sys := range names {
		backing, _ := os.ReadFile(filepath.Join(sys, "loop", "backing_file"))
		if key != "" && strings.HasSuffix(strings.TrimSpace(string(backing)), "/volumes/"+key+"/disk.img") {
			dev := "/dev/" + filepath.Base(sys)
			_ = exec.Command("blockdev", "--setrw", dev).Run()
			_ = exec.Command("losetup", "-d", dev).Run()
		}
	}
}

func since(t, from time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return t.Sub(from).Round(time.Millisecond).String()
}

// grepLog is the lines of a log that hold s.
func grepLog(log, s string) string {
	var out []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, s) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}
