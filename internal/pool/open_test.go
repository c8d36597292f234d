package pool

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestOpenAfterAFailedStat: what Open does with each answer of the pool
// path's stat the kernel gives only to others than root, or by hanging
// (test/faults makes the dead-mount cases with a real FUSE daemon). Open
// never fails on them, never creates the path, and the pool is unavailable.
func TestOpenAfterAFailedStat(t *testing.T) {
	for _, errno := range []unix.Errno{unix.EACCES, unix.EIO, unix.ESTALE, unix.ENOTCONN, unix.ELOOP, unix.EOVERFLOW} {
		for _, shared := range []bool{false, true} {
			name := errno.Error() + ", local"
			if shared {
				name = errno.Error() + ", shared"
			}
			t.Run(name, func(t *testing.T) {
				path := filepath.Join(t.TempDir(), "pool")
				stat := statPath
				t.Cleanup(func() { statPath = stat })
				statPath = func(name string) (os.FileInfo, error) {
					if name == path {
						return nil, &os.PathError{Op: "stat", Path: name, Err: errno}
					}
					return stat(name)
				}
				p, err := Open(Config{Name: "p", Path: path, Shared: shared})
				if err != nil {
					t.Fatalf("Open failed: %v", err)
				}
				if oerr := p.OpenError(); !errors.Is(oerr, ErrUnavailable) || !errors.Is(oerr, errno) {
					t.Errorf("OpenError: %v, want ErrUnavailable naming %v", oerr, errno)
				}
				if _, err := os.Lstat(path); !os.IsNotExist(err) {
					t.Errorf("Open made %s through a stat that failed with %v", path, errno)
				}
			})
		}
	}
}

// TestOpenWaitsBoundedForAHungPool: a stat that does not return leaves the
// pool unavailable after WithOpenWait, and Check and listings fail at once
// instead of queueing behind it; once the stat returns, the pool is laid out.
func TestOpenWaitsBoundedForAHungPool(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pool")
	release := make(chan struct{})
	stat := statPath
	t.Cleanup(func() { statPath = stat })
	statPath = func(name string) (os.FileInfo, error) {
		if name == path {
			<-release
		}
		return stat(name)
	}
	p, err := Open(Config{Name: "p", Path: path}, WithOpenWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if !p.OpenPending() {
		t.Fatal("OpenPending is false while the stat hangs")
	}
	if err := p.Check(); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Check while the pool hangs: %v, want ErrUnavailable", err)
	}
	if _, err := p.List(); !errors.Is(err, ErrUnavailable) {
		t.Errorf("List while the pool hangs: %v, want ErrUnavailable", err)
	}
	if p.VolumeExists(p.NewID("x")) {
		t.Error("VolumeExists while the pool hangs: true")
	}
	close(release)
	for p.OpenPending() {
		time.Sleep(time.Millisecond)
	}
	if err := p.Check(); err != nil {
		t.Fatalf("Check once the pool answers: %v", err)
	}
}
