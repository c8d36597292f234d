package mount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	mountutils "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

// ErrMountConflict is returned when the target is already a mount point of
// something other than what was asked for; the caller must unmount first.
var ErrMountConflict = errors.New("target already mounted differently")

// maxStackedUnmounts bounds Unmount when mounts were stacked on one target
// (a retried publish on an old kernel/mounter); more means something loops.
const maxStackedUnmounts = 16

// Mounter mounts, bind-mounts and grows filesystems. It holds no state but
// its root, so one value serves all volumes.
type Mounter struct {
	// root is the only directory below which it mounts, binds, unmounts or
	// creates anything ("" for /), each path resolved once without links
	// (beneath.go).
	root string
	// left counts growths whose caller stopped waiting (its deadline) while
	// the kernel still grows: each holds the mount point open until its
	// ioctl returns. Tests wait for them before they unmount.
	left sync.WaitGroup
}

// NewMounter mounts with mount(2) and umount2(2) (syscall.go says why not
// mount(8)); a read-only bind is bind + bind remount, as mount(8) does it.
// Nothing is wrapped in a systemd-run scope: the driver runs in a container
// where systemd is not reachable, and its filesystems need no user-space
// daemon to outlive it. Every path it acts on must be below / without a
// symbolic link.
func NewMounter() *Mounter { return &Mounter{} }

// NewMounterBeneath is NewMounter acting only strictly below root (a clean
// absolute path; "" or / for anywhere).
func NewMounterBeneath(root string) *Mounter {
	if root == "/" {
		root = ""
	}
	return &Mounter{root: root}
}

// MountInfo describes one entry of /proc/self/mountinfo.
type MountInfo struct {
	Target, Source, FSType string
	Options                []string // per-mount then per-superblock options
	ReadOnly               bool
	Major, Minor           int
	Root                   string
}

// cleanPath resolves symlinks when it can, since mountinfo lists resolved
// paths; a broken (e.g. stale) mount point falls back to the cleaned path.
// missing is true when the path does not resolve at all: nothing can be
// mounted there. A stale mount fails its lstat with ESTALE or ENOTCONN, never
// ENOENT, so it is not missing.
func cleanPath(p string) (path string, missing bool, err error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", false, fmt.Errorf("resolve %s: %w", p, err)
	}
	r, err := filepath.EvalSymlinks(abs)
	if err == nil {
		return r, false, nil
	}
	return abs, errors.Is(err, fs.ErrNotExist), nil
}

// Info reports the topmost mount on target from /proc/self/mountinfo.
func (m *Mounter) Info(target string) (MountInfo, bool, error) {
	p, missing, err := cleanPath(target)
	if err != nil {
		return MountInfo{}, false, err
	}
	if missing {
		// mountinfo need not be read (publish asks about a target kubelet has
		// not created yet).
		return MountInfo{}, false, nil
	}
	if root, known := mountRoot(p); known && !root {
		// Nor for a path the kernel says is no mount's root: a staging or target
		// directory before its mount, and after each unmount.
		return MountInfo{}, false, nil
	}
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p))
	if err != nil {
		return MountInfo{}, false, fmt.Errorf("read mountinfo: %w", err)
	}
	if len(infos) == 0 {
		return MountInfo{}, false, nil
	}
	// Entries are in mount order, so the last one is what the path shows.
	return toMountInfo(infos[len(infos)-1]), true, nil
}

// mountRoot asks the kernel whether path is the root of a mount (statx's
// STATX_ATTR_MOUNT_ROOT, Linux 5.8): the answer mountinfo would give about
// whether anything is mounted there, without the kernel printing, and the
// driver parsing, every mount of the node (hundreds on a busy one). known is
// false when the kernel cannot say (an older kernel; a stale mount, whose statx
// fails), and then mountinfo decides.
func mountRoot(path string) (root, known bool) {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx); err != nil {
		return false, false
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, false
	}
	return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, true
}

func toMountInfo(i *mountinfo.Info) MountInfo {
	opts := splitOpts(i.Options)
	for _, o := range splitOpts(i.VFSOptions) {
		if !slices.Contains(opts, o) {
			opts = append(opts, o)
		}
	}
	return MountInfo{
		Target:   i.Mountpoint,
		Source:   i.Source,
		FSType:   i.FSType,
		Options:  opts,
		ReadOnly: slices.Contains(opts, "ro"),
		Major:    i.Major,
		Minor:    i.Minor,
		Root:     i.Root,
	}
}

