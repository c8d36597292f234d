package mount

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// FIFREEZE and FITHAW are _IOWR('X', 119, int) and _IOWR('X', 120, int)
// (linux/fs.h); golang.org/x/sys/unix does not export them.
const (
	ioctlFIFREEZE = 0xC0045877
	ioctlFITHAW   = 0xC0045878
)

// ErrNotTheMount is returned when a path is not the root of a mount of the
// device's filesystem: nothing is frozen or thawed there.
var ErrNotTheMount = errors.New("not the root of a mount of the volume's filesystem")

// A freeze acts on one descriptor, opened once and checked: a path is never
// resolved twice, so a link or a rename between the check and the ioctl
// cannot aim the freeze at another filesystem (the host's root, kubelet's
// directory). The path is opened below the allowed prefix with openat2
// (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) and
// O_DIRECTORY, so a FIFO or a device node there is refused by the lookup
// itself, never opened; then the descriptor's own mount (its mnt_id in
// /proc/self/fdinfo) must be a mount table entry at that path, of the
// filesystem's root, whose source is the volume's loop device, and fstat
// must show that entry's device (but on btrfs, whose devices are anonymous).

// openMountRoot opens path below prefix ("" is /) and checks it is the root of
// a mount of dev's filesystem.
func openMountRoot(prefix, path, dev string) (*os.File, error) {
	if prefix == "" {
		prefix = "/"
	}
	if !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return nil, fmt.Errorf("%w: %q is not a clean absolute path", ErrNotTheMount, path)
	}
	rel, err := filepath.Rel(prefix, path)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return nil, fmt.Errorf("%w: %s is not below %s", ErrNotTheMount, path, prefix)
	}
	f, err := fsx.OpenBeneath(prefix, rel, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, fsx.ErrUnsafe) || errors.Is(err, unix.ENOTDIR) {
			return nil, fmt.Errorf("%w: %w", ErrNotTheMount, err)
		}
		return nil, err
	}
	if err := checkMountRoot(f, path, dev); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// checkMountRoot checks on f's descriptor that it is the root of a mount at
// path of dev's filesystem.
func checkMountRoot(f *os.File, path, dev string) error {
	id, err := mountID(f)
	if err != nil {
		return err
	}
	infos, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) { return i.ID != id, i.ID == id })
	if err != nil {
		return fmt.Errorf("read mountinfo: %w", err)
	}
	if len(infos) != 1 {
		return fmt.Errorf("%w: the mount of %s (ID %d) is not in the mount table", ErrNotTheMount, path, id)
	}
	m := infos[0]
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("fstat %s: %w", path, err)
	}
	var dst unix.Stat_t
	if err := unix.Stat(dev, &dst); err != nil {
		return fmt.Errorf("stat %s: %w", dev, err)
	}
	switch {
	case m.Mountpoint != path || m.Root != "/":
		return fmt.Errorf("%w: %s is in the mount of %s at %s, not the root of a mount there", ErrNotTheMount, path, m.Root, m.Mountpoint)
	case m.Source != dev:
		return fmt.Errorf("%w: %s shows a filesystem of %s, not of %s", ErrNotTheMount, path, m.Source, dev)
	case dst.Mode&unix.S_IFMT != unix.S_IFBLK:
		return fmt.Errorf("%w: %s is not a block device", ErrNotTheMount, dev)
	// btrfs shows anonymous devices of its own (one in the mount table,
	// another per subvolume in stat); every other filesystem poolcsi makes
	// shows the block device it is on, in both.
	case m.FSType == "btrfs":
	case int(unix.Major(st.Dev)) != m.Major || int(unix.Minor(st.Dev)) != m.Minor:
		return fmt.Errorf("%w: %s is on device %d:%d, its mount shows %d:%d", ErrNotTheMount, path, unix.Major(st.Dev), unix.Minor(st.Dev), m.Major, m.Minor)
	case m.Major != int(unix.Major(dst.Rdev)) || m.Minor != int(unix.Minor(dst.Rdev)):
		return fmt.Errorf("%w: %s is on device %d:%d, not %s (%d:%d)", ErrNotTheMount, path, m.Major, m.Minor, dev, unix.Major(dst.Rdev), unix.Minor(dst.Rdev))
	}
	return nil
}

