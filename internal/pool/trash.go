package pool

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// trashQueue is what a volume delete left in the pool's trash for the
// emptier to remove after the answer (ServeTrash, EmptyTrash). Removing a
// volume's blocks was about 40 % of a delete's time; once the volume is
// renamed into trash/ durably it is gone for every reader (no listing, no
// lookup, no capacity promise sees it), so the removal can follow the answer.
// A crash before it leaves the entry in trash/, which the emptier removes at
// the next start.
type trashQueue struct {
	// emptying is held while EmptyTrash removes entries, so Settle waits
	// for a removal under way.
	emptying sync.Mutex
	mu       sync.Mutex
	wake     func()   // nil: no emptier serves the pool; deletes empty it themselves
	pending  []string // trash entries this process's deletes queued
	// taken counts queued entries an EmptyTrash took and has not removed yet.
	taken int
}

// served reports whether an emptier serves the pool now.
func (q *trashQueue) served() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.wake != nil
}

// queue hands names to the emptier, or returns false when none serves the
// pool any more (the caller removes them itself).
func (q *trashQueue) queue(names []string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.wake == nil {
		return false
	}
	q.pending = append(q.pending, names...)
	q.wake()
	return true
}

// take returns the queued names and forgets them.
func (q *trashQueue) take() []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	names := q.pending
	q.pending = nil
	q.taken = len(names)
	return names
}

// busy reports whether entries this process's deletes queued are not removed
// yet (queued, or being removed).
func (q *trashQueue) busy() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.pending) > 0 || q.taken > 0
}

// removed records that the entries take returned are removed (or failed).
func (q *trashQueue) removed() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.taken = 0
}

// ServeTrash makes wake the emptier of the pool's trash: a volume delete
// (Delete without a step on its data) then answers once its directory is
// renamed into trash/ durably, queues the entry and calls wake, which must
// not block; the emptier then calls EmptyTrash. ServeTrash(nil) ends that:
// deletes remove their data themselves again, and the caller empties what
// was queued (EmptyTrash) once more.
func (p *Pool) ServeTrash(wake func()) {
	p.trash.mu.Lock()
	defer p.trash.mu.Unlock()
	p.trash.wake = wake
}

// EmptyTrash removes what deletes queued for it (ServeTrash) and, with all,
// every other entry of the trash whose lock no call holds (what a crash or a
// failed removal left, here or on another node; a call that holds the lock is
// removing that entry itself), then syncs the trash directory. Entries are
// reached through the trash directory's descriptor, never by a path a link
// could redirect.
func (p *Pool) EmptyTrash(all bool) error {
	p.trash.emptying.Lock()
	defer p.trash.emptying.Unlock()
	queued := p.trash.take()
	defer p.trash.removed()
	if len(queued) == 0 && (!all || p.OpenPending()) {
		// Nothing queued, or a pool whose filesystem has not answered yet
		// (nothing of it was deleted here): no pass that could hang on it.
		return nil
	}
	fl := p.files()
	trash, err := openTrashDir(fl)
	if err != nil || trash == nil {
		return err
	}
	defer trash.Close()
	dir := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), trash.Fd())
	var errs []error
	removed := false
	for _, name := range queued {
		// Queued by a delete of this process that passed every check: its
		// lock may still be held by that call's caller, on its way out.
		if err := removeTrashEntry(dir, name); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = true
	}
	// What this process's deletes queued is gone: a settle no longer waits
	// for this pass (a whole-trash pass may hang on a pool that stopped
	// answering; a capacity decision must not hang behind it).
	p.trash.removed()
	if all {
		des, err := trash.ReadDir(-1)
		if err != nil {
			errs = append(errs, fmt.Errorf("read directory %s: %w", filepath.Join(fl.root, trashDir), err))
		}
		for _, de := range des {
			if !de.IsDir() || slices.Contains(queued, de.Name()) || lockHeld(fl.root, filepath.Join(trashDir, de.Name(), lockFile)) {
				continue
			}
			if err := removeTrashEntry(dir, de.Name()); err != nil {
				errs = append(errs, err)
				continue
			}
			removed = true
		}
	}
	if removed {
		if err := trash.Sync(); err != nil {
			errs = append(errs, fmt.Errorf("sync %s: %w", filepath.Join(fl.root, trashDir), err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("empty the trash of pool %s: %w", p.cfg.Name, errors.Join(errs...))
	}
	return nil
}

// openTrashDir opens the pool's trash directory below the pool through no
// link, or returns nil when there is none.
func openTrashDir(fl files) (*os.File, error) {
	trash, err := fsx.OpenDir(fl.root, trashDir)
	if missing(err) {
		return nil, nil
	}
	if err != nil {
		return nil, unsafe(err)
	}
	return trash, nil
}

// removeTrashEntry removes the entry name of the trash directory dir (a
// /proc/<pid>/fd/N path of its descriptor). RemoveAll does not follow links:
// nothing outside the entry goes.
func removeTrashEntry(dir, name string) error {
	return os.RemoveAll(filepath.Join(dir, name))
}

// settleTrash removes what this process's deletes queued and waits for a
// removal under way, so the free space a capacity decision or figure reads
// holds the blocks of every volume this process answered deleted. Nothing
// queued (the emptier runs within milliseconds of a delete) costs a mutex.
// What it cannot remove stays for the emptier, which reports it.
func (p *Pool) settleTrash() {
	if !p.trash.busy() {
		return
	}
	_ = p.EmptyTrash(false)
}
