// Package mount holds the node-side storage plumbing: loop devices, mkfs,
// mounts and bind mounts, filesystem growth and raw block publishing.
package mount

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/poolcsi/poolcsi/internal/fsx"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

const (
	loopControl = "/dev/loop-control"
	sysBlock    = "/sys/block"
	// loopMajor is fixed by the kernel (Documentation/admin-guide/devices.txt).
	loopMajor = 7
	// attachRetries bounds the EBUSY loop: each retry means another process won
	// the race for the device LOOP_CTL_GET_FREE handed us, which is rare.
	attachRetries = 32
	deletedSuffix = " (deleted)"
)

// ErrDeviceBusy is returned by Detach when the loop device still has a
// filesystem mounted from it: LOOP_CLR_FD would otherwise turn into a silent
// deferred detach (autoclear) and the device would outlive the call.
var ErrDeviceBusy = errors.New("device busy")

// ErrDetachPending is returned by Attach when the file is still attached to a
// device that is scheduled to detach itself (autoclear) once its last user
// closes it; attaching a second device would attach the file twice.
var ErrDetachPending = errors.New("loop device detach pending")

// fileID identifies a backing file the way the kernel reports it in
// LOOP_GET_STATUS64, so a file reached through another path (bind mount,
// symlink, renamed parent) is still recognised.
type fileID struct{ dev, ino uint64 }

// Loops attaches image files to loop devices and remembers which file sits on
// which device. The map is only a cache: every answer is checked against the
// kernel before it is returned.
type Loops struct {
	// mu serialises map updates and, more importantly, the check-then-attach
	// step inside this process; other processes are kept out by flock.
	mu    sync.Mutex
	byID  map[fileID]string
	paths map[string]string // device -> backing path as given, for deleted files
	// fenced are the devices Fence emptied, by backing file: no attachment
	// of the file any more (a new one may be made beside them), detached
	// with the file's next Detach once nothing mounts them.
	fenced map[fileID][]string
}

// LoopStatus is what sysfs says about one loop device.
type LoopStatus struct {
	Device         string
	BackingFile    string
	BackingDeleted bool
	DirectIO       bool
	SizeBytes      int64
}

// NewLoops scans sysfs once so that devices attached before a restart are
// found without a scan per lookup.
func NewLoops() (*Loops, error) {
	l := &Loops{}
	if err := l.rescan(); err != nil {
		return nil, err
	}
	return l, nil
}

// rescanWait bounds how long a rescan waits for the kernel to identify the
// devices' backing files: a device whose filesystem hangs is left out rather
// than hanging the rescan (and with it a node plugin's start).
const rescanWait = 2 * time.Second

// rescan rebuilds the map from the kernel. Caller holds l.mu (or owns l).
func (l *Loops) rescan() error {
	devs, err := l.List(rescanWait)
	if err != nil {
		return err
	}
	byID := make(map[fileID]string, len(devs))
	paths := make(map[string]string, len(devs))
	fenced := map[fileID][]string{}
	for _, d := range devs {
		if d.Err != nil {
			// Its backing file's filesystem does not answer, or the node is
			// missing (no udev).
			klog.V(4).InfoS("Skipping loop device during scan", "device", d.Device, "err", d.Err)
			continue
		}
		id := fileID{d.Dev, d.Ino}
		if d.Fenced {
			fenced[id] = append(fenced[id], d.Device)
			continue
		}
		byID[id] = d.Device
		paths[d.Device] = d.Backing
	}
	l.byID, l.paths, l.fenced = byID, paths, fenced
	return nil
}

// loopStatus returns LOOP_GET_STATUS64 for dev; ENXIO means "not bound".
func loopStatus(dev string) (*unix.LoopInfo64, error) {
	// O_RDONLY: a close after O_RDWR makes udev fire a change event and probe.
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dev, Err: err}
	}
	defer unix.Close(fd)
	info, err := unix.IoctlLoopGetStatus64(fd)
	if err != nil {
		return nil, &os.PathError{Op: "LOOP_GET_STATUS64", Path: dev, Err: err}
	}
	return info, nil
}

func statID(path string) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fileID{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return fileID{st.Dev, st.Ino}, nil
}

