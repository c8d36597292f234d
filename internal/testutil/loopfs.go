package testutil

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/mount/mkfsns"
)

// LoopFS makes a filesystem of fsType in a sparse image of size bytes under dir,
// mounts it through a loop device (mount -o loop, which frees the device at
// unmount) and returns the mount point. The unmount is registered in t.Cleanup
// before the mount, so a failure half way leaves nothing behind.
func LoopFS(t testing.TB, dir, fsType string, size int64, mkfsArgs ...string) string {
	t.Helper()
	RequireRoot(t)
	RequireCommands(t, "mkfs."+fsType, "mount", "umount")
	img := filepath.Join(dir, fsType+".img")
	mnt := filepath.Join(dir, fsType+"-mnt")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	args := append(append([]string{}, mkfsArgs...), img)
	// Through the driver's mkfs path, so a dead mount left by another test
	// (a lost FUSE pool) cannot fail it.
	if out, err := mkfsns.Run(context.Background(), img, "mkfs."+fsType, args...); err != nil {
		t.Fatalf("mkfs.%s: %v\n%s", fsType, err, out)
	}
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ok, _ := mountinfo.Mounted(mnt); !ok {
			return
		}
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v\n%s", mnt, err, out)
		}
	})
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount %s: %v\n%s", img, err, out)
	}
	return mnt
}

// Tmpfs mounts a new, empty tmpfs of size (a mount option: "64m") at dir,
// unmounted lazily (whatever was mounted on top since) at the test's end.
func Tmpfs(t testing.TB, dir, size string) {
	t.Helper()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size="+size); err != nil {
		t.Fatalf("mount tmpfs at %s: %v", dir, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
}
