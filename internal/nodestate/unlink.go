package nodestate

import (
	"os"

	"golang.org/x/sys/unix"
)

// removeAt unlinks name in the directory d, never following a link.
func removeAt(d *os.File, name string) error {
	if err := unix.Unlinkat(int(d.Fd()), name, 0); err != nil {
		return &os.PathError{Op: "unlink", Path: d.Name() + "/" + name, Err: err}
	}
	return nil
}
