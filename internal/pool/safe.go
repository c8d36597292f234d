package pool

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// A pool's contents are untrusted input: on a shared pool anyone who can write
// the pool's directory, on any node, may have put a symbolic link where the
// driver expects a volume's image or data. Everything inside the pool is
// therefore reached with openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS) from the
// pool's root, and used through the file descriptor that resolution returned:
// nothing outside the pool is ever formatted, attached, mounted, copied or
// deleted, and a link is damage (ErrCorrupt), reported, never followed. Only
// the pool's root itself, which the operator configured, may be a link.

// Handle is a file or directory of the pool, opened without following any
// link. Path names it for this process and its children (/proc/<pid>/fd/<n>),
// so tools such as mkfs, losetup or cp act on exactly what was opened, for as
// long as the handle is open.
type Handle struct{ f *os.File }

// Path is the /proc path of the open file.
func (h *Handle) Path() string { return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), h.f.Fd()) }

// Close releases the handle; Path is invalid afterwards.
func (h *Handle) Close() error { return h.f.Close() }

// openBeneath opens rel (slash-separated, relative to the pool's root) without
// following any link and without leaving the pool.
func (p *Pool) openBeneath(rel string, flags int) (*os.File, error) {
	root, err := unix.Open(p.Path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: open pool %s at %s: %v", ErrUnavailable, p.Name, p.Path, err) //nolint:errorlint // unavailable, not missing
	}
	defer unix.Close(root)
	if flags&unix.O_PATH == 0 {
		flags |= unix.O_NOCTTY // O_PATH takes no other flags
	}
	fd, err := unix.Openat2(root, rel, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	switch {
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV):
		return nil, fmt.Errorf("%w: %s in pool %s is reached through a symbolic link (or leaves the pool); poolcsi never follows links inside a pool: remove the link", ErrCorrupt, filepath.Join(p.Path, rel), p.Name)
	case err != nil:
		return nil, &os.PathError{Op: "open", Path: filepath.Join(p.Path, rel), Err: err}
	}
	return os.NewFile(uintptr(fd), filepath.Join(p.Path, rel)), nil
}

// openKind opens rel as a handle and requires it to be a regular file (dir
// false) or a directory (dir true).
func (p *Pool) openKind(rel string, dir bool) (*Handle, error) {
	f, err := p.openBeneath(rel, unix.O_PATH)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	if (dir && !fi.IsDir()) || (!dir && !fi.Mode().IsRegular()) {
		f.Close()
		want := "a regular file"
		if dir {
			want = "a directory"
		}
		return nil, fmt.Errorf("%w: %s is not %s (%s)", ErrCorrupt, f.Name(), want, fi.Mode().Type())
	}
	return &Handle{f: f}, nil
}

func volumeRel(id VolumeID, name ...string) string {
	return filepath.Join(append([]string{volumesDir, id.Key}, name...)...)
}

func snapshotRel(id SnapshotID, name ...string) string {
	return filepath.Join(append([]string{snapshotsDir, id.Key}, name...)...)
}

// OpenImage opens a volume's image file.
func (p *Pool) OpenImage(id VolumeID) (*Handle, error) {
	return p.openKind(volumeRel(id, imageFile), false)
}

// OpenData opens a dir volume's data directory.
func (p *Pool) OpenData(id VolumeID) (*Handle, error) {
	return p.openKind(volumeRel(id, dataDir), true)
}

// OpenSnapshotImage opens an image snapshot's copy.
func (p *Pool) OpenSnapshotImage(id SnapshotID) (*Handle, error) {
	return p.openKind(snapshotRel(id, snapshotImage), false)
}

// OpenSnapshotData opens a dir snapshot's copied tree.
func (p *Pool) OpenSnapshotData(id SnapshotID) (*Handle, error) {
	return p.openKind(snapshotRel(id, dataDir), true)
}

// readBeneath reads a small file of the pool without following links.
func (p *Pool) readBeneath(rel string) ([]byte, error) {
	f, err := p.openBeneath(rel, unix.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrCorrupt, f.Name())
	}
	const limit = 1 << 20 // metadata is a few hundred bytes; a huge file is damage
	if fi.Size() > limit {
		return nil, fmt.Errorf("%w: %s is %d bytes, more than metadata ever is", ErrCorrupt, f.Name(), fi.Size())
	}
	buf := make([]byte, fi.Size())
	n, err := f.ReadAt(buf, 0)
	if err != nil && n != len(buf) {
		return nil, fmt.Errorf("read %s: %w", f.Name(), err)
	}
	return buf[:n], nil
}

// checkDir fails unless rel is a directory reached without any link: called
// before the pool creates, renames or removes anything inside rel, so that a
// link planted in its place never redirects a write or a delete out of the pool.
func (p *Pool) checkDir(rel string) error {
	h, err := p.openKind(rel, true)
	if err != nil {
		return err
	}
	return h.Close()
}
