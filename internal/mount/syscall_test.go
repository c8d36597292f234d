package mount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMountFlags checks the option translation that replaces mount(8)'s:
// generic options become flags in order, the filesystem's own go to the data
// string, and anything off the allow-list is refused rather than passed on.
func TestMountFlags(t *testing.T) {
	for _, tc := range []struct {
		fs             string
		opts           []string
		flags, cleared uintptr
		data           string
		refused        bool
	}{
		{fs: "xfs", opts: []string{"nouuid"}, data: "nouuid"},
		{fs: "ext4", opts: []string{"ro", "noatime", "data=ordered", "nodev"},
			flags: unix.MS_RDONLY | unix.MS_NOATIME | unix.MS_NODEV, data: "data=ordered"},
		{fs: "ext4", opts: []string{"ro", "rw"}, cleared: unix.MS_RDONLY},
		{fs: "btrfs", opts: []string{"noexec", "exec", "compress=zstd:3"}, cleared: unix.MS_NOEXEC, data: "compress=zstd:3"},
		{fs: "", opts: []string{"nosuid", "defaults"}, flags: unix.MS_NOSUID},
		{fs: "", opts: []string{"discard"}, refused: true},
		{fs: "ext4", opts: []string{"loop"}, refused: true},
		{fs: "btrfs", opts: []string{"subvol=x"}, refused: true},
	} {
		flags, cleared, data, err := mountFlags(tc.fs, tc.opts)
		if tc.refused {
			if !errors.Is(err, ErrOptionRefused) {
				t.Errorf("mountFlags(%q, %q) = %v, want ErrOptionRefused", tc.fs, tc.opts, err)
			}
			continue
		}
		if err != nil || flags != tc.flags || cleared != tc.cleared || data != tc.data {
			t.Errorf("mountFlags(%q, %q) = %#x, %#x, %q, %v; want %#x, %#x, %q", tc.fs, tc.opts, flags, cleared, data, err, tc.flags, tc.cleared, tc.data)
		}
	}
}

// TestMountOptionsReachKernel mounts through mount(2) with a filesystem option
// and generic options, and binds with ro and noexec: what mountinfo then shows
// is what mount(8) would have made.
func TestMountOptionsReachKernel(t *testing.T) {
	requireLoops(t, "mkfs.ext4")
	ctx := context.Background()
	l, m := newLoops(t), NewMounter()
	file := newImage(t, 64<<20)
	if err := Format(ctx, file, "ext4"); err != nil {
		t.Fatal(err)
	}
	dev := attach(t, l, file)
	staging := filepath.Join(t.TempDir(), "staging")
	mountT(t, m, dev, staging, "ext4", []string{"nosuid", "noatime", "data=journal"})
	info, ok, err := m.Info(staging)
	if err != nil || !ok {
		t.Fatalf("Info = %+v, %t, %v", info, ok, err)
	}
	for _, o := range []string{"nosuid", "noatime", "data=journal", "rw"} {
		if !slices.Contains(info.Options, o) {
			t.Errorf("staging mount options %q lack %q", info.Options, o)
		}
	}
	target := filepath.Join(t.TempDir(), "pod")
	t.Cleanup(func() {
		if err := m.Unmount(context.Background(), target); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := m.Bind(ctx, staging, target, true, []string{"noexec"}); err != nil {
		t.Fatal(err)
	}
	info, ok, err = m.Info(target)
	if err != nil || !ok {
		t.Fatalf("Info = %+v, %t, %v", info, ok, err)
	}
	// nosuid is carried over from the staging mount by the bind remount.
	for _, o := range []string{"ro", "noexec", "nosuid", "noatime"} {
		if !slices.Contains(info.Options, o) {
			t.Errorf("bind mount options %q lack %q", info.Options, o)
		}
	}
	if err := os.WriteFile(filepath.Join(target, "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write through the ro bind: %v, want EROFS", err)
	}
	if err := os.WriteFile(filepath.Join(staging, "x"), nil, 0o644); err != nil {
		t.Errorf("write to the staging mount: %v", err)
	}
}
