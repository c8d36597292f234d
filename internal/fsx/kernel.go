package fsx

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ReadKernelFile reads a file the kernel generates (/proc, /sys) with bare
// system calls: open, reads until end of file, close. os.ReadFile costs about
// twice as much on such files: os.File adds each pollable one (procfs and
// sysfs files are) to the runtime's epoll set and takes it out again, and
// stats it first, four to five system calls that read nothing. The mount
// table is read several times a volume's life and a loop device's sysfs
// attributes at every scan, so that overhead was a measurable part of a
// node call (docs/performance.md). At most max bytes are read; a longer file
// is an error. Only for kernel files: a pool's file goes through a Tree.
func ReadKernelFile(path string, max int) ([]byte, error) {
	fd, err := openRetry(path)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	buf := make([]byte, 0, min(max+1, 4096))
	for {
		if len(buf) == cap(buf) {
			if len(buf) > max {
				return nil, fmt.Errorf("read %s: longer than %d bytes", path, max)
			}
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := unix.Read(fd, buf[len(buf):cap(buf)])
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		}
		if n == 0 {
			if len(buf) > max {
				return nil, fmt.Errorf("read %s: longer than %d bytes", path, max)
			}
			return buf, nil
		}
		buf = buf[:len(buf)+n]
	}
}

func openRetry(path string) (int, error) {
	for {
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if !errors.Is(err, unix.EINTR) {
			return fd, err
		}
	}
}
