// Package fsx reads and writes the files of a directory tree that someone else
// may have written: a pool on a shared filesystem, where anyone on any node can
// put a link, a FIFO, a device node or a 100 MB file where poolcsi expects a
// few hundred bytes of JSON.
//
// Every path is resolved below a root with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS): no link is ever followed and
// nothing outside the root is reached (only the root itself, which the operator
// chose, may be reached through links). A file is first opened O_PATH, which has
// no side effect whatever the file is, and checked to be a regular file; only
// then is it opened for reading or writing, through the O_PATH descriptor
// (/proc/self/fd/N), so the file checked is the file read. Opening a FIFO would
// block until a writer comes, and opening a device node can act (a tape
// rewinds, a watchdog arms): neither ever happens here. Reads are capped, so a
// huge file costs at most the cap.
package fsx

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ErrUnsafe marks a file that is not what it must be: reached through a link or
// from outside the root, of the wrong kind (a FIFO, a device, a directory where
// a file belongs), or larger than a file of its kind ever is. Callers classify
// it as damage.
var ErrUnsafe = errors.New("unsafe file")

// resolve is how every path below a root is looked up.
const resolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// openRoot opens the root directory itself, following links: the operator
// configured it.
func openRoot(root string) (int, error) {
	fd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &os.PathError{Op: "open", Path: root, Err: err}
	}
	return fd, nil
}

// openat2 opens rel below the directory dirfd, which is root.
func openat2(dirfd int, root, rel string, flags int, mode uint32) (*os.File, error) {
	name := filepath.Join(root, rel)
	if flags&unix.O_PATH == 0 {
		flags |= unix.O_NOCTTY // O_PATH takes no other flags
	}
	fd, err := unix.Openat2(dirfd, rel, &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: resolve})
	switch {
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV):
		return nil, fmt.Errorf("%w: %s is reached through a symbolic link, or leaves %s: links are never followed there; remove the link",
			ErrUnsafe, name, root)
	case err != nil:
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	return os.NewFile(uintptr(fd), name), nil
}

// OpenBeneath opens rel (slash-separated, relative to root) with flags, without
// following any link and without leaving root. It does not check what kind of
// file it opens: with flags that may block or act on a special file, use
// OpenRegular or OpenDir instead.
func OpenBeneath(root, rel string, flags int, mode uint32) (*os.File, error) {
	rfd, err := openRoot(root)
	if err != nil {
		return nil, err
	}
	defer unix.Close(rfd)
	return openat2(rfd, root, rel, flags, mode)
}

// OpenDir opens the directory rel below root for reading its entries.
// O_DIRECTORY makes the kernel refuse anything else before opening it.
func OpenDir(root, rel string) (*os.File, error) {
	f, err := OpenBeneath(root, rel, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK, 0)
	if errors.Is(err, unix.ENOTDIR) {
		return nil, fmt.Errorf("%w: %s is not a directory: remove what is there", ErrUnsafe, filepath.Join(root, rel))
	}
	return f, err
}

// ReadDir lists the directory rel below root.
func ReadDir(root, rel string) ([]os.DirEntry, error) {
	d, err := OpenDir(root, rel)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	des, err := d.ReadDir(-1)
	if err != nil {
		return nil, fmt.Errorf("read directory %s: %w", d.Name(), err)
	}
	return des, nil
}

// CheckDir fails unless rel is a directory below root reached without a link.
func CheckDir(root, rel string) error {
	f, err := OpenBeneath(root, rel, unix.O_PATH|unix.O_DIRECTORY, 0)
	if errors.Is(err, unix.ENOTDIR) {
		return fmt.Errorf("%w: %s is not a directory: remove what is there", ErrUnsafe, filepath.Join(root, rel))
	}
	if err != nil {
		return err
	}
	return f.Close()
}

// OpenPath opens rel below root as an O_PATH handle (no side effect, whatever
// it is) and requires a regular file (dir false) or a directory (dir true).
func OpenPath(root, rel string, dir bool) (*os.File, error) {
	f, err := OpenBeneath(root, rel, unix.O_PATH, 0)
	if err != nil {
		return nil, err
	}
	if err := checkKind(f, dir); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func checkKind(f *os.File, dir bool) error {
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	if dir && fi.IsDir() || !dir && fi.Mode().IsRegular() {
		return nil
	}
	want := "a regular file"
	if dir {
		want = "a directory"
	}
	return fmt.Errorf("%w: %s is not %s but %s: remove it (and restore the file from a backup if it held data)",
		ErrUnsafe, f.Name(), want, kind(fi.Mode()))
}

func kind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a FIFO"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	}
	return "a special file"
}

