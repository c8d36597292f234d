// Package unixsock listens on a unix socket path that another process may own
// too: kubelet's plugins_registry and the CSI socket directory are shared by
// every instance of the driver on a node (a restarted pod overlaps the one it
// replaces). A socket file is replaced only when nothing answers on it, and
// removed on the way out only while it is still the one this process made;
// anything else found at the path (a directory, a regular file, a live socket)
// is reported, never deleted.
package unixsock

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// ErrInUse marks a path that holds something other than a stale socket.
var ErrInUse = errors.New("socket path in use")

// Socket is a listening unix socket and the identity of its file.
type Socket struct {
	net.Listener
	path     string
	dev, ino uint64
	// ctime tells a new file from ours: an inode number is reused at once,
	// and a replacement by another process comes clock ticks later.
	ctime unix.Timespec
}

// Listen listens on path, replacing a stale socket file there (one nothing
// answers on, left by a process that died).
func Listen(path string) (*Socket, error) {
	var st unix.Stat_t
	switch err := unix.Lstat(path, &st); {
	case errors.Is(err, unix.ENOENT):
	case err != nil:
		return nil, &os.PathError{Op: "lstat", Path: path, Err: err}
	case st.Mode&unix.S_IFMT != unix.S_IFSOCK:
		return nil, fmt.Errorf("%w: %s is %s, not a socket: remove it by hand if it is not needed", ErrInUse, path, kind(st.Mode))
	default:
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			_ = c.Close()
			return nil, fmt.Errorf("%w: another process serves %s", ErrInUse, path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	// Go would unlink the path on Close, whatever is there by then.
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := unix.Lstat(path, &st); err != nil {
		_ = lis.Close()
		return nil, &os.PathError{Op: "lstat", Path: path, Err: err}
	}
	return &Socket{Listener: lis, path: path, dev: st.Dev, ino: st.Ino, ctime: st.Ctim}, nil
}

// Remove removes the socket file if it is still the one Listen made, and
// says what it found otherwise (nil: removed, or already gone).
func (s *Socket) Remove() error {
	var st unix.Stat_t
	switch err := unix.Lstat(s.path, &st); {
	case errors.Is(err, unix.ENOENT):
		return nil
	case err != nil:
		return &os.PathError{Op: "lstat", Path: s.path, Err: err}
	case st.Mode&unix.S_IFMT != unix.S_IFSOCK || st.Dev != s.dev || st.Ino != s.ino || st.Ctim != s.ctime:
		return fmt.Errorf("%w: %s was replaced (now %s) by another process: left as it is", ErrInUse, s.path, kind(st.Mode))
	}
	if err := os.Remove(s.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove socket %s: %w", s.path, err)
	}
	return nil
}

func kind(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return "a directory"
	case unix.S_IFREG:
		return "a regular file"
	case unix.S_IFLNK:
		return "a symbolic link"
	case unix.S_IFSOCK:
		return "another socket"
	}
	return "a special file"
}
