package mount

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// FIFREEZE and FITHAW are _IOWR('X', 119, int) and _IOWR('X', 120, int)
// (linux/fs.h); golang.org/x/sys/unix does not export them.
const (
	ioctlFIFREEZE = 0xC0045877
	ioctlFITHAW   = 0xC0045878
)

// Freeze freezes the filesystem mounted at path, so a copy of its device is a
// clean filesystem image, and returns the function that thaws it. Writers block
// until the thaw.
func Freeze(path string) (thaw func() error, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("freeze %s: %w", path, err)
	}
	if err := unix.IoctlSetInt(int(f.Fd()), ioctlFIFREEZE, 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("freeze %s: %w", path, err)
	}
	return func() error {
		defer f.Close()
		if err := unix.IoctlSetInt(int(f.Fd()), ioctlFITHAW, 0); err != nil {
			return fmt.Errorf("thaw %s: %w", path, err)
		}
		return nil
	}, nil
}

// Thaw thaws the filesystem mounted at path; one that is not frozen is left
// as it is.
func Thaw(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("thaw %s: %w", path, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), ioctlFITHAW, 0); err != nil && !errors.Is(err, unix.EINVAL) { // EINVAL: not frozen
		return fmt.Errorf("thaw %s: %w", path, err)
	}
	return nil
}