// CheckFile tells whether rel below root is a regular file of at most max
// bytes, reached without a link, without opening it for I/O: what an operator
// tool reports as damage. A missing file wraps fs.ErrNotExist.
func CheckFile(root, rel string, max int64) error {
	h, err := OpenPath(root, rel, false)
	if err != nil {
		return err
	}
	defer h.Close()
	fi, err := h.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", h.Name(), err)
	}
	if fi.Size() > max {
		return tooLarge(h.Name(), fi.Size(), max)
	}
	return nil
}

// Reopen opens the file an O_PATH handle names, with flags: the same inode,
// whatever has been renamed or replaced since.
func Reopen(h *os.File, flags int) (*os.File, error) {
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(int(h.Fd())), flags|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, &os.PathError{Op: "reopen", Path: h.Name(), Err: err}
	}
	return os.NewFile(uintptr(fd), h.Name()), nil
}

// OpenRegular opens the regular file rel below root with flags (O_RDONLY or
// O_RDWR, and O_CREAT to create it if missing, O_EXCL to insist on that);
// anything else there is ErrUnsafe, and is never opened for I/O.
func OpenRegular(root, rel string, flags int, mode uint32) (*os.File, error) {
	rfd, err := openRoot(root)
	if err != nil {
		return nil, err
	}
	defer unix.Close(rfd)
	create := flags&unix.O_CREAT != 0
	for attempt := 0; ; attempt++ {
		if !create || flags&unix.O_EXCL == 0 {
			h, err := openat2(rfd, root, rel, unix.O_PATH, 0)
			if err == nil {
				defer h.Close()
				if err := checkKind(h, false); err != nil {
					return nil, err
				}
				return Reopen(h, flags&^(unix.O_CREAT|unix.O_EXCL)|unix.O_NONBLOCK)
			}
			if !create || !errors.Is(err, fs.ErrNotExist) {
				return nil, err
			}
		}
		// A new file is a regular file by construction; O_EXCL makes sure it
		// is new (a FIFO made between the look and the create fails it).
		f, err := openat2(rfd, root, rel, flags|unix.O_CREAT|unix.O_EXCL, mode)
		if errors.Is(err, fs.ErrExist) && flags&unix.O_EXCL == 0 && attempt < 3 {
			continue // made by someone else meanwhile: open what is there
		}
		return f, err
	}
}

// ReadFile reads the regular file rel below root, at most max bytes: a larger
// file is ErrUnsafe, read no further than max+1 bytes.
func ReadFile(root, rel string, max int64) ([]byte, error) {
	t, err := OpenTree(root)
	if err != nil {
		return nil, err
	}
	defer t.Close()
	return t.ReadFile(rel, max)
}

// ReadFileAt is ReadFile for a path outside any tree (a node-local record, a
// configuration file): the path's last component must not be a link, and the
// file must be a regular one of at most max bytes.
func ReadFileAt(path string, max int64) ([]byte, error) {
	return ReadFile(filepath.Dir(path), filepath.Base(path), max)
}

// ReadFileFollow reads a file an operator named (a configuration file, which a
// Kubernetes ConfigMap mounts through links): links are followed, but the file
// must be a regular one of at most max bytes, opened without blocking.
func ReadFileFollow(path string, max int64) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	h := os.NewFile(uintptr(fd), path)
	defer h.Close()
	if err := checkKind(h, false); err != nil {
		return nil, err
	}
	f, err := Reopen(h, unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return readCapped(f, max)
}

func readCapped(f *os.File, max int64) ([]byte, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	if fi.Size() > max {
		return nil, tooLarge(f.Name(), fi.Size(), max)
	}
	buf, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", f.Name(), err)
	}
	if int64(len(buf)) > max { // it grew since the stat
		return nil, tooLarge(f.Name(), int64(len(buf)), max)
	}
	return buf, nil
}

func tooLarge(name string, size, max int64) error {
	return fmt.Errorf("%w: %s is %d bytes or more, and a file of its kind is never over %d: it is not poolcsi's; move it away (pool check lists it)",
		ErrUnsafe, name, size, max)
}

