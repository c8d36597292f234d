package mount

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/mount/mkfsns"
	"github.com/poolcsi/poolcsi/internal/testutil"
)

// deadFUSELoop leaves on the host what a shared pool whose FUSE client died
// leaves (the fence keeps its loop devices attached): a FUSE passthrough
// (bindfs, SIGKILLed) holding an ext4 image attached to a loop device and
// mounted. Stat-ing the image then fails with ENOTCONN or ESHUTDOWN. The
// cleanups (unmount, detach, kill, lazy unmount of the FUSE) run even when
// the test fails. It returns the loop device's mount point, where
// shadowedImage names an empty file both on the mounted filesystem and, under
// it, in the directory it is mounted on.
func deadFUSELoop(t *testing.T) string {
	t.Helper()
	testutil.RequireCommands(t, "bindfs", "losetup", "mount", "umount", "mkfs.ext4")
	dir := t.TempDir()
	src, fuse, mnt := filepath.Join(dir, "src"), filepath.Join(dir, "fuse"), filepath.Join(dir, "mnt")
	for _, d := range []string{src, fuse, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	daemon := exec.Command("bindfs", "-f", src, fuse)
	if err := daemon.Start(); err != nil {
		t.Fatalf("bindfs: %v", err)
	}
	t.Cleanup(func() {
		_ = daemon.Process.Kill()
		_ = daemon.Wait()
		// Mounted cannot tell for a dead FUSE (its stat fails): asked
		// through the mount table instead.
		if ok, err := mountedInTable(fuse); ok || err != nil {
			if out, err := exec.Command("umount", "-l", fuse).CombinedOutput(); err != nil {
				t.Errorf("umount -l %s: %v\n%s", fuse, err, out)
			}
		}
	})
	for i := 0; ; i++ {
		if ok, _ := mountinfo.Mounted(fuse); ok {
			break
		}
		if i == 500 {
			t.Fatalf("bindfs did not mount %s", fuse)
		}
		time.Sleep(10 * time.Millisecond)
	}
	img := filepath.Join(fuse, "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 %s: %v\n%s", img, err, out)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup %s: %v\n%s", img, err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		// The FUSE is dead: the image cannot be named, the device can. No
		// other process can have taken the name while it is still attached.
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup -d %s: %v\n%s", dev, err, out)
		}
	})
	t.Cleanup(func() {
		if ok, _ := mountinfo.Mounted(mnt); ok {
			if out, err := exec.Command("umount", "-l", mnt).CombinedOutput(); err != nil {
				t.Errorf("umount -l %s: %v\n%s", mnt, err, out)
			}
		}
	})
	shadowed := filepath.Join(mnt, shadowedImage)
	if err := os.WriteFile(shadowed, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", dev, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount %s: %v\n%s", dev, err, out)
	}
	if err := os.WriteFile(shadowed, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := daemon.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = daemon.Wait()
	var st unix.Stat_t
	if err := unix.Stat(img, &st); err == nil || errors.Is(err, unix.ENOENT) {
		t.Fatalf("stat %s after killing bindfs: %v, want ENOTCONN-like", img, err)
	}
	return mnt
}

const shadowedImage = "shadowed.img"

func mountedInTable(path string) (bool, error) {
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	return len(ms) > 0, err
}

// TestFormatWithDeadFUSEMount: a dead FUSE mount holding a mounted loop
// device (a lost shared pool) must not stop Format on an unrelated local
// image, for any filesystem type. Before mkfs ran without the unreachable
// mounts, btrfs failed here ("cannot check mount status ...: Transport
// endpoint is not connected"); ext4 and xfs did not.
func TestFormatWithDeadFUSEMount(t *testing.T) {
	requireLoops(t, "mkfs.ext4", "mkfs.xfs", "mkfs.btrfs", "blkid")
	dead := deadFUSELoop(t)
	ctx := context.Background()
	for _, fs := range []string{"btrfs", "ext4", "xfs"} {
		t.Run(fs, func(t *testing.T) {
			img := newImage(t, MinSize(fs))
			if err := Format(ctx, img, fs); err != nil {
				t.Fatalf("Format(%s): %v", fs, err)
			}
			if got, err := DiskFormat(ctx, img); err != nil || got != fs {
				t.Fatalf("DiskFormat = %q, %v; want %q", got, err, fs)
			}
		})
	}
	// The test pools' helper formats the same way.
	t.Run("testutil.LoopFS", func(t *testing.T) {
		testutil.LoopFS(t, t.TempDir(), "btrfs", 128<<20)
	})
	// Detached from mkfs's private namespace only, never from the host's.
	if ok, err := mountinfo.Mounted(dead); err != nil || !ok {
		t.Fatalf("the dead pool's loop mount %s is gone from the host: %v, %v", dead, ok, err)
	}
}