func splitOpts(s string) []string {
	if s == "" {
		return nil
	}
	var out []string
	start := 0
	for i := 0; i <= len(s); i++ {
		if i == len(s) || s[i] == ',' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return out
}

// mountedAt returns a mount point of the block device dev, "" if none.
func mountedAt(dev string) (string, error) {
	points, err := MountPoints(dev)
	if err != nil || len(points) == 0 {
		return "", err
	}
	return points[0], nil
}

// MountPoints lists every mount of the block device dev: filesystem mounts of it
// and bind mounts of its device node (a published block volume, whose mountinfo
// shows devtmpfs with the node's name as root). The device number catches
// ext4/xfs; btrfs reports an anonymous device number, so the source path is
// compared too.
func MountPoints(dev string) ([]string, error) {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, nil
		}
		return nil, &os.PathError{Op: "stat", Path: dev, Err: err}
	}
	resolved, _, err := cleanPath(dev)
	if err != nil {
		return nil, err
	}
	major, minor := int(unix.Major(st.Rdev)), int(unix.Minor(st.Rdev))
	nodeRoot := "/" + filepath.Base(resolved)
	infos, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) {
		match := (i.Major == major && i.Minor == minor) || i.Source == dev || i.Source == resolved ||
			(i.FSType == "devtmpfs" && i.Root == nodeRoot)
		return !match, false
	})
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	out := make([]string, 0, len(infos))
	for _, i := range infos {
		out = append(out, i.Mountpoint)
	}
	return out, nil
}