// mountID is the ID of the mount f is in, from /proc/self/fdinfo.
func mountID(f *os.File) (int, error) {
	raw, err := fsx.ReadFileAt("/proc/self/fdinfo/"+strconv.Itoa(int(f.Fd())), 64<<10)
	if err != nil {
		return 0, fmt.Errorf("mount ID of %s: %w", f.Name(), err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "mnt_id:"); ok {
			id, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				return 0, fmt.Errorf("mount ID of %s: %q: %w", f.Name(), line, err)
			}
			return id, nil
		}
	}
	return 0, fmt.Errorf("mount ID of %s: no mnt_id in fdinfo", f.Name())
}

// Hold is a filesystem this process froze. It is thawed by Thaw, or by its
// bound, whichever comes first.
type Hold struct {
	mu      sync.Mutex
	f       *os.File
	timer   *time.Timer
	thawed  bool
	expired bool
	thaw    func(fd int) error
}

// FreezeMount freezes the filesystem of dev mounted at path (below prefix,
// checked on the descriptor as above) and returns its hold. The thaw at bound
// is armed before the freeze: it runs FITHAW on the same descriptor and
// nothing else (no log, no write), so nothing a frozen filesystem blocks can
// hold it up, whatever happens to the caller.
func FreezeMount(prefix, path, dev string, bound time.Duration) (*Hold, error) {
	f, err := openMountRoot(prefix, path, dev)
	if err != nil {
		return nil, fmt.Errorf("freeze %s: %w", path, err)
	}
	return freezeFD(f, bound, func(fd int) error { return unix.IoctlSetInt(fd, ioctlFIFREEZE, 0) },
		func(fd int) error { return unix.IoctlSetInt(fd, ioctlFITHAW, 0) })
}

// freezeFD freezes f's filesystem with freeze and arms the thaw at bound
// before it; the hold owns f.
func freezeFD(f *os.File, bound time.Duration, freeze, thaw func(fd int) error) (*Hold, error) {
	h := &Hold{f: f, thaw: thaw}
	h.mu.Lock()
	defer h.mu.Unlock()
	// Armed first; it takes mu, so it cannot run before the freeze is done.
	h.timer = time.AfterFunc(bound, h.expire)
	if err := freeze(int(f.Fd())); err != nil {
		h.timer.Stop()
		h.thawed = true
		f.Close()
		return nil, fmt.Errorf("freeze %s: %w", f.Name(), err)
	}
	return h, nil
}

// expire is the bound's thaw: one ioctl on the held descriptor.
func (h *Hold) expire() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.thawed {
		return
	}
	if err := h.thaw(int(h.f.Fd())); err == nil || errors.Is(err, unix.EINVAL) {
		h.thawed, h.expired = true, true
	} else {
		h.timer.Reset(10 * time.Millisecond) // tried again until it works
	}
}

// Expired tells whether the bound thawed the filesystem (Thaw had not).
func (h *Hold) Expired() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.expired
}

// Thaw thaws the filesystem through the held descriptor, unless the bound did
// already, and lets the descriptor go.
func (h *Hold) Thaw() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.thawed {
		if err := h.thaw(int(h.f.Fd())); err != nil && !errors.Is(err, unix.EINVAL) { // EINVAL: not frozen
			return fmt.Errorf("thaw %s: %w", h.f.Name(), err)
		}
		h.thawed = true
	}
	h.timer.Stop()
	if h.f != nil {
		h.f.Close()
		h.f = nil
	}
	return nil
}

// ThawMount thaws the filesystem of dev mounted at path, checked as for
// FreezeMount; one that is not frozen is left as it is.
func ThawMount(prefix, path, dev string) error {
	f, err := openMountRoot(prefix, path, dev)
	if err != nil {
		return fmt.Errorf("thaw %s: %w", path, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), ioctlFITHAW, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("thaw %s: %w", path, err)
	}
	return nil
}