// TestMkfsStillRefusesMounted: with the unreachable mounts detached from
// mkfs's view, mkfs's own mount check still sees every other mount: a
// mounted filesystem is refused, through its image or its loop device, even
// when forced past the signature check (mkfs.ext4 needs -F twice to format a
// mounted target, the driver passes it once; -f of mkfs.btrfs and mkfs.xfs
// never overrides it). mkfs.xfs checks block devices only: on an image file
// the driver's own guards (DiskFormat, no -f) are all there is, in any
// namespace.
func TestMkfsStillRefusesMounted(t *testing.T) {
	requireLoops(t, "mkfs.ext4", "mkfs.xfs", "mkfs.btrfs", "mount", "umount", "losetup")
	t.Run("dead FUSE", func(t *testing.T) {
		deadFUSELoop(t)
		mkfsRefusesMounted(t, func() {})
	})
	t.Run("hung FUSE", func(t *testing.T) {
		fuse, daemon := pausedFUSE(t, t.TempDir(), false)
		grownXFS(t, newLoops(t), NewMounter(), filepath.Join(fuse, "disk.img"))
		// The targets are mounted first: mount(8) and losetup(8) ask every
		// loop device for its backing file, which a hung pool's never
		// answers.
		mkfsRefusesMounted(t, func() { stop(t, daemon) })
	})
}

// mkfsRefusesMounted mounts a target of each case, calls hang, and then
// expects each mkfs refused.
func mkfsRefusesMounted(t *testing.T, hang func()) {
	type target struct{ name, fs, path string }
	var targets []target
	for _, tc := range []struct {
		fs     string
		device bool
	}{
		{"btrfs", false}, {"btrfs", true},
		{"ext4", false}, {"ext4", true},
		{"xfs", true},
	} {
		name := tc.fs + "/file"
		if tc.device {
			name = tc.fs + "/device"
		}
		dir := t.TempDir()
		testutil.LoopFS(t, dir, tc.fs, MinSize(tc.fs))
		path := filepath.Join(dir, tc.fs+".img")
		if tc.device {
			out, err := exec.Command("losetup", "-j", path).Output()
			dev, _, ok := strings.Cut(string(out), ":")
			if err != nil || !ok {
				t.Fatalf("losetup -j %s: %v, %q", path, err, out)
			}
			path = dev
		}
		targets = append(targets, target{name, tc.fs, path})
	}
	hang()
	for _, tc := range targets {
		t.Run(tc.name, func(t *testing.T) {
			cmd, args := mkfsArgs(tc.fs, tc.path)
			if tc.fs != "ext4" {
				args = append([]string{"-f"}, args...)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			out, err := mkfsns.Run(ctx, tc.path, cmd, args...)
			if err == nil || !strings.Contains(string(out), "mounted") {
				t.Fatalf("%s %v on a mounted filesystem: %v, %s; want it refused as mounted", cmd, args, err, out)
			}
		})
	}
}

// TestMkfsNeverFormatsAnotherFile: a target reached through one of the
// mounts detached from mkfs's view would be another file (or none) there;
// mkfs must not run.
func TestMkfsNeverFormatsAnotherFile(t *testing.T) {
	requireLoops(t, "mkfs.ext4")
	target := filepath.Join(deadFUSELoop(t), shadowedImage)
	out, err := mkfsns.Run(context.Background(), target, "mkfs.ext4", "-F", "-q", target)
	if err == nil || !strings.Contains(err.Error(), "another file") {
		t.Fatalf("mkfs of %s through a detached mount: %v, %s; want it refused as another file", target, err, out)
	}
}

// hungFUSELoop leaves on the host what a shared pool whose client hangs
// leaves: an xfs image on a FUSE passthrough whose daemon is stopped,
// attached to a loop device and mounted. Stat-ing the image then blocks until
// the test ends (cleanup lets the daemon run again first).
func hungFUSELoop(t *testing.T) string {
	t.Helper()
	requireLoops(t, "bindfs", "mkfs.xfs")
	fuse, daemon := pausedFUSE(t, t.TempDir(), false)
	_, target := grownXFS(t, newLoops(t), NewMounter(), filepath.Join(fuse, "disk.img"))
	stop(t, daemon)
	return target
}

// TestFormatWithHungFUSELoop: mkfs.btrfs and mkfs.ext4 stat the backing
// file of every mounted loop device, so one image of a hung shared pool staged
// on the node hung every btrfs and ext4 mkfs there until the request's
// deadline (the scan for unreachable mounts gave up after its timeout and mkfs
// ran in the host's namespace). Each format must end, and the hung pool's
// mount stay on the host.
func TestFormatWithHungFUSELoop(t *testing.T) {
	requireLoops(t, "bindfs", "mkfs.ext4", "mkfs.xfs", "mkfs.btrfs", "blkid")
	hung := hungFUSELoop(t)
	for _, fs := range []string{"btrfs", "ext4", "xfs"} {
		t.Run(fs, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			img := newImage(t, MinSize(fs))
			start := time.Now()
			if err := Format(ctx, img, fs); err != nil {
				t.Fatalf("Format(%s) with a hung pool's image mounted on the node: %v", fs, err)
			}
			t.Logf("formatted in %v", time.Since(start))
		})
	}
	if ok, err := mountedInTable(hung); err != nil || !ok {
		t.Fatalf("the hung pool's loop mount %s is gone from the host: %v, %v", hung, ok, err)
	}
}
