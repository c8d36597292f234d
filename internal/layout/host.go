package layout

import (
	"context"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/cgroup"
	"github.com/poolcsi/poolcsi/internal/mount"
)

// The driver reaches the node's kernel only through these four interfaces:
// the real implementations are in internal/mount, and internal/mount/fake
// stands in for them so every handler runs in unit tests without root.

// MountTable is the node's mounts.
type MountTable interface {
	Info(target string) (mount.MountInfo, bool, error)
	Mount(ctx context.Context, source, target, fsType string, options []string) error
	Bind(ctx context.Context, source, target string, readOnly bool, options []string) error
	BindBlock(ctx context.Context, device, target string, readOnly bool) error
	UnmountChecked(ctx context.Context, target string, check func(mount.MountInfo) error) error
	MountPoints(dev string) ([]string, error)
	MountsBelow(dir string) ([]string, error)
	MountedElsewhere(data string, except ...string) (string, error)
	SameDir(a, b string) bool
	OnDevice(path, dev string) bool
	IsDevice(path, dev string) bool
	// Table lists every mount, for the node-side health checks.
	Table() ([]mount.MountEntry, error)
}

// LoopDevices attaches image files as block devices.
type LoopDevices interface {
	Attach(ctx context.Context, backingFile string) (string, error)
	Find(backingFile string) (string, bool, error)
	Detach(ctx context.Context, backingFile string) error
	Refresh(device string) error
	Status(device string) (mount.LoopStatus, error)
	// List enumerates every bound loop device from the kernel and
	// identifies each one's backing file by its device and inode, waiting
	// at most wait for filesystems that hang; it never resolves a path.
	List(wait time.Duration) ([]mount.LoopDevice, error)
	// Fence stops all I/O through a device until it is detached; Fenced
	// tells whether it was.
	Fence(device string) error
	Fenced(device string) (bool, error)
	// DetachFenced detaches a fenced device that nothing mounts, without
	// its backing file (whose filesystem may be gone).
	DetachFenced(device string) error
	// Backs tells whether device is a loop device, fenced or not, of
	// backingFile.
	Backs(device, backingFile string) bool
}

// BlockDevices formats, sizes and grows devices and image files.
type BlockDevices interface {
	Format(ctx context.Context, target, fsType string) error
	DiskFormat(ctx context.Context, target string) (string, error)
	FilesystemSize(device string) (fsType string, size int64, err error)
	Size(device string) (int64, error)
	ReadOnly(device string) (bool, error)
	SetReadOnly(device string, readOnly bool) error
	NeedResize(ctx context.Context, device, mountPath string) (bool, error)
	ResizeFS(ctx context.Context, device, mountPath string) error
}

// Filesystems answers statfs and freezes mounted filesystems.
type Filesystems interface {
	Statfs(path string, st *unix.Statfs_t) error
	Ext4Errors(device string) (count int64, firstFunc string, err error)
	// FreezeMount freezes the filesystem of dev mounted at path, a path
	// opened once below prefix without links and checked on its descriptor
	// to be that mount's root (mount.ErrNotTheMount otherwise); the hold is
	// thawed at bound whatever else happens. ThawMount thaws such a mount.
	FreezeMount(prefix, path, dev string, bound time.Duration) (mount.FrozenFS, error)
	ThawMount(prefix, path, dev string) error
	// Allocate fills [off, off+length) of an image with allocated blocks
	// (preallocate: true), durably.
	Allocate(f *os.File, off, length int64) error
}

// Cgroups holds a pod's I/O on a block device to limits (the pod's cgroup,
// found from its UID; cgroup.ErrNoPodCgroup when there is none) and returns
// the cgroup it wrote; Held reads what the pod's cgroup holds for the device
// (zero Limits when nothing).
type Cgroups interface {
	Apply(podUID, device string, l cgroup.Limits) (string, error)
	Held(podUID, device string) (cgroup.Limits, string, error)
}

// Host is how a Driver reaches the node's kernel; a nil field takes the real
// implementation.
type Host struct {
	Mounts  MountTable
	Loops   LoopDevices
	Devices BlockDevices
	FS      Filesystems
	Cgroups Cgroups
}

// WithDefaults fills the nil fields with the real implementations, which
// mount only below pathPrefix ("" for anywhere) and find pods' cgroups below
// cgroupRoot.
func (h Host) WithDefaults(pathPrefix, cgroupRoot string) (Host, error) {
	m := mount.NewMounterBeneath(pathPrefix)
	if h.Mounts == nil {
		h.Mounts = m
	}
	if h.Loops == nil {
		loops, err := mount.NewLoops()
		if err != nil {
			return h, err
		}
		h.Loops = loops
	}
	if h.Devices == nil {
		h.Devices = mount.NewDevices(m)
	}
	if h.FS == nil {
		h.FS = mount.Filesystems{}
	}
	if h.Cgroups == nil {
		h.Cgroups = cgroup.FS{Root: cgroupRoot}
	}
	return h, nil
}
