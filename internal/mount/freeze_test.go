package mount

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// loopMount is a small ext4 on a real loop device, and the device.
func loopMount(t *testing.T, dir string) (mnt, dev string) {
	t.Helper()
	testutil.RequireCommands(t, "mkfs.ext4")
	mnt = testutil.LoopFS(t, dir, "ext4", 32<<20)
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(mnt))
	if err != nil || len(infos) != 1 {
		t.Fatalf("mount of %s: %v %v", mnt, infos, err)
	}
	return mnt, infos[0].Source
}

// frozen tells whether the filesystem at mnt is frozen, and thaws it if so.
func frozen(t *testing.T, mnt string) bool {
	t.Helper()
	f, err := os.Open(mnt)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	err = unix.IoctlSetInt(int(f.Fd()), ioctlFITHAW, 0)
	if err != nil && !errors.Is(err, unix.EINVAL) {
		t.Fatalf("FITHAW %s: %v", mnt, err)
	}
	return err == nil
}

// TestFreezeMountChecksTheDescriptor: on real loop devices, FreezeMount
// freezes only the root of a mount of the device it is given, through the
// descriptor it checked: a link, a FIFO, a subdirectory, another device's
// mount or a path outside the prefix is refused with ErrNotTheMount and
// freezes nothing; the thaw armed with the freeze thaws it at the bound
// without Thaw being called.
func TestFreezeMountChecksTheDescriptor(t *testing.T) {
	testutil.RequireRoot(t)
	root := t.TempDir()
	vol := filepath.Join(root, "vol")
	other := filepath.Join(root, "other")
	for _, d := range []string{vol, other} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mnt, dev := loopMount(t, vol)
	otherMnt, otherDev := loopMount(t, other)
	if err := os.Mkdir(filepath.Join(mnt, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(root, "link")
	if err := os.Symlink(mnt, link); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(root, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ name, prefix, path, dev string }{
		{"link to the mount", root, link, dev},
		{"FIFO", root, fifo, dev},
		{"subdirectory", root, filepath.Join(mnt, "sub"), dev},
		{"another device's mount", root, otherMnt, dev},
		{"the mount, another device named", root, mnt, otherDev},
		{"outside the prefix", filepath.Join(root, "other"), mnt, dev},
		{"not clean", root, mnt + "/", dev},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, err := FreezeMount(tt.prefix, tt.path, tt.dev, time.Minute)
			if err == nil {
				_ = h.Thaw()
				t.Fatal("frozen")
			}
			if !errors.Is(err, ErrNotTheMount) {
				t.Fatalf("error %v, want ErrNotTheMount", err)
			}
			if frozen(t, mnt) || frozen(t, otherMnt) {
				t.Fatal("a filesystem was frozen")
			}
		})
	}

	t.Run("the bound thaws", func(t *testing.T) {
		h, err := FreezeMount(root, mnt, dev, 200*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Thaw()
		// A write blocks while frozen and goes through once the bound has
		// thawed it: nobody calls Thaw meanwhile.
		done := make(chan error, 1)
		go func() { done <- os.WriteFile(filepath.Join(mnt, "after"), []byte("x"), 0o644) }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(30 * time.Second):
			frozen(t, mnt)
			t.Fatal("still frozen long after the bound")
		}
		if !h.Expired() {
			t.Fatal("the bound did not thaw it")
		}
		if err := h.Thaw(); err != nil {
			t.Fatalf("Thaw after the bound: %v", err)
		}
		if frozen(t, mnt) {
			t.Fatal("frozen after Thaw")
		}
	})

	t.Run("Thaw before the bound", func(t *testing.T) {
		h, err := FreezeMount(root, mnt, dev, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Thaw(); err != nil {
			t.Fatal(err)
		}
		if h.Expired() || frozen(t, mnt) {
			t.Fatal("not thawed by Thaw")
		}
		if err := ThawMount(root, mnt, dev); err != nil {
			t.Fatalf("ThawMount of a thawed filesystem: %v", err)
		}
		if err := ThawMount(root, fifo, dev); !errors.Is(err, ErrNotTheMount) {
			t.Fatalf("ThawMount of a FIFO: %v", err)
		}
	})
}

// TestFreezeMountBtrfs: a btrfs mount root is frozen and thawed though its
// devices are anonymous ones (the mount table's differs from stat's).
func TestFreezeMountBtrfs(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.btrfs")
	root := t.TempDir()
	mnt := testutil.LoopFS(t, root, "btrfs", 256<<20)
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(mnt))
	if err != nil || len(infos) != 1 {
		t.Fatalf("mount of %s: %v %v", mnt, infos, err)
	}
	h, err := FreezeMount(root, mnt, infos[0].Source, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Thaw(); err != nil {
		t.Fatal(err)
	}
	if frozen(t, mnt) {
		t.Fatal("still frozen")
	}
}