// lookup finds the device for id: map first (verified), then a full rescan.
// Caller holds l.mu. The LoopInfo64 is returned so callers can see flags.
func (l *Loops) lookup(id fileID) (string, *unix.LoopInfo64, error) {
	if dev, ok := l.byID[id]; ok {
		if info, err := loopStatus(dev); err == nil && info.Device == id.dev && info.Inode == id.ino && info.Sizelimit != fenceSizeLimit {
			return dev, info, nil
		}
	}
	if err := l.rescan(); err != nil {
		return "", nil, err
	}
	if dev, ok := l.byID[id]; ok {
		info, err := loopStatus(dev)
		if err == nil && info.Device == id.dev && info.Inode == id.ino && info.Sizelimit != fenceSizeLimit {
			return dev, info, nil
		}
	}
	return "", nil, nil
}

// lookupPath handles a backing file that no longer exists: the kernel still
// holds it, and sysfs shows its old path with " (deleted)".
func (l *Loops) lookupPath(path string) (string, error) {
	if err := l.rescan(); err != nil {
		return "", err
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("resolve %s: %w", path, err)
	}
	for dev, p := range l.paths {
		if p == abs || p == path {
			return dev, nil
		}
	}
	return "", nil
}

// Find returns the loop device the backing file is attached to.
func (l *Loops) Find(backingFile string) (string, bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	dev, err := l.find(backingFile)
	return dev, dev != "", err
}

func (l *Loops) find(backingFile string) (string, error) {
	id, err := statID(backingFile)
	if errors.Is(err, os.ErrNotExist) {
		return l.lookupPath(backingFile)
	}
	if err != nil {
		// The file's filesystem does not answer (a share whose client was
		// evicted): the kernel still names the file by its path, and that
		// is all that can be known of it.
		return l.lookupPath(backingFile)
	}
	dev, _, err := l.lookup(id)
	return dev, err
}

// Attach attaches backingFile to a free loop device with direct I/O, or
// returns the device it is already attached to.
func (l *Loops) Attach(ctx context.Context, backingFile string) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()

	// A separate descriptor carries the lock: the kernel keeps the attach
	// descriptor's open file alive for the device's lifetime, so a lock taken
	// on that one would never be released.
	lockFD, err := unix.Open(backingFile, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("open backing file: %w", &os.PathError{Op: "open", Path: backingFile, Err: err})
	}
	defer unix.Close(lockFD)
	if err := fsx.Flock(ctx, lockFD); errors.Is(err, unix.ENOLCK) || errors.Is(err, unix.EOPNOTSUPP) {
		// NFS mounted with nolock: the in-process mutex still protects us.
		klog.FromContext(ctx).Info("Backing file cannot be locked; relying on in-process locking", "file", backingFile, "err", err)
	} else if err != nil {
		return "", fmt.Errorf("lock backing file %s: %w", backingFile, err)
	}

	var st unix.Stat_t
	if err := unix.Fstat(lockFD, &st); err != nil {
		return "", fmt.Errorf("stat backing file %s: %w", backingFile, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return "", fmt.Errorf("backing file %s is not a regular file", backingFile)
	}
	id := fileID{st.Dev, st.Ino}
	dev, info, err := l.lookup(id)
	if err != nil {
		return "", err
	}
	if dev != "" {
		if info.Flags&unix.LO_FLAGS_AUTOCLEAR != 0 {
			return "", fmt.Errorf("%s on %s: %w", backingFile, dev, ErrDetachPending)
		}
		return dev, nil
	}

	fd, err := unix.Open(backingFile, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("open backing file: %w", &os.PathError{Op: "open", Path: backingFile, Err: err})
	}
	defer unix.Close(fd)

	// A /proc/<pid>/fd/<n> path (the pool opens images without following
	// links and hands over that path) is recorded as the file's own name.
	name := backingFile
	if strings.HasPrefix(backingFile, "/proc/") {
		if r, err := os.Readlink(backingFile); err == nil {
			name = r
		}
	}
	blockSize := backingBlockSize(st.Dev)
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return "", fmt.Errorf("attach %s: %w", backingFile, err)
		}
		dev, err = attachFree(fd, name, blockSize)
		if err == nil {
			break
		}
		if errors.Is(err, unix.EBUSY) && attempt < attachRetries {
			klog.FromContext(ctx).V(4).Info("Loop device taken by another process, retrying", "file", backingFile, "attempt", attempt)
			continue
		}
		return "", fmt.Errorf("attach %s: %w", backingFile, err)
	}
	l.byID[id] = dev
	l.paths[dev] = name
	if dio, err := readSysBool(dev, "loop/dio"); err == nil && !dio {
		klog.FromContext(ctx).Info("Loop device runs without direct I/O", "device", dev, "file", backingFile)
	}
	klog.FromContext(ctx).V(2).Info("Attached loop device", "device", dev, "file", backingFile, "blockSize", blockSize)
	return dev, nil
}

