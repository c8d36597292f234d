package mount

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// Growing an xfs volume must not depend on the rest of the node's mounts, and
// a growth still running in the kernel (left by a node plugin that was killed
// during it, or waiting on a pool that stopped answering) must make the next
// one wait and then answer ErrGrowUnderWay, never fail as if the volume were
// broken. Both with the real kernel: a FUSE passthrough (bindfs) whose daemon
// is stopped is a shared pool whose client hangs.

// pausedFUSE mounts a bindfs passthrough at dir/fuse over dir/src and returns
// its daemon. Cleanup lets the daemon run again, kills it and lazily unmounts
// the mount, after (registered before) whatever the test mounted on it.
//
// cacheAttrs keeps the files' attributes in the kernel for an hour: a stat (and
// a LOOP_GET_STATUS64 of a loop device on it, which losetup -a and mount -o
// loop anywhere on the machine make) answers while the daemon is stopped, and
// only reads and writes wait. Without it every stat reaches the daemon, as it
// does for a real client once its cache expires.
func pausedFUSE(t *testing.T, dir string, cacheAttrs bool) (fuse string, daemon *os.Process) {
	t.Helper()
	testutil.RequireCommands(t, "bindfs")
	src, fuse := filepath.Join(dir, "src"), filepath.Join(dir, "fuse")
	for _, d := range []string{src, fuse} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	opts := "attr_timeout=0,entry_timeout=0"
	if cacheAttrs {
		opts = "attr_timeout=3600,entry_timeout=3600"
	}
	cmd := exec.Command("bindfs", "-f", "-o", opts, src, fuse)
	if err := cmd.Start(); err != nil {
		t.Fatalf("bindfs: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if ok, _ := mountedInTable(fuse); ok {
			_ = unix.Unmount(fuse, unix.MNT_DETACH)
		}
	})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var st unix.Statfs_t
		if unix.Statfs(fuse, &st) == nil && st.Type == 0x65735546 { // FUSE_SUPER_MAGIC
			return fuse, cmd.Process
		}
		if time.Now().After(deadline) {
			t.Fatalf("bindfs never mounted %s", fuse)
		}
	}
}

// stop pauses the FUSE daemon until the test ends or resume is called.
func stop(t *testing.T, daemon *os.Process) (resume func()) {
	t.Helper()
	if err := daemon.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resume = func() { _ = daemon.Signal(syscall.SIGCONT) }
	t.Cleanup(resume)
	return resume
}

// grownXFS makes an xfs image of 300 MiB at file, attaches and mounts it, and
// doubles the file and the device: the filesystem is ready to grow.
func grownXFS(t *testing.T, l *Loops, m *Mounter, file string) (dev, target string) {
	t.Helper()
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	truncate(t, file, 300<<20)
	if err := Format(context.Background(), file, "xfs"); err != nil {
		t.Fatal(err)
	}
	dev = attach(t, l, file)
	target = filepath.Join(t.TempDir(), "mnt")
	mountT(t, m, dev, target, "xfs", nil)
	truncate(t, file, 600<<20)
	if err := l.Refresh(dev); err != nil {
		t.Fatal(err)
	}
	return dev, target
}

func TestGrowXFSWhileAnotherMountHangs(t *testing.T) {
	requireLoops(t, "bindfs", "mkfs.xfs")
	l, m := newLoops(t), NewMounter()
	_, daemon := pausedFUSE(t, t.TempDir(), false)
	dev, target := grownXFS(t, l, m, filepath.Join(t.TempDir(), "disk.img"))
	before := fsBytes(t, target)

	stop(t, daemon)
	// xfs_growfs resolved every mount point first and hung here until the
	// deadline killed it.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	start := time.Now()
	if err := m.ResizeFS(ctx, dev, target); err != nil {
		t.Fatalf("growing a local xfs while an unrelated FUSE mount hangs: %v", err)
	}
	t.Logf("grown in %v with a hung FUSE mount on the node", time.Since(start))
	if after := fsBytes(t, target); after <= before+(150<<20) {
		t.Fatalf("xfs size %d -> %d after doubling its device", before, after)
	}
}

func TestGrowWaitsForAGrowthUnderWay(t *testing.T) {
	requireLoops(t, "bindfs", "mkfs.xfs")
	l, m := newLoops(t), NewMounter()
	// The image lives on the FUSE mount: with its daemon stopped, the
	// kernel's growth blocks reading the new last block, holding xfs's grow
	// lock, as a growth on a hung shared pool does. Its attributes stay
	// cached, so that nothing else on the machine that lists loop devices
	// waits meanwhile.
	fuse, daemon := pausedFUSE(t, t.TempDir(), true)
	dev, target := grownXFS(t, l, m, filepath.Join(fuse, "disk.img"))
	// The growth this test leaves to the kernel holds the mount point open
	// until its ioctl returns, after the daemon runs again (the cleanup
	// registered next resumes it first): unmounting before that found the
	// mount busy (CI, stop 45), even after a later growth had succeeded.
	t.Cleanup(m.left.Wait)
	before := fsBytes(t, target)
	saved := growWait
	growWait = time.Second
	t.Cleanup(func() { growWait = saved })

	// What a growth reads of the device before the kernel grows (its format
	// probe) is read once now, so that it comes from the page cache while the
	// daemon is stopped: only the kernel's growth waits on the FUSE.
	f, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.ReadAt(make([]byte, 256<<10), 0)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}

	resume := stop(t, daemon)
	first := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		first <- m.ResizeFS(ctx, dev, target)
	}()
	if err := <-first; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a growth whose device stopped answering: %v, want the caller's deadline", err)
	}
	// The first growth still runs in the kernel: the next one waits for it,
	// then says so.
	if err := m.ResizeFS(context.Background(), dev, target); !errors.Is(err, ErrGrowUnderWay) {
		t.Fatalf("a growth while another is under way: %v, want ErrGrowUnderWay", err)
	}
	resume()
	// Once the first one ends, a growth finds the filesystem grown (or grows
	// it): either way the volume has its size.
	growWait = 30 * time.Second
	if err := m.ResizeFS(context.Background(), dev, target); err != nil {
		t.Fatalf("growth after the device answers again: %v", err)
	}
	if after := fsBytes(t, target); after <= before+(150<<20) {
		t.Fatalf("xfs size %d -> %d after doubling its device", before, after)
	}
}