// sameDevice reports whether info is a mount of the block device source.
func sameDevice(info MountInfo, source string) bool {
	var st unix.Stat_t
	if err := unix.Stat(source, &st); err != nil {
		return false
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK &&
		info.Major == int(unix.Major(st.Rdev)) && info.Minor == int(unix.Minor(st.Rdev)) {
		return true
	}
	r, _, err := cleanPath(source)
	return err == nil && (info.Source == source || info.Source == r)
}

// sameFile reports whether two paths are the same inode (a bind mount's
// target shows the source's root inode).
func sameFile(a, b string) bool {
	var sa, sb unix.Stat_t
	if unix.Stat(a, &sa) != nil || unix.Stat(b, &sb) != nil {
		return false
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// Mount mounts source (a device) on target, creating the target directory.
// Mounting the same source again is a no-op, so retried stage calls succeed.
func (m *Mounter) Mount(ctx context.Context, source, target, fsType string, options []string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	readOnly := slices.Contains(options, "ro")
	if done, err := m.alreadyMounted(target, readOnly, func(i MountInfo) bool { return sameDevice(i, source) }); done || err != nil {
		return err
	}
	h, err := m.hold(target, makeDir)
	if err != nil {
		return fmt.Errorf("mount: target: %w", err)
	}
	defer h.Close()
	// mount(2) cannot be interrupted halfway, so the context is only checked
	// before starting; abandoning a running mount would leave it behind.
	if err := sysMount(source, h.selfPath(), fsType, options); err != nil {
		return fmt.Errorf("mount %s on %s: %w", source, target, err)
	}
	klog.FromContext(ctx).V(2).Info("Mounted", "source", source, "target", target, "fsType", fsType, "options", options)
	return nil
}

// alreadyMounted checks target: (true, nil) when it is already the wanted
// mount, (false, nil) when not mounted, an error when mounted differently.
func (m *Mounter) alreadyMounted(target string, readOnly bool, same func(MountInfo) bool) (bool, error) {
	info, ok, err := m.Info(target)
	if err != nil || !ok {
		return false, err
	}
	if !same(info) {
		return false, fmt.Errorf("%s has %s mounted: %w", target, info.Source, ErrMountConflict)
	}
	if info.ReadOnly != readOnly {
		return false, fmt.Errorf("%s is mounted with read-only=%t, want %t: %w", target, info.ReadOnly, readOnly, ErrMountConflict)
	}
	return true, nil
}

// Bind bind-mounts directory source on target (created if missing).
func (m *Mounter) Bind(ctx context.Context, source, target string, readOnly bool, options []string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if done, err := m.alreadyMounted(target, readOnly, func(MountInfo) bool { return sameFile(source, target) }); done || err != nil {
		return err
	}
	return m.bind(source, target, makeDir, readOnly, options)
}

// bind binds source on target, both resolved once below the root (a source
// that is a device or a handle the driver holds is taken as it is).
func (m *Mounter) bind(source, target string, make makeKind, readOnly bool, options []string) error {
	src := source
	if m.underRoot(source) {
		hs, err := m.hold(source, makeNothing)
		if err != nil {
			return fmt.Errorf("bind: source: %w", err)
		}
		defer hs.Close()
		if hs.self == nil {
			return fmt.Errorf("bind %s: %w", source, os.ErrNotExist)
		}
		src = hs.selfPath()
	}
	h, err := m.hold(target, make)
	if err != nil {
		return fmt.Errorf("bind: target: %w", err)
	}
	defer h.Close()
	// After the bind, the entry in the held parent is the mount point, which
	// nothing can rename or replace while mounted: it names the new mount.
	if err := sysBind(src, h.selfPath(), h.atPath(), readOnly, options); err != nil {
		return fmt.Errorf("bind %s on %s: %w", source, h.self.Name(), err)
	}
	if readOnly {
		// The ro remount is a second step that can fail on its own; a
		// writable mount where read-only was asked for must not survive.
		// statfs reports the flag of the mount just made: the kernel's
		// answer, without reading the whole mount table.
		ro, err := readOnlyMount(h.atPath())
		if err != nil {
			_ = sysUnmount(h.atPath())
			return fmt.Errorf("bind %s on %s: verify read-only: %w", source, h.self.Name(), err)
		}
		if !ro {
			_ = sysUnmount(h.atPath())
			return fmt.Errorf("bind %s on %s: mount is not read-only", source, h.self.Name())
		}
	}
	klog.V(2).InfoS("Bind-mounted", "source", source, "target", h.self.Name(), "readOnly", readOnly)
	return nil
}

// BindBlock publishes a block device: target becomes an empty file with the
// device node bind-mounted on it. readOnly makes the mount read-only, but a
// read-only mount does not stop writes through a device node: use
// SetReadOnly on the device for that.
func (m *Mounter) BindBlock(ctx context.Context, device, target string, readOnly bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	same := func(MountInfo) bool {
		var sd, st unix.Stat_t
		return unix.Stat(device, &sd) == nil && unix.Stat(target, &st) == nil &&
			st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == sd.Rdev
	}
	if done, err := m.alreadyMounted(target, readOnly, same); done || err != nil {
		return err
	}
	return m.bind(device, target, makeFile, readOnly, nil)
}

// Unmount unmounts target (every stacked mount on it) and removes it if it
// is an empty directory or an empty file. Missing or unmounted is success;
// a directory or file with content is never removed and yields an error.
func (m *Mounter) Unmount(ctx context.Context, target string) error {
	return m.UnmountChecked(ctx, target, nil)
}

// UnmountChecked is Unmount that first asks check about each mount it finds
// on target (when check is not nil) and stops with check's error, as check
// returned it, at the first mount check refuses: a caller that must only take
// down its own mount says so there, and the mount table is read once for the
// check and the unmount.
func (m *Mounter) UnmountChecked(ctx context.Context, target string, check func(MountInfo) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	h, err := m.hold(target, parentOnly)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // a directory on the way is gone: nothing is there
	}
	if err != nil && !mountutils.IsCorruptedMnt(err) {
		return fmt.Errorf("unmount %s: %w", target, err)
	}
	if h == nil {
		// A stale mount (its server gone) fails the resolution of the
		// path itself: unmounted by name, as before; a link cannot be
		// swapped into a stale mount point's place.
		h = &held{base: filepath.Base(target)}
	}
	defer func() {
		if h.parent != nil {
			h.Close()
		}
	}()
	at := target
	if h.parent != nil {
		at = h.atPath()
	}
	for i := 0; ; i++ {
		fi, err := os.Lstat(at)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil && !mountutils.IsCorruptedMnt(err) {
			return fmt.Errorf("unmount %s: %w", target, err)
		}
		if err == nil && fi.Mode()&os.ModeSymlink != 0 {
			return fmt.Errorf("unmount %s: %w", target, ErrLinkInPath)
		}
		info, ok, err := m.Info(target)
		if err != nil {
			return fmt.Errorf("unmount %s: %w", target, err)
		}
		if !ok {
			break
		}
		if i >= maxStackedUnmounts {
			return fmt.Errorf("unmount %s: still mounted after %d unmounts", target, i)
		}
		if check != nil {
			if err := check(info); err != nil {
				return err
			}
		}
		if err := sysUnmountNoFollow(at); err != nil {
			return fmt.Errorf("unmount %s: %w", target, err)
		}
		klog.FromContext(ctx).V(2).Info("Unmounted", "target", target, "source", info.Source)
	}
	return removeEmpty(at)
}

// removeEmpty removes an empty directory or empty regular file. Unlike
// os.RemoveAll it can never delete data that was written below a mount point
// after the mount vanished.
func removeEmpty(target string) error {
	fi, err := os.Lstat(target)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove %s: %w", target, err)
	}
	if fi.Mode().IsRegular() && fi.Size() > 0 {
		return fmt.Errorf("remove %s: regular file with %d bytes of data, leaving it: %w", target, fi.Size(), unix.ENOTEMPTY)
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", target, err)
	}
	return nil
}

// ResizeFS grows the filesystem on device to the device's size. ext4 can be
// grown unmounted (mountPath "" or not a mount point): e2fsck -f runs first
// because resize2fs insists on it. xfs and btrfs only grow mounted; xfs
// through its ioctl (xfsgrow.go says why not xfs_growfs). A growth that finds
// another one of the same filesystem under way waits for it a bounded time,
// then answers ErrGrowUnderWay.
func (m *Mounter) ResizeFS(ctx context.Context, device, mountPath string) error {
	fsType, err := DiskFormat(ctx, device)
	if err != nil {
		return fmt.Errorf("resize %s: %w", device, err)
	}
	mounted := false
	if mountPath != "" {
		info, ok, err := m.Info(mountPath)
		if err != nil {
			return fmt.Errorf("resize %s: %w", device, err)
		}
		if ok && !sameDevice(info, device) {
			// Growing whatever happens to be mounted there would be wrong.
			return fmt.Errorf("resize %s: %s has %s mounted: %w", device, mountPath, info.Source, ErrMountConflict)
		}
		mounted = ok
	}
	if !mounted {
		if fsType != "ext4" && fsType != "ext3" {
			return fmt.Errorf("resize %s: %s can only be grown while mounted", device, fsType)
		}
		if where, err := mountedAt(device); err != nil {
			return fmt.Errorf("resize %s: %w", device, err)
		} else if where != "" {
			return fmt.Errorf("resize %s: mounted at %s, not at %q: %w", device, where, mountPath, ErrDeviceBusy)
		}
		// -p repairs only what is safe without a human; exit 1 means it did.
		out, err := exec.CommandContext(ctx, "e2fsck", "-f", "-p", device).CombinedOutput()
		var ee *exec.ExitError
		if err != nil && (!errors.As(err, &ee) || ee.ExitCode() != 1) {
			return fmt.Errorf("resize %s: e2fsck: %w: %s", device, err, out)
		}
	}
	err = waitForGrowth(ctx, device, func() error {
		if fsType == "xfs" {
			return m.growXFS(ctx, device, mountPath)
		}
		r := mountutils.NewResizeFs(ctxExec{ctx: ctx, Interface: utilexec.New()})
		if _, err := r.Resize(device, mountPath); err != nil {
			if growUnderWayOutput(err) {
				return fmt.Errorf("%w: %w", ErrGrowUnderWay, err)
			}
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("resize %s: %w", device, err)
	}
	klog.FromContext(ctx).V(2).Info("Resized filesystem", "device", device, "mountPath", mountPath, "fsType", fsType, "online", mounted)
	return nil
}

// NeedResize follows mount-utils: false on a read-only or blank device, a
// size comparison for btrfs, and always true for ext4/xfs (their growth is a
// cheap no-op when there is nothing to do). Its tools (blockdev, blkid) read
// the device, which waits as long as the pool under it does: ctx ends them.
func (m *Mounter) NeedResize(ctx context.Context, device, mountPath string) (bool, error) {
	need, err := mountutils.NewResizeFs(ctxExec{ctx: ctx, Interface: utilexec.New()}).NeedResize(device, mountPath)
	if err != nil {
		return false, fmt.Errorf("need resize %s: %w", device, err)
	}
	return need, nil
}