// attachFree binds fd to a free loop device and returns its path.
func attachFree(fd int, backingFile string, blockSize uint32) (string, error) {
	ctl, err := unix.Open(loopControl, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", &os.PathError{Op: "open", Path: loopControl, Err: err}
	}
	n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
	unix.Close(ctl)
	if err != nil {
		return "", fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
	}
	dev := "/dev/loop" + strconv.Itoa(n)
	lfd, err := openLoopNode(dev, n)
	if err != nil {
		return "", err
	}
	defer unix.Close(lfd)

	cfg := unix.LoopConfig{Fd: uint32(fd), Size: blockSize}
	cfg.Info.Flags = unix.LO_FLAGS_DIRECT_IO
	copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], backingFile)
	err = unix.IoctlLoopConfigure(lfd, &cfg)
	if errors.Is(err, unix.EINVAL) {
		// Newer kernels refuse direct I/O outright when the backing file
		// cannot do O_DIRECT at this block size (tmpfs, some FUSE/NFS setups);
		// buffered is slower but correct.
		klog.InfoS("Direct I/O refused for loop device, falling back to buffered I/O", "device", dev, "file", backingFile, "blockSize", blockSize)
		cfg.Info.Flags &^= unix.LO_FLAGS_DIRECT_IO
		err = unix.IoctlLoopConfigure(lfd, &cfg)
	}
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) {
		// Kernels before 5.8 have no LOOP_CONFIGURE and answer EINVAL/ENOTTY.
		return dev, attachLegacy(lfd, fd, dev, backingFile, blockSize)
	}
	if err != nil {
		return "", &os.PathError{Op: "LOOP_CONFIGURE", Path: dev, Err: err}
	}
	clearReadOnly(lfd, dev)
	return dev, nil
}

// clearReadOnly drops a BLKROSET flag left by a previous user of the device:
// it survives LOOP_CLR_FD and would make a fresh attach read-only.
func clearReadOnly(lfd int, dev string) {
	if err := unix.IoctlSetPointerInt(lfd, unix.BLKROSET, 0); err != nil {
		klog.InfoS("Cannot clear read-only flag of loop device", "device", dev, "err", err)
	}
}

// attachLegacy is the pre-5.8 sequence. It is not atomic: a failure after
// LOOP_SET_FD must undo it, or the device leaks.
func attachLegacy(lfd, fd int, dev, backingFile string, blockSize uint32) error {
	if err := unix.IoctlSetInt(lfd, unix.LOOP_SET_FD, fd); err != nil {
		return &os.PathError{Op: "LOOP_SET_FD", Path: dev, Err: err}
	}
	var info unix.LoopInfo64
	copy(info.File_name[:len(info.File_name)-1], backingFile)
	if err := unix.IoctlLoopSetStatus64(lfd, &info); err != nil {
		_ = unix.IoctlSetInt(lfd, unix.LOOP_CLR_FD, 0)
		return &os.PathError{Op: "LOOP_SET_STATUS64", Path: dev, Err: err}
	}
	if blockSize != 512 {
		if err := unix.IoctlSetInt(lfd, unix.LOOP_SET_BLOCK_SIZE, int(blockSize)); err != nil {
			klog.InfoS("Cannot set loop block size", "device", dev, "blockSize", blockSize, "err", err)
		}
	}
	if err := unix.IoctlSetInt(lfd, unix.LOOP_SET_DIRECT_IO, 1); err != nil {
		klog.InfoS("Direct I/O refused for loop device, using buffered I/O", "device", dev, "file", backingFile, "err", err)
	}
	clearReadOnly(lfd, dev)
	return nil
}

