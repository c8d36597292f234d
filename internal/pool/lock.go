package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// LockPool takes the pool-wide lock that serialises capacity decisions (create,
// expand, delete) across every process and node that shares the pool. It is a lock
// file, not a mutex: on a shared filesystem the other holder is another machine.
func (p *Pool) LockPool(ctx context.Context) (unlock func(), err error) {
	return p.files().lockFileAt(ctx, poolLock, true)
}

// lockToCreate is the preamble of every call that makes a record under the
// pool lock (a volume, a snapshot, a group): the pool is checked first, so an
// unmounted shared pool never grows a tree (or a lock file) on the root disk,
// then the pool lock is taken.
func (p *Pool) lockToCreate(ctx context.Context) (unlock func(), err error) {
	if err := p.Check(); err != nil {
		return nil, err
	}
	return p.LockPool(ctx)
}

// LockVolume takes the lock of one volume's metadata. It fails with
// ErrNotFound when the volume does not exist (or is deleted while waiting), so
// no caller ever acts on a volume that vanished under it.
func (p *Pool) LockVolume(ctx context.Context, id VolumeID) (unlock func(), err error) {
	return p.files().lockFileAt(ctx, volumeRel(id, lockFile), false)
}

// lockPatience bounds the wait for a lock when the call has no deadline of its
// own: on a shared filesystem a lock held by a dead node stays held until the
// server evicts that client (minutes), and no call may hang that long.
const lockPatience = 30 * time.Second

// lockFileAt takes the lock file rel of the pool (opened below the pool's root,
// never through a link, and only if it is a regular file).
func (fl files) lockFileAt(ctx context.Context, rel string, create bool) (func(), error) {
	path := filepath.Join(fl.root, rel)
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, lockPatience, ErrBusy)
		defer cancel()
	}
	flags := os.O_RDWR
	if create {
		flags |= os.O_CREATE
	}
	for {
		f, err := openLock(ctx, fl.root, rel, flags)
		if err != nil {
			err = fl.classify(err)
			if ctx.Err() != nil {
				if errors.Is(context.Cause(ctx), ErrBusy) {
					err = fmt.Errorf("%w: waited %s: %w", ErrBusy, lockPatience, err)
				}
				return nil, fmt.Errorf("lock %s (last taken by %s): %w", path, lastHolder(path), err)
			}
			if !create {
				err = notFound(err) // the volume's lock file: the volume is not there
			}
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if err := fsx.FlockContext(ctx, f); err != nil {
			holder := readHolder(f)
			f.Close()
			if errors.Is(context.Cause(ctx), ErrBusy) {
				err = fmt.Errorf("%w: waited %s", ErrBusy, lockPatience)
			}
			return nil, fmt.Errorf("lock %s (last taken by %s): %w", path, holder, err)
		}
		// The file may have been removed (volume deleted) between open and lock:
		// then the lock we hold guards nothing, and we look again.
		var held, now unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &held); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if err := unix.Stat(path, &now); err != nil || now.Ino != held.Ino || now.Dev != held.Dev {
			f.Close()
			if err != nil && errors.Is(err, unix.ENOENT) && !create {
				return nil, fmt.Errorf("lock %s: %w: %w", path, ErrNotFound, err)
			}
			continue
		}
		fl.writeHolder(f)
		return func() { f.Close() }, nil // closing releases the flock
	}
}

// An open of a lock file on a shared filesystem can block in the kernel, where
// no context reaches it: on CephFS, while another client holds the file's
// capabilities and does not answer the MDS's recall, which is what a node
// that died looks like until the MDS gives up on it (a minute) or evicts it.
// openLock gives up when the call's context ends, and answers a retryable
// error; the blocked open goes on in the background, closes the file if it
// ever returns, and is shared by every later call for the same file until
// then, so stuck opens never pile up (one thread per lock file at most).
type pendingOpen struct {
	mu        sync.Mutex
	done      chan struct{}
	f         *os.File
	err       error
	abandoned bool
	since     time.Time
}