// WriteFileAtomic replaces rel below root with data: a new temp file in the
// same directory, fsync, rename over rel, and with durable an fsync of the
// directory, which makes the rename survive a crash. The directory is opened
// once, below root without links, and everything happens relative to it, so
// a link swapped in meanwhile redirects nothing. Temp files an earlier crash
// left there (older than StaleTemp) are removed first.
func WriteFileAtomic(root, rel string, data []byte, durable bool) error {
	return writeFileAtomic(root, rel, data, true, durable, false)
}

// CreateFileAtomic is WriteFileAtomic for a file that must not be replaced:
// the temp file is linked to rel (link(2) fails where rel exists, on NFS as
// well, where a rename without replacement is not supported), so of two
// writers at once one creates it and the other gets an error wrapping
// fs.ErrExist.
func CreateFileAtomic(root, rel string, data []byte, durable bool) error {
	return writeFileAtomic(root, rel, data, true, durable, true)
}

// WriteDerivedFile is WriteFileAtomic without any fsync, for a file derived
// from records that stay the truth, whose reader verifies it (a checksum, and
// stamps of the directories it was derived from) and rebuilds it from the
// records when it does not verify. A crash may leave the old content, the new
// content, or an empty or zero-filled file: the old content is the state before
// (or no longer matches the stamps), and the others fail the checksum. Never
// for a record: a record's content must survive the rename that publishes it.
func WriteDerivedFile(root, rel string, data []byte) error {
	return writeFileAtomic(root, rel, data, false, false, false)
}

func writeFileAtomic(root, rel string, data []byte, syncFile, syncDir, exclusive bool) error {
	dir, base := filepath.Split(rel)
	d, err := OpenDir(root, filepath.Clean("./"+dir))
	if err != nil {
		return fmt.Errorf("write %s: %w", filepath.Join(root, rel), err)
	}
	defer d.Close()
	dfd := int(d.Fd())
	name := filepath.Join(root, rel)
	sweepTemps(d, base)
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	tmp := "." + base + ".tmp-" + hex.EncodeToString(rnd[:])
	fd, err := unix.Openat(dfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return &os.PathError{Op: "create", Path: filepath.Join(d.Name(), tmp), Err: err}
	}
	f := os.NewFile(uintptr(fd), filepath.Join(d.Name(), tmp))
	defer func() { _ = unix.Unlinkat(dfd, tmp, 0) }() // a no-op after the rename; after a link, the temp name goes
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", f.Name(), err)
	}
	if syncFile {
		if err := f.Sync(); err != nil {
			f.Close()
			return fmt.Errorf("fsync %s: %w", f.Name(), err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", f.Name(), err)
	}
	if exclusive {
		if err := unix.Linkat(dfd, tmp, dfd, base, 0); err != nil {
			return &os.PathError{Op: "link", Path: name, Err: err}
		}
	} else if err := unix.Renameat(dfd, tmp, dfd, base); err != nil {
		return &os.PathError{Op: "rename", Path: name, Err: err}
	}
	if !syncDir {
		return nil
	}
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", d.Name(), err)
	}
	return nil
}

// StaleTemp is how old a temp file of WriteFileAtomic must be before a writer
// removes it as a crash's leftover: far longer than any write takes, so a
// concurrent writer on another node never loses its temp file.
const StaleTemp = 10 * time.Minute

// IsTemp tells whether a directory entry is a temp file of WriteFileAtomic.
func IsTemp(name string) bool {
	return strings.HasPrefix(name, ".") && strings.Contains(name, ".tmp-")
}

func sweepTemps(d *os.File, base string) {
	names, err := d.Readdirnames(-1)
	if _, serr := d.Seek(0, io.SeekStart); err != nil || serr != nil {
		return
	}
	prefix := "." + base + ".tmp-"
	dfd := int(d.Fd())
	for _, n := range names {
		if !strings.HasPrefix(n, prefix) {
			continue
		}
		var st unix.Stat_t
		if unix.Fstatat(dfd, n, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			continue
		}
		if time.Since(time.Unix(st.Mtim.Unix())) > StaleTemp {
			_ = unix.Unlinkat(dfd, n, 0) // best effort; pool check reports what stays
		}
	}
}

// WriteFilePath replaces path with data: temp file, fsync, rename, and with
// durable an fsync of the directory, which makes the rename survive a crash.
// For files outside a pool (a node's own records), whose directory the
// caller trusts; a pool's files are written by WriteFileAtomic, below the
// pool's root.
func WriteFilePath(path string, data []byte, durable bool) error {
	return WriteFileAtomic(filepath.Dir(path), filepath.Base(path), data, durable)
}