// openLoopNode opens /dev/loopN, creating the node when /dev is not managed
// by devtmpfs/udev (some containers), since LOOP_CTL_GET_FREE may have just
// created the device.
func openLoopNode(dev string, n int) (int, error) {
	lfd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		if mkErr := unix.Mknod(dev, unix.S_IFBLK|0o660, int(unix.Mkdev(loopMajor, uint32(n)))); mkErr != nil && !errors.Is(mkErr, unix.EEXIST) {
			return -1, &os.PathError{Op: "mknod", Path: dev, Err: mkErr}
		}
		lfd, err = unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: dev, Err: err}
	}
	return lfd, nil
}

// backingBlockSize picks the loop logical block size. Direct I/O needs it to
// be at least the backing disk's logical block size; larger than needed would
// make images formatted with 512-byte sectors (xfs) unmountable, so use the
// disk's own value, or 512 when it cannot be known (tmpfs, NFS, btrfs).
func backingBlockSize(stDev uint64) uint32 {
	p := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(stDev), unix.Minor(stDev))
	for _, q := range []string{"queue/logical_block_size", "../queue/logical_block_size"} {
		b, err := readSys(filepath.Join(p, q))
		if err != nil {
			continue
		}
		if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && v >= 512 && v <= 4096 && v&(v-1) == 0 {
			return uint32(v)
		}
	}
	return 512
}

// Detach detaches the device backing backingFile. Not attached is success.
func (l *Loops) Detach(ctx context.Context, backingFile string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	dev, backing, pending, err := l.detach(backingFile)
	if err != nil || !pending {
		return err
	}
	// Waited for outside the lock: Find (NodeGetVolumeStats) must not stall.
	waitDetached(ctx, dev, backing)
	return nil
}

func (l *Loops) detach(backingFile string) (dev, backing string, pending bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.detachFenced(backingFile)
	dev, err = l.find(backingFile)
	if err != nil {
		return "", "", false, fmt.Errorf("detach %s: %w", backingFile, err)
	}
	if dev == "" {
		return "", "", false, nil
	}
	raw, _ := readSys(filepath.Join(sysBlock, filepath.Base(dev), "loop", "backing_file"))
	pending, err = l.detachDevice(dev)
	return dev, string(raw), pending, err
}

// detachFenced detaches the fenced devices of backingFile that nothing mounts
// any more. Caller holds l.mu.
func (l *Loops) detachFenced(backingFile string) {
	var devs []string
	if id, err := statID(backingFile); err == nil {
		if len(l.fenced[id]) == 0 {
			if err := l.rescan(); err != nil {
				return
			}
		}
		devs = l.fenced[id]
	} else {
		devs = fencedByPath(backingFile) // its filesystem does not answer
	}
	for _, dev := range devs {
		if _, err := l.detachDevice(dev); err != nil {
			klog.V(2).InfoS("Fenced loop device not detached yet", "device", dev, "err", err)
		}
	}
}

