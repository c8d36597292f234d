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

// TestHungPoolWaitsOnlyOnceMore: the callers of a pool whose open is still
// pending wait for it only until the open's wait has passed once more since
// Open returned; later callers get ErrUnavailable at once. Before, each
// caller waited the whole wait again: every start-up pass waited once per
// hung pool, and every Probe of a pool hung for hours waited.
func TestHungPoolWaitsOnlyOnceMore(t *testing.T) {
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
		close(release)
		t.Fatal(err)
	}
	// The layout goes on once the stat returns; the temp dir goes after it.
	t.Cleanup(func() { close(release); <-p.Opened() })
	// The window after Open is over, and a wait would now be an hour.
	p.openWait = time.Hour
	p.awaitUntil = time.Now().Add(-time.Second)
	done := make(chan error, 1)
	go func() { done <- p.Check() }()
	select {
	case err := <-done:
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("Check of a pool hung since long before: %v, want ErrUnavailable", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Check waited again for a pool whose open has been pending past its window")
	}
}