// Tree is a root opened once for many reads below it (a page of a listing, a
// whole-pool measurement): the same resolution and checks as ReadFile and
// OpenPath, without opening the root again for every file. A Tree is used by
// one goroutine and closed when that batch is done; it is never kept, so a
// pool remounted meanwhile is seen by the next batch.
type Tree struct {
	fd   int
	root string
}

// OpenTree opens root (following links: the operator chose it) for reads below it.
func OpenTree(root string) (*Tree, error) {
	fd, err := openRoot(root)
	if err != nil {
		return nil, err
	}
	return &Tree{fd: fd, root: root}, nil
}

// Close releases the root's descriptor (an O_PATH one: nothing to flush).
func (t *Tree) Close() { _ = unix.Close(t.fd) }

// pathFD opens rel O_PATH below the tree (no side effect whatever it is) and
// returns the descriptor and what fstat says of it.
func (t *Tree) pathFD(rel string, dir bool) (int, unix.Stat_t, error) {
	var st unix.Stat_t
	fd, err := unix.Openat2(t.fd, rel, &unix.OpenHow{Flags: uint64(unix.O_PATH | unix.O_CLOEXEC), Resolve: resolve})
	if err != nil {
		name := filepath.Join(t.root, rel)
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV) {
			return -1, st, fmt.Errorf("%w: %s is reached through a symbolic link, or leaves %s: links are never followed there; remove the link",
				ErrUnsafe, name, t.root)
		}
		return -1, st, &os.PathError{Op: "open", Path: name, Err: err}
	}
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, st, fmt.Errorf("stat %s: %w", filepath.Join(t.root, rel), err)
	}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if dir && isDir || !dir && st.Mode&unix.S_IFMT == unix.S_IFREG {
		return fd, st, nil
	}
	unix.Close(fd)
	want := "a regular file"
	if dir {
		want = "a directory"
	}
	return -1, st, fmt.Errorf("%w: %s is not %s but %s: remove it (and restore the file from a backup if it held data)",
		ErrUnsafe, filepath.Join(t.root, rel), want, kind(fileMode(st.Mode)))
}

// fileMode is the fs.FileMode type bits of a stat mode, for kind.
func fileMode(m uint32) fs.FileMode {
	switch m & unix.S_IFMT {
	case unix.S_IFDIR:
		return fs.ModeDir
	case unix.S_IFIFO:
		return fs.ModeNamedPipe
	case unix.S_IFSOCK:
		return fs.ModeSocket
	case unix.S_IFCHR:
		return fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFBLK:
		return fs.ModeDevice
	case unix.S_IFLNK:
		return fs.ModeSymlink
	case unix.S_IFREG:
		return 0
	}
	return fs.ModeIrregular
}

// Stat is what fstat says of rel below the tree, which must be a regular file
// (dir false) or a directory (dir true), reached without a link; it is never
// opened for I/O.
func (t *Tree) Stat(rel string, dir bool) (unix.Stat_t, error) {
	fd, st, err := t.pathFD(rel, dir)
	if err != nil {
		return st, err
	}
	unix.Close(fd)
	return st, nil
}

// ReadFile is ReadFile below the tree: a regular file of at most max bytes,
// reached without a link, opened for reading only through its checked O_PATH
// descriptor, without blocking.
func (t *Tree) ReadFile(rel string, max int64) ([]byte, error) {
	h, st, err := t.pathFD(rel, false)
	if err != nil {
		return nil, err
	}
	name := filepath.Join(t.root, rel)
	if st.Size > max {
		unix.Close(h)
		return nil, tooLarge(name, st.Size, max)
	}
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(h), unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	unix.Close(h)
	if err != nil {
		return nil, &os.PathError{Op: "reopen", Path: name, Err: err}
	}
	defer unix.Close(fd)
	// One read fills a buffer of the stat's size, one more sees the end: a
	// file that grew since the stat is read on, up to the cap.
	buf := make([]byte, 0, st.Size+1)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := unix.Read(fd, buf[len(buf):min(cap(buf), int(max)+1)])
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", name, err)
		}
		if n == 0 {
			break
		}
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > max { // it grew since the stat
			return nil, tooLarge(name, int64(len(buf)), max)
		}
	}
	return buf, nil
}
