package mount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// newImage creates a sparse file of size bytes in a per-test temp dir (removed
// last, after the loop and mount cleanups registered later).
func newImage(t testing.TB, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return p
}

func newLoops(t testing.TB) *Loops {
	t.Helper()
	l, err := NewLoops()
	if err != nil {
		t.Fatalf("NewLoops: %v", err)
	}
	return l
}

// attach registers the detach before attaching, so a test that fails right
// after (or inside) Attach still releases the device.
func attach(t testing.TB, l *Loops, file string) string {
	t.Helper()
	// Detached by file, never by device name: once this test's device is
	// released, another process may already hold the same name.
	t.Cleanup(func() {
		if err := l.Detach(context.Background(), file); err != nil {
			t.Errorf("cleanup detach %s: %v", file, err)
		}
	})
	dev, err := l.Attach(context.Background(), file)
	if err != nil {
		t.Fatalf("Attach(%s): %v", file, err)
	}
	return dev
}

func mountT(t testing.TB, m *Mounter, source, target, fsType string, opts []string) {
	t.Helper()
	t.Cleanup(func() {
		if err := m.Unmount(context.Background(), target); err != nil {
			t.Errorf("cleanup unmount %s: %v", target, err)
		}
	})
	if err := m.Mount(context.Background(), source, target, fsType, opts); err != nil {
		t.Fatalf("Mount(%s, %s, %s): %v", source, target, fsType, err)
	}
}

func truncate(t testing.TB, file string, size int64) {
	t.Helper()
	if err := os.Truncate(file, size); err != nil {
		t.Fatal(err)
	}
}

func fsBytes(t testing.TB, path string) int64 {
	t.Helper()
	var s unix.Statfs_t
	if err := unix.Statfs(path, &s); err != nil {
		t.Fatalf("statfs %s: %v", path, err)
	}
	return int64(s.Blocks) * s.Bsize
}

func requireLoops(t testing.TB, cmds ...string) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, cmds...)
}

func TestAttachTwiceSameDevice(t *testing.T) {
	requireLoops(t)
	l := newLoops(t)
	file := newImage(t, 8<<20)
	dev := attach(t, l, file)

	again, err := l.Attach(context.Background(), file)
	if err != nil || again != dev {
		t.Fatalf("second Attach = %q, %v; want %q", again, err, dev)
	}
	// Another path to the same inode must not attach the file a second time.
	link := filepath.Join(t.TempDir(), "link.img")
	if err := os.Symlink(file, link); err != nil {
		t.Fatal(err)
	}
	if viaLink, err := l.Attach(context.Background(), link); err != nil || viaLink != dev {
		t.Fatalf("Attach via symlink = %q, %v; want %q", viaLink, err, dev)
	}
	// Nor may a second Loops (another process, a restarted driver).
	if other, err := newLoops(t).Attach(context.Background(), file); err != nil || other != dev {
		t.Fatalf("Attach from a fresh Loops = %q, %v; want %q", other, err, dev)
	}

	st, err := l.Status(dev)
	if err != nil {
		t.Fatal(err)
	}
	if st.BackingFile != file || st.BackingDeleted || st.SizeBytes != 8<<20 {
		t.Errorf("Status = %+v", st)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(file, &sfs); err != nil {
		t.Fatal(err)
	}
	switch sfs.Type {
	case unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC, unix.BTRFS_SUPER_MAGIC:
		if !st.DirectIO {
			t.Errorf("direct I/O is off on a backing fs that supports it (%s)", file)
		}
		if b, _ := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop/dio")); string(b) != "1\n" {
			t.Errorf("sysfs dio = %q, want 1", b)
		}
	default:
		t.Logf("backing fs type %#x: not asserting direct I/O", sfs.Type)
	}
}

func TestFindAfterRestart(t *testing.T) {
	requireLoops(t)
	file := newImage(t, 4<<20)
	dev := attach(t, newLoops(t), file)

	fresh := newLoops(t) // what a restarted driver builds
	got, ok, err := fresh.Find(file)
	if err != nil || !ok || got != dev {
		t.Fatalf("Find after restart = %q, %t, %v; want %q", got, ok, err, dev)
	}
	// A Loops built before the attach finds it through its rescan on a miss.
	early := newLoops(t)
	other := newImage(t, 4<<20)
	dev2 := attach(t, newLoops(t), other)
	if got, ok, err := early.Find(other); err != nil || !ok || got != dev2 {
		t.Fatalf("Find with stale map = %q, %t, %v; want %q", got, ok, err, dev2)
	}
	if _, ok, err := fresh.Find(newImage(t, 1<<20)); err != nil || ok {
		t.Fatalf("Find of an unattached file = %t, %v", ok, err)
	}
}