var pendingOpens sync.Map // lock file path -> *pendingOpen

// errStuckOpen says what a call that gave up waiting for a lock file's open
// was waiting for.
type errStuckOpen struct {
	since time.Time
	cause error
}

func (e errStuckOpen) Error() string {
	return fmt.Sprintf("the filesystem has not opened the lock file for %s: another client holds it and does not answer "+
		"(on a shared pool, a node that died: its locks are held until the server evicts it; see docs/pools.md): %v",
		time.Since(e.since).Round(time.Millisecond), e.cause)
}

func (e errStuckOpen) Unwrap() error { return e.cause }

func openLock(ctx context.Context, root, rel string, flags int) (*os.File, error) {
	path := filepath.Join(root, rel)
	for {
		po := &pendingOpen{done: make(chan struct{}), since: time.Now()}
		if cur, loaded := pendingOpens.LoadOrStore(path, po); loaded {
			cur := cur.(*pendingOpen)
			select {
			case <-cur.done: // its file went to its caller, or was closed: open anew
				continue
			case <-ctx.Done():
				return nil, errStuckOpen{since: cur.since, cause: context.Cause(ctx)}
			}
		}
		go func() {
			f, err := fsx.OpenRegular(root, rel, flags, 0o600)
			po.mu.Lock()
			if po.abandoned && f != nil {
				f.Close()
				f = nil
			}
			po.f, po.err = f, err
			po.mu.Unlock()
			pendingOpens.CompareAndDelete(path, po)
			close(po.done)
		}()
		select {
		case <-po.done:
			return po.f, po.err
		case <-ctx.Done():
			po.mu.Lock()
			po.abandoned = true
			if po.f != nil { // it returned just now
				po.f.Close()
				po.f = nil
			}
			po.mu.Unlock()
			return nil, errStuckOpen{since: po.since, cause: context.Cause(ctx)}
		}
	}
}

// lastHolders remembers the last holder record read from each lock file, for
// the message of a call that cannot read the file itself (openLock).
var lastHolders sync.Map // path -> string

func lastHolder(path string) string {
	if h, ok := lastHolders.Load(path); ok {
		return h.(string) + " (as last read)"
	}
	return "an unknown holder"
}

// writeHolder records in a lock file just taken who holds it (node and
// process), so a caller that cannot get the lock can name the holder: on a
// shared pool it is another machine. It writes only when the record changes,
// so taking a lock again leaves the file alone. Best effort: the record is a
// message, not part of the lock.
func (fl files) writeHolder(f *os.File) {
	node := fl.node
	if node == "" {
		node, _ = os.Hostname()
	}
	rec := fmt.Sprintf("node %s, pid %d", node, os.Getpid())
	if readHolder(f) == rec {
		return
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(rec+"\n"), 0)
	}
}

// readHolder reads the holder record of a lock file, or says there is none.
func readHolder(f *os.File) string {
	buf := make([]byte, 256)
	n, _ := f.ReadAt(buf, 0)
	if n == 0 {
		return "an unknown holder"
	}
	rec := strings.TrimSpace(string(buf[:n]))
	lastHolders.Store(f.Name(), rec)
	return rec
}

// lockHeld reports whether some process, on this node or another, holds the
// lock file at path right now. It takes nothing: a lock it could take is
// released at once. A missing file is a lock nobody holds.
func lockHeld(root, rel string) bool {
	f, err := fsx.OpenRegular(root, rel, unix.O_RDONLY, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return errors.Is(err, unix.EWOULDBLOCK)
	}
	_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
	return false
}

// changing reports whether a create or delete is under way in the pool, on
// any node: both hold the pool lock from the first directory they make or
// rename to the last. What they are half way through (a volume directory with
// no volume.json yet, a .deleting- directory) is then not damage. On a shared
// filesystem another node's half-done step can be visible for seconds (on
// CephFS a metadata change from another client waits for the MDS's journal).
func (fl files) changing() bool { return lockHeld(fl.root, poolLock) }
