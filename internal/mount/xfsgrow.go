package mount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
)

// ErrGrowUnderWay marks a growth refused because another growth of the same
// filesystem is still running in the kernel: typically one a node plugin
// started before it was killed (the kernel finishes it whatever happens to
// the process), or one whose writes wait on a pool that stopped answering.
// The caller retries later (ABORTED).
var ErrGrowUnderWay = errors.New("a growth of this filesystem is already under way")

// growWait bounds how long a growth waits for another growth of the same
// filesystem to end before it answers ErrGrowUnderWay. A variable for tests.
var growWait = 10 * time.Second

// growRetry is how often a growth that found another one under way tries
// again.
const growRetry = 200 * time.Millisecond

// XFS's ioctls (linux/fs/xfs/libxfs/xfs_fs.h), which xfs_growfs makes. The
// geometry is the version 1 structure: it has the three fields a growth needs
// and every kernel that mounts a V5 filesystem answers it.
const (
	xfsIocFSGeometryV1  = 0x80705864 // _IOR('X', 100, struct xfs_fsop_geom_v1)
	xfsIocFSGrowFSData  = 0x4010586e // _IOW('X', 110, struct xfs_growfs_data)
	xfsSuperMagic       = 0x58465342 // "XFSB"
	xfsGeometryV1Length = 112
)

type xfsGeometryV1 struct {
	BlockSize    uint32
	RTExtSize    uint32
	AGBlocks     uint32
	AGCount      uint32
	LogBlocks    uint32
	SectSize     uint32
	InodeSize    uint32
	IMaxPct      uint32
	DataBlocks   uint64
	RTBlocks     uint64
	RTExtents    uint64
	LogStart     uint64
	UUID         [16]byte
	SUnit        uint32
	SWidth       uint32
	Version      int32
	Flags        uint32
	LogSectSize  uint32
	RTSectSize   uint32
	DirBlockSize uint32
	_            uint32 // the C structure's tail padding
}

type xfsGrowFSData struct {
	NewBlocks uint64
	IMaxPct   uint32
	_         uint32
}

// Both layouts are the kernel's ABI: a wrong size would make the ioctl's
// number name another request.
var (
	_ [xfsGeometryV1Length - unsafe.Sizeof(xfsGeometryV1{})]struct{}
	_ [unsafe.Sizeof(xfsGeometryV1{}) - xfsGeometryV1Length]struct{}
	_ [16 - unsafe.Sizeof(xfsGrowFSData{})]struct{}
	_ [unsafe.Sizeof(xfsGrowFSData{}) - 16]struct{}
)

// growXFS grows the xfs filesystem of device, mounted at mountPath, to the
// device's size, with the ioctl xfs_growfs makes, and without xfs_growfs:
//   - xfs_growfs starts by resolving the path of every mount in the mount
//     table (libfrog's fs_table), so one FUSE or network mount anywhere on
//     the node that stopped answering (a shared pool whose client hangs)
//     hangs the growth of every local xfs volume until the request's
//     deadline kills it;
//   - a node plugin killed while xfs_growfs runs leaves it running, and
//     what it left was then refused by the next growth as an unexplained
//     failure.
//
// The directory is opened below the Mounter's root without links, and grown
// only if the filesystem it is on is device's: the path is not looked up
// again between the check and the growth.
func (m *Mounter) growXFS(ctx context.Context, device, mountPath string) error {
	dir, err := m.openDir(mountPath)
	if err != nil {
		return err
	}
	// Whatever happens to ctx, the descriptor is closed when the ioctl
	// returns: a growth waiting on its device ends in the kernel, never here.
	// It is closed before the answer: an unmount right after the answer must
	// not find the mount still held open.
	done := make(chan error, 1)
	m.left.Add(1)
	go func() {
		defer m.left.Done()
		err := growXFSAt(ctx, dir, device)
		dir.Close()
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("grow xfs on %s at %s: %w", device, mountPath, ctx.Err())
	}
}

// openDir opens mountPath, a directory below the root, for reading.
func (m *Mounter) openDir(mountPath string) (*os.File, error) {
	h, err := m.hold(mountPath, makeNothing)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	if h.self == nil {
		return nil, &os.PathError{Op: "open", Path: mountPath, Err: unix.ENOENT}
	}
	// Reopening the O_PATH descriptor opens what was resolved, not the name.
	fd, err := unix.Open(h.selfPath(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: mountPath, Err: err}
	}
	return os.NewFile(uintptr(fd), mountPath), nil
}