func TestDetachIdempotent(t *testing.T) {
	requireLoops(t)
	l := newLoops(t)
	file := newImage(t, 4<<20)
	dev := attach(t, l, file)
	for i := 0; i < 2; i++ {
		if err := l.Detach(context.Background(), file); err != nil {
			t.Fatalf("Detach #%d: %v", i+1, err)
		}
	}
	if _, err := l.Status(dev); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Status after detach: %v, want ErrNotExist", err)
	}
	if _, ok, err := l.Find(file); err != nil || ok {
		t.Errorf("Find after detach = %t, %v", ok, err)
	}
	if err := l.Detach(context.Background(), filepath.Join(t.TempDir(), "missing.img")); err != nil {
		t.Errorf("Detach of a missing file: %v", err)
	}
	if _, err := l.Status("/dev/null"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Status(/dev/null): %v, want ErrNotExist", err)
	}
}

func TestBackingDeleted(t *testing.T) {
	requireLoops(t)
	l := newLoops(t)
	file := newImage(t, 4<<20)
	dev := attach(t, l, file)
	if err := os.Remove(file); err != nil {
		t.Fatal(err)
	}
	st, err := l.Status(dev)
	if err != nil {
		t.Fatal(err)
	}
	if !st.BackingDeleted || st.BackingFile != file {
		t.Errorf("Status = %+v, want BackingDeleted for %s", st, file)
	}
	// The driver can still find and detach it by its old path.
	if got, ok, err := l.Find(file); err != nil || !ok || got != dev {
		t.Errorf("Find deleted = %q, %t, %v", got, ok, err)
	}
	if err := l.Detach(context.Background(), file); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Status(dev); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("device still attached after Detach: %v", err)
	}
}

func TestRefreshGrows(t *testing.T) {
	requireLoops(t)
	l := newLoops(t)
	file := newImage(t, 8<<20)
	dev := attach(t, l, file)
	truncate(t, file, 24<<20)
	if err := l.Refresh(dev); err != nil {
		t.Fatal(err)
	}
	if got, err := DeviceSize(dev); err != nil || got != 24<<20 {
		t.Fatalf("DeviceSize after refresh = %d, %v; want %d", got, err, 24<<20)
	}
}

func TestFormatRefusesFormatted(t *testing.T) {
	requireLoops(t, "blkid", "mkfs.ext4", "mkfs.xfs")
	ctx := context.Background()
	file := newImage(t, 32<<20)
	if got, err := DiskFormat(ctx, file); err != nil || got != "" {
		t.Fatalf("DiskFormat(blank) = %q, %v", got, err)
	}
	if err := Format(ctx, file, "ext4"); err != nil {
		t.Fatal(err)
	}
	if got, err := DiskFormat(ctx, file); err != nil || got != "ext4" {
		t.Fatalf("DiskFormat = %q, %v", got, err)
	}
	for _, fs := range []string{"ext4", "xfs"} {
		if err := Format(ctx, file, fs); !errors.Is(err, ErrAlreadyFormatted) {
			t.Errorf("Format(%s) over ext4: %v, want ErrAlreadyFormatted", fs, err)
		}
	}
	if err := Format(ctx, newImage(t, 32<<20), "vfat"); err == nil {
		t.Error("Format(vfat) succeeded")
	}
	if err := Format(ctx, newImage(t, 32<<20), "xfs"); err == nil {
		t.Error("Format(xfs) below MinSize succeeded")
	}
}