// DetachFenced detaches device if sysfs shows it fenced and nothing mounts
// it; ErrDeviceBusy if something does. Not fenced, or not attached, is left
// alone. It needs nothing of the backing file: the filesystem of a fenced
// device's file may be gone for good (a FUSE daemon killed, an evicted
// client), where the file can be found neither by path nor by identity.
func (l *Loops) DetachFenced(device string) error {
	if !strings.HasPrefix(filepath.Base(device), "loop") || !sysFenced(device) {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	_, err := l.detachDevice(device)
	return err
}

// Backs tells whether device is a loop device (fenced or not) whose backing
// file is backingFile, by the kernel's own record of the file; by the path the
// kernel shows for it when the file's filesystem does not answer.
func (l *Loops) Backs(device, backingFile string) bool {
	if !strings.HasPrefix(filepath.Base(device), "loop") {
		return false
	}
	id, err := statID(backingFile)
	if err != nil {
		return backingPath(device) == filepath.Clean(backingFile)
	}
	info, err := loopStatus(device)
	return err == nil && info.Device == id.dev && info.Inode == id.ino
}

// backingPath is the path sysfs shows for a loop device's backing file.
func backingPath(device string) string {
	b, err := readSys(filepath.Join(sysBlock, filepath.Base(device), "loop", "backing_file"))
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(strings.TrimSpace(string(b)), deletedSuffix)
}

// fencedByPath lists the fenced loop devices whose backing file sysfs names
// path.
func fencedByPath(path string) []string {
	names, _ := filepath.Glob(filepath.Join(sysBlock, "loop*"))
	var out []string
	for _, sys := range names {
		dev := "/dev/" + filepath.Base(sys)
		if backingPath(dev) != filepath.Clean(path) {
			continue
		}
		if sysFenced(dev) {
			out = append(out, dev)
		}
	}
	return out
}

// sysFenced tells from sysfs whether dev was fenced. LOOP_GET_STATUS64 is no
// way to tell when the backing file's filesystem is gone: the kernel stats the
// file to answer it, and an evicted CephFS client (the very case of a node
// rejoining after a cut) fails that stat, so the fenced device would never be
// recognised, and never detached.
func sysFenced(dev string) bool {
	b, err := readSys(filepath.Join(sysBlock, filepath.Base(dev), "loop", "sizelimit"))
	if err != nil {
		return false
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	return err == nil && n == fenceSizeLimit
}

// detachWait bounds how long Detach waits for a deferred detach: other openers
// (udev's blkid, a scan by another process) hold a loop device for milliseconds.
const detachWait = 2 * time.Second

// waitDetached waits until dev no longer serves the file sysfs named backing, so
// that a Detach that returns means detached — an immediate re-attach of the same
// file would otherwise find the old device still winding down. Past detachWait it
// gives up quietly: the kernel finishes the detach when the last opener closes.
func waitDetached(ctx context.Context, dev, backing string) {
	ctx, cancel := context.WithTimeout(ctx, detachWait)
	defer cancel()
	for {
		now, err := readSys(filepath.Join(sysBlock, filepath.Base(dev), "loop", "backing_file"))
		if err != nil || string(now) != backing {
			klog.FromContext(ctx).V(2).Info("Detached loop device", "device", dev)
			return
		}
		if sleepContext(ctx) != nil {
			klog.FromContext(ctx).Info("Loop device still open elsewhere; it will detach when closed", "device", dev)
			return
		}
	}
}

// detachDevice clears dev; pending reports that other openers keep it bound
// until they close it (the kernel then only sets autoclear).
func (l *Loops) detachDevice(dev string) (pending bool, err error) {
	if where, err := mountedAt(dev); err != nil {
		return false, err
	} else if where != "" {
		return false, fmt.Errorf("detach %s: mounted at %s: %w", dev, where, ErrDeviceBusy)
	}
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		l.forget(dev)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("detach: %w", &os.PathError{Op: "open", Path: dev, Err: err})
	}
	// A fence set the device read-only (BLKROSET), a flag that outlives the
	// detach: the next user of the device (a mount -o loop, anybody's losetup)
	// would get it read-only. Dropped before the device is given back.
	clearReadOnly(fd, dev)
	err = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
	unix.Close(fd)
	if err != nil && !errors.Is(err, unix.ENXIO) {
		return false, fmt.Errorf("detach: %w", &os.PathError{Op: "LOOP_CLR_FD", Path: dev, Err: err})
	}
	l.forget(dev)
	if _, err := os.Stat(filepath.Join(sysBlock, filepath.Base(dev), "loop")); err == nil {
		return true, nil
	}
	klog.V(2).InfoS("Detached loop device", "device", dev)
	return false, nil
}

func (l *Loops) forget(dev string) {
	for id, d := range l.byID {
		if d == dev {
			delete(l.byID, id)
		}
	}
	delete(l.paths, dev)
}

// Refresh makes the device pick up the backing file's new size.
func (l *Loops) Refresh(device string) error {
	fd, err := unix.Open(device, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("refresh: %w", &os.PathError{Op: "open", Path: device, Err: err})
	}
	defer unix.Close(fd)
	if err := unix.IoctlSetInt(fd, unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("refresh: %w", &os.PathError{Op: "LOOP_SET_CAPACITY", Path: device, Err: err})
	}
	return nil
}

// Status reads a loop device's state from sysfs. A device that is not a loop
// device, or is not attached, yields an error wrapping os.ErrNotExist.
func (l *Loops) Status(device string) (LoopStatus, error) {
	name := filepath.Base(device)
	if !strings.HasPrefix(name, "loop") {
		return LoopStatus{}, fmt.Errorf("%s is not a loop device: %w", device, os.ErrNotExist)
	}
	backing, err := readSys(filepath.Join(sysBlock, name, "loop", "backing_file"))
	if err != nil {
		return LoopStatus{}, fmt.Errorf("%s is not attached: %w", device, err)
	}
	s := LoopStatus{Device: device, BackingFile: strings.TrimRight(string(backing), "\n")}
	if strings.HasSuffix(s.BackingFile, deletedSuffix) {
		s.BackingFile = strings.TrimSuffix(s.BackingFile, deletedSuffix)
		s.BackingDeleted = true
	}
	if s.DirectIO, err = readSysBool(device, "loop/dio"); err != nil {
		return LoopStatus{}, err
	}
	sectors, err := readSys(filepath.Join(sysBlock, name, "size"))
	if err != nil {
		return LoopStatus{}, fmt.Errorf("status %s: %w", device, err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(sectors)), 10, 64)
	if err != nil {
		return LoopStatus{}, fmt.Errorf("status %s: parse size: %w", device, err)
	}
	// sysfs size is always in 512-byte units, whatever the logical block size.
	s.SizeBytes = n * 512
	return s, nil
}

func readSysBool(device, attr string) (bool, error) {
	b, err := readSys(filepath.Join(sysBlock, filepath.Base(device), attr))
	if err != nil {
		return false, fmt.Errorf("read %s of %s: %w", attr, device, err)
	}
	return bytes.Equal(bytes.TrimSpace(b), []byte("1")), nil
}

// DeviceSize returns the size of a block device in bytes (of a regular file,
// its length).
func DeviceSize(device string) (int64, error) {
	_, size, err := statDevice(device)
	return size, err
}

// statDevice returns what device is (its stat) and its size in bytes, both
// from one open: the size of a block device, the length of a regular file.
func statDevice(device string) (unix.Stat_t, int64, error) {
	var st unix.Stat_t
	fd, err := unix.Open(device, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return st, 0, fmt.Errorf("device size: %w", &os.PathError{Op: "open", Path: device, Err: err})
	}
	defer unix.Close(fd)
	if err := unix.Fstat(fd, &st); err != nil {
		return st, 0, fmt.Errorf("device size: %w", &os.PathError{Op: "fstat", Path: device, Err: err})
	}
	if st.Mode&unix.S_IFMT == unix.S_IFREG {
		return st, st.Size, nil
	}
	var size uint64
	if err := ioctlPtr(fd, unix.BLKGETSIZE64, unsafe.Pointer(&size)); err != nil {
		return st, 0, fmt.Errorf("device size: %w", &os.PathError{Op: "BLKGETSIZE64", Path: device, Err: err})
	}
	return st, int64(size), nil
}

// SetReadOnly sets or clears the kernel read-only flag of a block device
// (BLKROSET). A read-only bind mount of a device node does not stop writes
// through it; this does, for every user of the device on this node. The flag
// outlives a detach; Attach clears it on the device it hands out.
func SetReadOnly(device string, readOnly bool) error {
	fd, err := unix.Open(device, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("set read-only: %w", &os.PathError{Op: "open", Path: device, Err: err})
	}
	defer unix.Close(fd)
	v := 0
	if readOnly {
		v = 1
	}
	if err := unix.IoctlSetPointerInt(fd, unix.BLKROSET, v); err != nil {
		return fmt.Errorf("set read-only: %w", &os.PathError{Op: "BLKROSET", Path: device, Err: err})
	}
	return nil
}

// LoopDevice is one bound loop device as the kernel reports it.
type LoopDevice struct {
	Device string
	// Backing is the path sysfs shows for the backing file: the kernel's
	// d_path, which for a file on a mount that was detached (a lazy unmount,
	// a torn-down NFS or CephFS client) has lost the mount's prefix. It
	// identifies nothing; Dev and Ino do.
	Backing string
	// Dev and Ino are the backing file's st_dev and st_ino, as
	// LOOP_GET_STATUS64 reports them (lo_device, lo_inode): valid when Err
	// is nil.
	Dev, Ino uint64
	// Err says why the device could not be identified: the kernel asks the
	// backing file's filesystem for the file's attributes to answer
	// LOOP_GET_STATUS64, and that filesystem failed (a FUSE daemon gone, an
	// evicted client) or did not answer within the wait (it hangs).
	Err error
	// Fenced: sysfs shows the fence's size limit (read without the backing
	// filesystem).
	Fenced bool
}

// ErrNotIdentified is the Err of a loop device whose backing file's
// filesystem did not answer in time.
var ErrNotIdentified = errors.New("the backing file's filesystem did not answer in time")

// List enumerates every bound loop device from sysfs and identifies each
// one's backing file by LOOP_GET_STATUS64, all at once, waiting at most wait
// for the answers: the ioctl makes the kernel ask the backing file's
// filesystem (vfs_getattr), and a filesystem that hangs must not hang the
// caller. An ioctl still under way at the end of the wait is left to end on
// its own. It never resolves a path: a pool whose path is gone, covered or
// hung is exactly when its devices must be found.
func (l *Loops) List(wait time.Duration) ([]LoopDevice, error) {
	names, err := filepath.Glob(filepath.Join(sysBlock, "loop*"))
	if err != nil {
		return nil, fmt.Errorf("list loop devices: %w", err)
	}
	var out []LoopDevice
	for _, sys := range names {
		b, err := readSys(filepath.Join(sys, "loop", "backing_file"))
		if err != nil {
			continue // not bound
		}
		dev := "/dev/" + filepath.Base(sys)
		out = append(out, LoopDevice{Device: dev, Backing: strings.TrimSuffix(strings.TrimSpace(string(b)), deletedSuffix),
			Fenced: sysFenced(dev), Err: ErrNotIdentified})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Device < out[j].Device })
	type answer struct {
		i    int
		info *unix.LoopInfo64
		err  error
	}
	answers := make(chan answer, len(out)) // buffered: a late answer never blocks
	for i := range out {
		go func() {
			info, err := loopStatus(out[i].Device)
			answers <- answer{i, info, err}
		}()
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for pending := len(out); pending > 0; pending-- {
		select {
		case a := <-answers:
			switch {
			case a.err == nil:
				out[a.i].Dev, out[a.i].Ino, out[a.i].Err = a.info.Device, a.info.Inode, nil
			case errors.Is(a.err, unix.ENXIO):
				out[a.i].Err = a.err // detached meanwhile: dropped below
			default:
				out[a.i].Err = a.err
			}
		case <-timer.C:
			pending = 0
		}
	}
	return slices.DeleteFunc(out, func(d LoopDevice) bool { return errors.Is(d.Err, unix.ENXIO) }), nil
}

// FileID is a file's st_dev and st_ino, as LOOP_GET_STATUS64 reports those of
// a loop device's backing file (both come from the kernel's getattr of the
// file, encoded the same way).
func FileID(f *os.File) (dev, ino uint64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, 0, &os.PathError{Op: "fstat", Path: f.Name(), Err: err}
	}
	return st.Dev, st.Ino, nil
}

