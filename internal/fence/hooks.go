package fence

import (
	"time"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// The driver's tests drive the keeper through these: a clock of their own, a
// pool that fails or hangs, a renewal that raced a fence.

// SetClock replaces the keeper's clock; only differences of its readings
// matter.
func (k *Keeper) SetClock(now func() time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.now = now
}

// SetRenewal replaces how the keeper writes its lease records and repairs a
// damaged one; a nil func keeps the current one.
func (k *Keeper) SetRenewal(write func(p *pool.Pool, l pool.Lease) error, repair func(p *pool.Pool, node string) error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if write != nil {
		k.write = write
	}
	if repair != nil {
		k.repair = repair
	}
}

// SetLastRenewal makes the last successful renewal in pool name have started
// at at.
func (k *Keeper) SetLastRenewal(name string, at time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.state(name).last = at
}