func TestFormatMountWrite(t *testing.T) {
	for _, tc := range []struct {
		fs   string
		size int64
		mkfs string
	}{
		{"ext4", 64 << 20, "mkfs.ext4"},
		{"xfs", 300 << 20, "mkfs.xfs"},
		{"btrfs", 128 << 20, "mkfs.btrfs"},
	} {
		t.Run(tc.fs, func(t *testing.T) {
			requireLoops(t, "blkid", "mount", "umount", tc.mkfs)
			ctx := context.Background()
			l, m := newLoops(t), NewMounter()
			file := newImage(t, tc.size)
			if err := Format(ctx, file, tc.fs); err != nil {
				t.Fatal(err)
			}
			dev := attach(t, l, file)
			target := filepath.Join(t.TempDir(), "mnt")
			mountT(t, m, dev, target, tc.fs, nil)
			// Retried stage: same mount again is a no-op, not a stacked mount.
			if err := m.Mount(ctx, dev, target, tc.fs, nil); err != nil {
				t.Fatalf("second Mount: %v", err)
			}
			info, ok, err := m.Info(target)
			if err != nil || !ok || info.FSType != tc.fs || info.ReadOnly || info.Source != dev {
				t.Fatalf("Info = %+v, %t, %v", info, ok, err)
			}
			if err := os.WriteFile(filepath.Join(target, "hello"), []byte("poolcsi"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := m.Unmount(ctx, target); err != nil {
				t.Fatalf("Unmount: %v", err)
			}
			if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("target left after Unmount: %v", err)
			}
			if err := m.Unmount(ctx, target); err != nil {
				t.Errorf("second Unmount: %v", err)
			}
			// The data survives a detach/attach/mount cycle.
			if err := l.Detach(ctx, file); err != nil {
				t.Fatal(err)
			}
			dev = attach(t, l, file)
			mountT(t, m, dev, target, tc.fs, []string{"ro"})
			if b, err := os.ReadFile(filepath.Join(target, "hello")); err != nil || string(b) != "poolcsi" {
				t.Errorf("read back = %q, %v", b, err)
			}
			if err := m.Mount(ctx, dev, target, tc.fs, nil); !errors.Is(err, ErrMountConflict) {
				t.Errorf("rw Mount over ro mount: %v, want ErrMountConflict", err)
			}
			if err := l.Detach(ctx, file); !errors.Is(err, ErrDeviceBusy) {
				t.Errorf("Detach while mounted: %v, want ErrDeviceBusy", err)
			}
		})
	}
}

// Info answers for paths that do not resolve without reading mountinfo, and still
// finds a mount through a symlink to it.
func TestInfoPaths(t *testing.T) {
	dir := t.TempDir()
	m := NewMounter()
	for _, p := range []string{
		filepath.Join(dir, "missing"),
		filepath.Join(dir, "missing", "below"),
		filepath.Join(dir, "dangling"),
	} {
		if err := os.Symlink(filepath.Join(dir, "nowhere"), filepath.Join(dir, "dangling")); err != nil && !errors.Is(err, os.ErrExist) {
			t.Fatal(err)
		}
		if info, ok, err := m.Info(p); err != nil || ok {
			t.Errorf("Info(%s) = %+v, %t, %v; want not mounted", p, info, ok, err)
		}
	}
	// / is always a mount point, also when named through a symlink.
	if err := os.Symlink("/", filepath.Join(dir, "root")); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := m.Info(filepath.Join(dir, "root")); err != nil || !ok {
		t.Errorf("Info(symlink to /) = %t, %v; want mounted", ok, err)
	}
}

// Info's statx shortcut (a path that is no mount's root is not mounted) gives
// mountinfo's answer for mount roots, paths below them, bind mounts of a
// directory and of a file, and a path after its mount is gone.
func TestInfoAgreesWithMountinfo(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	fsRoot, sub, bindDir := filepath.Join(dir, "fs"), filepath.Join(dir, "fs", "sub"), filepath.Join(dir, "bind")
	file, bindFile := filepath.Join(dir, "file"), filepath.Join(dir, "bindfile")
	for _, d := range []string{fsRoot, bindDir} {
		if err := os.Mkdir(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{file, bindFile} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	mount := func(source, target, fsType string, flags uintptr) {
		if err := unix.Mount(source, target, fsType, flags, ""); err != nil {
			t.Fatalf("mount %s on %s: %v", source, target, err)
		}
		t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	}
	mount("poolcsi-test", fsRoot, "tmpfs", 0)
	if err := os.Mkdir(sub, 0o750); err != nil {
		t.Fatal(err)
	}
	mount(sub, bindDir, "", unix.MS_BIND)
	mount(file, bindFile, "", unix.MS_BIND)

	m := NewMounter()
	check := func(p string, want bool) {
		t.Helper()
		if root, known := mountRoot(p); !known {
			t.Errorf("statx does not say whether %s is a mount root on this kernel", p)
		} else if root != want {
			t.Errorf("mountRoot(%s) = %t, want %t", p, root, want)
		}
		info, ok, err := m.Info(p)
		if err != nil || ok != want {
			t.Errorf("Info(%s) = %+v, %t, %v; want mounted=%t", p, info, ok, err, want)
		}
	}
	for _, c := range []struct {
		path    string
		mounted bool
	}{{fsRoot, true}, {sub, false}, {bindDir, true}, {bindFile, true}, {file, false}, {dir, false}} {
		check(c.path, c.mounted)
	}
	if err := unix.Unmount(bindDir, 0); err != nil {
		t.Fatal(err)
	}
	check(bindDir, false)
}
