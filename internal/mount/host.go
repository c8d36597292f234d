package mount

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// This file holds the questions the driver asks of the node's mount table and
// devices beyond mounting itself, as methods, so the driver reaches the kernel
// only through values it is given (internal/mount/fake stands in for them in
// tests without root).

// MountPoints lists every mount of the block device dev (see MountPoints).
func (m *Mounter) MountPoints(dev string) ([]string, error) { return MountPoints(dev) }

// MountsBelow lists the mount points at or under dir. Deleting a directory
// through a mount would delete another filesystem's data (or, through a bind,
// the volume's own data seen elsewhere).
func (m *Mounter) MountsBelow(dir string) ([]string, error) {
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	out := make([]string, 0, len(infos))
	for _, i := range infos {
		out = append(out, i.Mountpoint)
	}
	return out, nil
}

// MountedElsewhere returns a mount point, other than those in except, that
// shows the directory data ("" if none). Only mounts of data's own filesystem
// (same device numbers in mountinfo) are stat'ed, so a hung mount of some other
// filesystem cannot hang the call.
func (m *Mounter) MountedElsewhere(data string, except ...string) (string, error) {
	home, err := mountinfo.GetMounts(mountinfo.ParentsFilter(data))
	if err != nil || len(home) == 0 {
		return "", fmt.Errorf("find the mount holding %s: %w", data, err)
	}
	// The deepest parent mount is the one data lives on.
	fs := home[0]
	for _, h := range home[1:] {
		if len(h.Mountpoint) > len(fs.Mountpoint) {
			fs = h
		}
	}
	skip := map[string]bool{}
	for _, e := range except {
		skip[e] = true
	}
	infos, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) {
		return i.Major != fs.Major || i.Minor != fs.Minor || skip[i.Mountpoint], false
	})
	if err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	for _, i := range infos {
		if sameFile(i.Mountpoint, data) {
			return i.Mountpoint, nil
		}
	}
	return "", nil
}

// MountEntry is one line of the node's mount table, as the node-side health
// checks read it.
type MountEntry struct {
	Mountpoint, Source string
	// Major and Minor are the filesystem's device numbers: every mount of one
	// filesystem (its binds included) shows the same.
	Major, Minor int
	// Root is the directory of the filesystem this mount shows ("/" for a
	// whole filesystem, the source directory's path in it for a bind).
	Root string
	// Options are this mount's own options ("rw" or "ro" among them);
	// VFSOptions the filesystem's, which say "ro" once the kernel made the
	// filesystem itself read-only (after an error with errors=remount-ro).
	Options, VFSOptions string
}

// Table lists every mount of the node, in mount order (a path shows the last
// mount on it).
func (m *Mounter) Table() ([]MountEntry, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	out := make([]MountEntry, 0, len(infos))
	for _, i := range infos {
		out = append(out, MountEntry{Mountpoint: i.Mountpoint, Source: i.Source, Root: i.Root, Major: i.Major, Minor: i.Minor, Options: i.Options, VFSOptions: i.VFSOptions})
	}
	return out, nil
}

// SameDir tells whether two paths are the same directory inode: a bind mount's
// target shows its source's inode.
func (m *Mounter) SameDir(a, b string) bool { return sameFile(a, b) }

// OnDevice tells whether path is inside the filesystem on block device dev,
// from st_dev alone: ext4 and xfs report the device they sit on, so one stat
// answers what reading all of /proc/self/mountinfo would. btrfs reports an
// anonymous device, and block publishes are device nodes: both answer false.
func (m *Mounter) OnDevice(path, dev string) bool {
	var p, d unix.Stat_t
	if unix.Stat(path, &p) != nil || unix.Stat(dev, &d) != nil {
		return false
	}
	return d.Mode&unix.S_IFMT == unix.S_IFBLK && d.Rdev != 0 && p.Dev == d.Rdev
}