// fenceSizeLimit is the size limit a fenced loop device maps its backing file
// with: one byte, less than a sector, so the device has no sectors at all. Its
// offset is left alone: a write the kernel took before the change lands where
// it always would have, inside the image, and nothing ever lands beyond it (a
// new offset past the end of the file, tried first, let writes the kernel was
// finishing grow the image to an exabyte).
const fenceSizeLimit = 1

// Fence stops every read and write through a loop device for good: it limits
// the device to less than one sector of its backing file, so the block layer
// refuses every I/O with EIO (Linux 6.5 and later check the end of a device
// of size zero; earlier ones let such I/O through) and its filesystem, if
// mounted, aborts; it also sets the read-only flag for what looks at it. Only
// a detach undoes it. BLKROSET alone is no fence: the kernel only warns about
// a mounted filesystem's writes to a read-only device and lets them through.
// The ioctl first flushes what the device has queued (the kernel does that for
// any change of its size limit), so on a filesystem that hangs it returns only
// when the filesystem does.
func (l *Loops) Fence(device string) error {
	fd, err := unix.Open(device, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("fence: %w", &os.PathError{Op: "open", Path: device, Err: err})
	}
	defer unix.Close(fd)
	_ = unix.IoctlSetPointerInt(fd, unix.BLKROSET, 1)
	info, err := unix.IoctlLoopGetStatus64(fd)
	if err != nil && !errors.Is(err, unix.ENXIO) {
		// The kernel stats the backing file to answer LOOP_GET_STATUS64, and
		// its filesystem failed (a FUSE daemon gone, an evicted client).
		// LOOP_SET_STATUS64 does not need it: the device's own settings are
		// read from sysfs instead.
		info, err = sysStatus(device)
	}
	if err != nil {
		return fmt.Errorf("fence: %w", &os.PathError{Op: "LOOP_GET_STATUS64", Path: device, Err: err})
	}
	info.Sizelimit = fenceSizeLimit
	if err := unix.IoctlLoopSetStatus64(fd, info); err != nil {
		return fmt.Errorf("fence: %w", &os.PathError{Op: "LOOP_SET_STATUS64", Path: device, Err: err})
	}
	l.mu.Lock()
	l.forget(device)
	l.mu.Unlock()
	return nil
}