func growXFSAt(ctx context.Context, dir *os.File, device string) error {
	fd := int(dir.Fd())
	var fsStat unix.Statfs_t
	if err := unix.Fstatfs(fd, &fsStat); err != nil {
		return &os.PathError{Op: "statfs", Path: dir.Name(), Err: err}
	}
	if fsStat.Type != xfsSuperMagic {
		return fmt.Errorf("grow xfs on %s: %s is not on an xfs filesystem: %w", device, dir.Name(), ErrMountConflict)
	}
	var dirStat unix.Stat_t
	if err := unix.Fstat(fd, &dirStat); err != nil {
		return &os.PathError{Op: "stat", Path: dir.Name(), Err: err}
	}
	devStat, size, err := statDevice(device)
	if err != nil {
		return err
	}
	if devStat.Mode&unix.S_IFMT != unix.S_IFBLK || dirStat.Dev != devStat.Rdev {
		return fmt.Errorf("grow xfs on %s: %s is on device %d:%d: %w", device, dir.Name(),
			unix.Major(dirStat.Dev), unix.Minor(dirStat.Dev), ErrMountConflict)
	}
	var geo xfsGeometryV1
	if err := ioctlPtr(fd, xfsIocFSGeometryV1, unsafe.Pointer(&geo)); err != nil {
		return &os.PathError{Op: "XFS_IOC_FSGEOMETRY_V1", Path: dir.Name(), Err: err}
	}
	if geo.BlockSize == 0 {
		return fmt.Errorf("grow xfs on %s: the kernel answered a block size of 0", device)
	}
	newBlocks := uint64(size) / uint64(geo.BlockSize)
	if newBlocks <= geo.DataBlocks {
		// Grown already (by us before a restart, or by a growth that ended
		// while we waited), or a device smaller than its filesystem, which
		// growing must never shrink.
		klog.FromContext(ctx).V(4).Info("xfs needs no growth", "device", device, "blocks", geo.DataBlocks, "deviceBlocks", newBlocks)
		return nil
	}
	in := xfsGrowFSData{NewBlocks: newBlocks, IMaxPct: geo.IMaxPct}
	if err := ioctlPtr(fd, xfsIocFSGrowFSData, unsafe.Pointer(&in)); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("grow xfs on %s from %d to %d blocks: %w", device, geo.DataBlocks, newBlocks, ErrGrowUnderWay)
		}
		return &os.PathError{Op: "XFS_IOC_FSGROWFSDATA", Path: dir.Name(), Err: err}
	}
	klog.FromContext(ctx).V(2).Info("Grew xfs", "device", device, "fromBlocks", geo.DataBlocks, "toBlocks", newBlocks, "blockSize", geo.BlockSize)
	return nil
}

func ioctlPtr(fd int, req uint, arg unsafe.Pointer) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg)); errno != 0 {
		return errno
	}
	return nil
}

// growUnderWayOutput reports whether a resize tool's failure says another
// resize of the filesystem is running: btrfs-progs names the kernel's
// exclusive-operation error ("... operation in progress"), resize2fs the
// EBUSY of ext4's resize flag.
func growUnderWayOutput(err error) bool {
	s := err.Error()
	return strings.Contains(s, "operation in progress") || strings.Contains(s, "Device or resource busy")
}

// waitForGrowth runs grow until it no longer finds another growth under way,
// at most growWait (or until ctx ends), and returns its last error.
func waitForGrowth(ctx context.Context, device string, grow func() error) error {
	err := grow()
	if !errors.Is(err, ErrGrowUnderWay) {
		return err
	}
	klog.FromContext(ctx).Info("Another growth of the filesystem is under way; waiting for it", "device", device, "wait", growWait)
	start := time.Now()
	_ = wait.PollUntilContextTimeout(ctx, growRetry, growWait, false, func(context.Context) (bool, error) {
		err = grow()
		return !errors.Is(err, ErrGrowUnderWay), nil
	})
	if errors.Is(err, ErrGrowUnderWay) {
		return fmt.Errorf("%w (waited %s)", err, time.Since(start).Round(time.Millisecond))
	}
	return err
}
