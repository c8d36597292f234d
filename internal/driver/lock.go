package driver

import (
	"sync"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// volumeLocks serialises calls on one volume inside this process. A call that finds
// its volume busy fails at once with ABORTED — the sidecars and kubelet retry — so a
// slow mkfs on one volume never holds up calls on any other, nor Probe.
type volumeLocks struct {
	mu   sync.Mutex
	busy map[string]holder // volume ID -> the call holding it
}

func newVolumeLocks() *volumeLocks { return &volumeLocks{busy: map[string]holder{}} }

// acquire takes the lock of id for h, or returns pool.ErrBusy (ABORTED) naming the
// call that holds it. Which call takes which lock is request.go's table.
func (l *volumeLocks) acquire(id string, h holder) (release func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if holder, ok := l.busy[id]; ok {
		return nil, csierr.Failf(pool.ErrBusy, "volume %s is busy with %s; retry later", id, holder)
	}
	l.busy[id] = h
	return func() {
		l.mu.Lock()
		delete(l.busy, id)
		l.mu.Unlock()
	}, nil
}

// lockFor is the in-process lock on a volume (or an inline volume's handle)
// that the packages doing the driver's other jobs take through their Deps:
// the fence's passes over the node's records, the freeze agent and the thaw
// after a crash, the inline volumes. Each names itself by one of the holders
// of request.go's table (holdDropStaleRecords, holdFreeze, holdSweep, ...).
func (d *core) lockFor(volume, h string) (func(), error) {
	return d.locks.acquire(volume, holder(h))
}