// sysStatus is what LOOP_SET_STATUS64 needs of a device's current settings,
// read from sysfs: its offset, size limit and the flags the ioctl keeps.
func sysStatus(device string) (*unix.LoopInfo64, error) {
	dir := filepath.Join(sysBlock, filepath.Base(device), "loop")
	num := func(name string) (uint64, error) {
		b, err := readSys(filepath.Join(dir, name))
		if err != nil {
			return 0, err
		}
		return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	}
	info := &unix.LoopInfo64{}
	var err error
	if info.Offset, err = num("offset"); err != nil {
		return nil, fmt.Errorf("read the settings of %s from sysfs: %w", device, err)
	}
	if info.Sizelimit, err = num("sizelimit"); err != nil {
		return nil, fmt.Errorf("read the settings of %s from sysfs: %w", device, err)
	}
	for name, flag := range map[string]uint32{"autoclear": unix.LO_FLAGS_AUTOCLEAR, "partscan": unix.LO_FLAGS_PARTSCAN, "dio": unix.LO_FLAGS_DIRECT_IO} {
		if v, err := num(name); err == nil && v == 1 {
			info.Flags |= flag
		}
	}
	copy(info.File_name[:len(info.File_name)-1], backingPath(device))
	return info, nil
}

// Fenced tells whether a loop device was fenced (Fence): it maps nothing of
// its backing file.
func (l *Loops) Fenced(device string) (bool, error) {
	fd, err := unix.Open(device, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, &os.PathError{Op: "open", Path: device, Err: err}
	}
	defer unix.Close(fd)
	info, err := unix.IoctlLoopGetStatus64(fd)
	if err != nil {
		if sysFenced(device) {
			return true, nil // its backing file's filesystem does not answer (sysFenced)
		}
		return false, &os.PathError{Op: "LOOP_GET_STATUS64", Path: device, Err: err}
	}
	return info.Sizelimit == fenceSizeLimit, nil
}

// FenceHolds tells whether this kernel refuses I/O to a block device of size
// zero (Linux 6.5 and later: "block: make bio_check_eod work for zero sized
// devices"), which Fence relies on, and names the kernel.
func FenceHolds() (bool, string) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return false, "unknown"
	}
	release := unix.ByteSliceToString(u.Release[:])
	var major, minor int
	if _, err := fmt.Sscanf(release, "%d.%d", &major, &minor); err != nil {
		return false, release
	}
	return major > 6 || major == 6 && minor >= 5, release
}

// readSys reads a sysfs attribute (at most a page, which is all sysfs ever
// prints) with bare system calls: a scan reads two for every bound loop device.
func readSys(path string) ([]byte, error) { return fsx.ReadKernelFile(path, 8192) }
