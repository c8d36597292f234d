package pool

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/poolcsi/poolcsi/internal/fsx"
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

// The largest each kind of the pool's small files ever is. A larger one is not
// poolcsi's: it is damage (ErrCorrupt), and never read past its cap, so a
// planted 100 MB file (or a link to /dev/zero, which is refused anyway) costs
// a driver or the CLI nothing.
const (
	maxPoolMeta     = 64 << 10
	maxVolumeMeta   = 1 << 20 // its stage and publish records grow with the nodes that share a volume
	maxSnapshotMeta = 64 << 10
	maxNodeRecord   = 64 << 10
	maxFreezeRecord = 16 << 10
	maxLockFile     = 4 << 10 // a holder record: "node <name>, pid <n>"
	maxMarker       = 4 << 10 // the publish index's empty markers
)

// files is the safe-file layer below a pool's root: every open, bounded read,
// atomic write, listing, lock file and trash move of the pool goes through it,
// so the rules above live in one type. It holds only what the checks need: the
// root the operator configured, the pool's name for errors and the node named
// in lock files.
type files struct {
	root, name, node string
	// await waits, a bounded time, for an open still pending on a pool
	// whose filesystem has not answered yet (Pool.awaitOpen).
	await func() error
}

// files is the pool's safe-file layer.
func (p *Pool) files() files {
	return files{root: p.cfg.Path, name: p.cfg.Name, node: p.node, await: p.awaitOpen}
}

// unsafe turns fsx's classification into the pool's: a file that is a link,
// of the wrong kind or too large is damage.
func unsafe(err error) error {
	if errors.Is(err, fsx.ErrUnsafe) && !errors.Is(err, ErrCorrupt) {
		return fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return err
}

// openBeneath opens rel (slash-separated, relative to the pool's root) without
// following any link and without leaving the pool. A missing one is
// ErrNotFound (a volume's image).
func (fl files) openBeneath(rel string, flags int) (*os.File, error) {
	f, err := fsx.OpenBeneath(fl.root, rel, flags, 0)
	if err != nil {
		return nil, notFound(fl.classify(err))
	}
	return f, nil
}

// classify gives an error of fsx a class: the pool's root that cannot be
// opened is an unavailable pool (whatever the cause, ENOENT included), a file
// that is a link, of the wrong kind or too large is damage.
func (fl files) classify(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) && pe.Path == fl.root && !errors.Is(err, ErrUnavailable) {
		return fmt.Errorf("%w: open pool %s at %s: %w", ErrUnavailable, fl.name, fl.root, pe.Err)
	}
	return unsafe(err)
}

// openKind opens rel as a handle and requires it to be a regular file (dir
// false) or a directory (dir true). A missing one is ErrNotFound.
func (fl files) openKind(rel string, dir bool) (*Handle, error) {
	f, err := fsx.OpenPath(fl.root, rel, dir)
	if err != nil {
		return nil, notFound(fl.classify(err))
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
	return p.files().openKind(volumeRel(id, imageFile), false)
}

// OpenData opens a dir volume's data directory.
func (p *Pool) OpenData(id VolumeID) (*Handle, error) {
	return p.files().openKind(volumeRel(id, dataDir), true)
}

// OpenImage opens an image snapshot's copy.
func (ss Snapshots) OpenImage(id SnapshotID) (*Handle, error) {
	return ss.p.files().openKind(snapshotRel(id, snapshotImage), false)
}

// OpenData opens a dir snapshot's copied tree.
func (ss Snapshots) OpenData(id SnapshotID) (*Handle, error) {
	return ss.p.files().openKind(snapshotRel(id, dataDir), true)
}

// readBeneath reads one of the pool's small files (at most max bytes) through
// the one reader of pool files (internal/fsx): no link followed, nothing but a
// regular file opened, never blocking on a FIFO, never more than max read.
func (fl files) readBeneath(rel string, max int64) ([]byte, error) {
	b, err := fsx.ReadFile(fl.root, rel, max)
	if err != nil {
		return nil, fl.classify(err)
	}
	return b, nil
}

// writeBeneath replaces one of the pool's small files atomically, through a
// descriptor of its directory opened below the pool's root without links.
func (fl files) writeBeneath(rel string, data []byte, durable bool) error {
	return unsafe(fsx.WriteFileAtomic(fl.root, rel, data, durable))
}

// readDir lists a directory of the pool, reached without links.
func (fl files) readDir(rel string) ([]os.DirEntry, error) {
	if fl.await != nil {
		if err := fl.await(); err != nil {
			return nil, err
		}
	}
	des, err := fsx.ReadDir(fl.root, rel)
	return des, unsafe(err)
}

// checkDir fails unless rel is a directory reached without any link: called
// before the pool creates, renames or removes anything inside rel, so that a
// link planted in its place never redirects a write or a delete out of the pool.
// A missing one is ErrNotFound (a volume's or snapshot's directory).
func (fl files) checkDir(rel string) error {
	if err := fsx.CheckDir(fl.root, rel); err != nil {
		return notFound(fl.classify(err))
	}
	return nil
}
