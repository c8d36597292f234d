package mount

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Staging and target paths are the CO's input, and a path checked by name and
// then used by name can be swapped in between: a symbolic link put in place of
// one of its directories after the check moves the mount (or the unmount, or
// the directory made for it) anywhere on the node. So every path the Mounter
// mounts on, binds from, unmounts or creates is resolved once, below the
// Mounter's root (--allowed-path-prefix), with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS), each missing directory made with mkdirat relative to
// its parent's descriptor, and the system call then acts on what was resolved:
// mount(2) on /proc/self/fd/N of the target itself, umount2(2) on
// /proc/self/fd/<parent>/<name> with UMOUNT_NOFOLLOW, unlinkat on the parent.
// Only the root, which the operator configured, may be reached through links.

// ErrOutsideRoot marks a path that is not strictly below the Mounter's root.
var ErrOutsideRoot = errors.New("path is not below the allowed directory")

// ErrLinkInPath marks a path that goes through a symbolic link below the root.
var ErrLinkInPath = errors.New("path goes through a symbolic link")

const beneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// makeKind says what hold makes when the path is missing.
type makeKind int

const (
	makeNothing makeKind = iota
	makeDir              // a directory (a staging or filesystem target path)
	makeFile             // an empty file (a block volume's target path)
	// parentOnly opens the parent and not the object: an unmount must not
	// hold the mount it takes down (an open descriptor keeps it busy).
	parentOnly
)

// held is a path resolved below the root: its parent directory, open, and the
// name in it; and, once there, the object itself.
type held struct {
	parent *os.File
	base   string
	self   *os.File // nil when missing (only with makeNothing)
}

func (h *held) Close() {
	if h.self != nil {
		h.self.Close()
	}
	h.parent.Close()
}

// selfPath names the object itself: a system call on it acts on exactly
// what was resolved, whatever the path shows now.
func (h *held) selfPath() string { return "/proc/self/fd/" + strconv.Itoa(int(h.self.Fd())) }

// atPath names the entry in the parent that was resolved: the last component
// is looked up again (an unmount needs that, or it would keep the mount busy),
// so callers pass NOFOLLOW flags.
func (h *held) atPath() string {
	return "/proc/self/fd/" + strconv.Itoa(int(h.parent.Fd())) + "/" + h.base
}

// Root is the directory every path the Mounter acts on must be strictly below.
func (m *Mounter) Root() string {
	if m.root == "" {
		return "/"
	}
	return m.root
}

// relative checks that target is a clean absolute path strictly below the
// root and returns it relative to the root.
func (m *Mounter) relative(target string) (string, error) {
	root := m.Root()
	if !filepath.IsAbs(target) || filepath.Clean(target) != target {
		return "", fmt.Errorf("%s: %w: not a clean absolute path", target, ErrOutsideRoot)
	}
	var rel string
	switch {
	case root == "/":
		rel = strings.TrimPrefix(target, "/")
	case strings.HasPrefix(target, root+"/"):
		rel = strings.TrimPrefix(target, root+"/")
	}
	if rel == "" {
		return "", fmt.Errorf("%s: %w %s", target, ErrOutsideRoot, root)
	}
	return rel, nil
}

func openat2(dirfd int, rel string, flags int, what string) (*os.File, error) {
	fd, err := unix.Openat2(dirfd, rel, &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Resolve: beneath})
	switch {
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV):
		return nil, fmt.Errorf("%s: %w (or leaves the allowed directory)", what, ErrLinkInPath)
	case err != nil:
		return nil, &os.PathError{Op: "open", Path: what, Err: err}
	}
	return os.NewFile(uintptr(fd), what), nil
}

// hold resolves target below the root, making what is missing when make
// says so (directories on the way with mkdirat, mode 0750).
func (m *Mounter) hold(target string, make makeKind) (*held, error) {
	rel, err := m.relative(target)
	if err != nil {
		return nil, err
	}
	rootFD, err := unix.Open(m.Root(), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: m.Root(), Err: err}
	}
	cur := os.NewFile(uintptr(rootFD), m.Root())
	dir, base := filepath.Split(rel)
	path := m.Root()
	for _, c := range strings.Split(strings.TrimSuffix(dir, "/"), "/") {
		if c == "" {
			continue
		}
		path = filepath.Join(path, c)
		next, err := openat2(int(cur.Fd()), c, unix.O_PATH|unix.O_DIRECTORY, path)
		if errors.Is(err, fs.ErrNotExist) && (make == makeDir || make == makeFile) {
			if err := unix.Mkdirat(int(cur.Fd()), c, 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
				cur.Close()
				return nil, &os.PathError{Op: "mkdir", Path: path, Err: err}
			}
			next, err = openat2(int(cur.Fd()), c, unix.O_PATH|unix.O_DIRECTORY, path)
		}
		cur.Close()
		if err != nil {
			return nil, err
		}
		cur = next
	}
	h := &held{parent: cur, base: base}
	if make == parentOnly {
		return h, nil
	}
	self, err := openat2(int(cur.Fd()), base, unix.O_PATH, target)
	if errors.Is(err, fs.ErrNotExist) && make != makeNothing {
		if make == makeDir {
			err = unix.Mkdirat(int(cur.Fd()), base, 0o750)
		} else {
			var fd int
			fd, err = unix.Openat(int(cur.Fd()), base, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_RDONLY|unix.O_CLOEXEC, 0o640)
			if err == nil {
				unix.Close(fd)
			}
		}
		if err != nil && !errors.Is(err, unix.EEXIST) {
			cur.Close()
			return nil, &os.PathError{Op: "create", Path: target, Err: err}
		}
		self, err = openat2(int(cur.Fd()), base, unix.O_PATH, target)
	}
	switch {
	case errors.Is(err, fs.ErrNotExist) && make == makeNothing:
		return h, nil
	case err != nil:
		cur.Close()
		return nil, err
	}
	h.self = self
	if make != makeNothing {
		if err := checkKind(self, make); err != nil {
			h.Close()
			return nil, err
		}
	}
	return h, nil
}

func checkKind(f *os.File, make makeKind) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return &os.PathError{Op: "stat", Path: f.Name(), Err: err}
	}
	t := st.Mode & unix.S_IFMT
	switch {
	case make == makeDir && t != unix.S_IFDIR:
		return fmt.Errorf("%s is not a directory", f.Name())
	case make == makeFile && t != unix.S_IFREG && t != unix.S_IFBLK:
		return fmt.Errorf("%s is not a file", f.Name())
	}
	return nil
}

// underRoot tells whether path is strictly below the root, so that it is a
// CO's path (a bind source that is a staging path) rather than one the driver
// made (a pool's handle, a device node).
func (m *Mounter) underRoot(path string) bool {
	_, err := m.relative(path)
	return err == nil && !strings.HasPrefix(path, "/proc/") && !strings.HasPrefix(path, "/dev/")
}