// IsDevice tells whether path is a device node of the same device as dev (a
// published block volume, or the device itself).
func (m *Mounter) IsDevice(path, dev string) bool {
	var p, d unix.Stat_t
	if unix.Stat(path, &p) != nil || unix.Stat(dev, &d) != nil {
		return false
	}
	return d.Rdev != 0 && p.Rdev == d.Rdev
}

// Devices formats, sizes and grows block devices and image files.
type Devices struct{ m *Mounter }

// NewDevices uses m for the resize tools' mount checks.
func NewDevices(m *Mounter) Devices { return Devices{m: m} }

func (Devices) Format(ctx context.Context, target, fsType string) error {
	return Format(ctx, target, fsType)
}
func (Devices) DiskFormat(ctx context.Context, target string) (string, error) {
	return DiskFormat(ctx, target)
}
func (Devices) FilesystemSize(device string) (string, int64, error) { return FilesystemSize(device) }
func (Devices) Size(device string) (int64, error)                   { return DeviceSize(device) }
func (Devices) ReadOnly(device string) (bool, error)                { return DeviceReadOnly(device) }
func (Devices) SetReadOnly(device string, readOnly bool) error      { return SetReadOnly(device, readOnly) }
func (d Devices) NeedResize(ctx context.Context, device, mountPath string) (bool, error) {
	return d.m.NeedResize(ctx, device, mountPath)
}
func (d Devices) ResizeFS(ctx context.Context, device, mountPath string) error {
	return d.m.ResizeFS(ctx, device, mountPath)
}

// Filesystems answers statfs and freezes filesystems.
type Filesystems struct{}

func (Filesystems) Statfs(path string, st *unix.Statfs_t) error {
	if err := unix.Statfs(path, st); err != nil {
		return fmt.Errorf("statfs %s: %w", path, err)
	}
	return nil
}

// FreezeMount is FreezeMount: the hold's type hidden behind the interface
// the driver uses.
func (Filesystems) FreezeMount(prefix, path, dev string, bound time.Duration) (FrozenFS, error) {
	h, err := FreezeMount(prefix, path, dev, bound)
	if err != nil {
		return nil, err
	}
	return h, nil
}

// FrozenFS is a frozen filesystem's hold.
type FrozenFS interface {
	Thaw() error
	Expired() bool
}

// Allocate allocates [off, off+length) of f (fallocate mode 0) and fsyncs f,
// so the allocation survives a crash.
func (Filesystems) Allocate(f *os.File, off, length int64) error { return Allocate(f, off, length) }

// Allocate is Filesystems.Allocate.
func Allocate(f *os.File, off, length int64) error {
	if err := unix.Fallocate(int(f.Fd()), 0, off, length); err != nil {
		return fmt.Errorf("fallocate %s [%d, +%d): %w", f.Name(), off, length, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", f.Name(), err)
	}
	return nil
}
func (Filesystems) ThawMount(prefix, path, dev string) error { return ThawMount(prefix, path, dev) }

// sysFSExt4 is where ext4 publishes its per-filesystem attributes; a variable
// so a test can point it at a tree holding errors it cannot cause for real.
var sysFSExt4 = "/sys/fs/ext4"

// Ext4Errors reads the error count the ext4 filesystem on device keeps in its
// superblock until fsck clears it, and the function that hit the first error
// ("" if unknown). A device with no ext4 attributes has none to report.
func (Filesystems) Ext4Errors(device string) (count int64, firstFunc string, err error) {
	dir := filepath.Join(sysFSExt4, filepath.Base(device))
	raw, err := os.ReadFile(filepath.Join(dir, "errors_count"))
	if err != nil {
		return 0, "", fmt.Errorf("ext4 errors of %s: %w", device, err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
	if err != nil {
		return 0, "", fmt.Errorf("ext4 errors of %s: %w", device, err)
	}
	if fn, err := os.ReadFile(filepath.Join(dir, "first_error_func")); err == nil {
		firstFunc = strings.TrimSpace(string(fn))
	}
	return n, firstFunc, nil
}
