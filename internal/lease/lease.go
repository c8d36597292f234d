// Package lease decides, without trusting any clock but its own, whether a
// node's lease in a shared pool is live, and when a node must fence itself.
//
// A node renews its lease (pool.Lease) every Interval by rewriting its record
// with a new counter. Clocks of two nodes are never compared: a reader (a
// controller asked to take a volume away from the node) notes the record it
// sees and when it first saw it, by its own monotonic clock, and calls the
// lease expired only when the record has not changed for the holder's
// Duration plus a Margin. The holder, for its part, fences itself (its loop
// devices in the pool stop taking I/O) once Duration has passed on its own
// monotonic clock since the start of its last renewal that succeeded. Every
// renewal the reader can see was written after that start, so the holder's
// fence always comes at least Margin before any reader's expiry, whatever
// the two clocks read (sanlock's delta leases rest on the same argument).
package lease

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// Timing is a lease's schedule.
type Timing struct {
	// Duration is how long after the start of its last successful renewal a
	// holder fences itself, and how long a reader waits, plus Margin, on a
	// record that does not change.
	Duration time.Duration
	// Interval is how often the holder renews.
	Interval time.Duration
	// Margin is the reader's slack beyond Duration: the time a fence takes
	// to act, scheduling delays, the drift of two monotonic clocks.
	Margin time.Duration
}

// Default is the schedule when none is given: it fits NFSv4's default lease
// (90 s, after which the server drops a silent client's state) and leaves a
// node that misses renewals 12 chances first; docs/fencing.md gives the
// timeline.
var Default = Timing{Duration: 60 * time.Second, Interval: 5 * time.Second, Margin: 30 * time.Second}

// Validate checks that a holder renews often enough to survive a few failed
// renewals, and that the reader's margin covers at least one.
func (t Timing) Validate() error {
	switch {
	case t.Interval <= 0 || t.Duration <= 0 || t.Margin <= 0:
		return errors.New("lease duration, renewal interval and margin must be positive")
	case t.Interval*3 > t.Duration:
		return fmt.Errorf("lease duration %s must be at least three renewal intervals (%s)", t.Duration, t.Interval)
	case t.Margin < t.Interval:
		return fmt.Errorf("lease margin %s must be at least one renewal interval (%s)", t.Margin, t.Interval)
	}
	return nil
}

// Expiry is how long a reader must see a record unchanged: the longer of
// the holder's duration and the reader's own, plus the margin.
func (t Timing) Expiry(holder pool.Lease) time.Duration {
	d := t.Duration
	if h := time.Duration(holder.DurationSeconds) * time.Second; h > d {
		d = h
	}
	return d + t.Margin
}

// MustFence tells a holder whose last successful renewal started at
// lastRenewal whether it must fence itself now.
func (t Timing) MustFence(lastRenewal, now time.Time) bool {
	return now.Sub(lastRenewal) >= t.Duration
}

// Verdict is a reader's view of one node's lease.
type Verdict struct {
	// Expired: the holder cannot be writing any more (it released the lease,
	// or its record has not changed for Expiry).
	Expired bool
	// Wait is how much longer the record must stay unchanged (0 when
	// expired).
	Wait time.Duration
	// Why says what the verdict rests on, for messages.
	Why string
}

// Observer remembers, per pool and node, the record it last saw and when it
// first saw it, by this process's monotonic clock. A new Observer (a
// restarted controller) starts its waits anew: slower, never less safe.
type Observer struct {
	mu   sync.Mutex
	seen map[key]seen
	// now is time.Now; tests replace it.
	now func() time.Time
}

type key struct{ pool, node string }

type seen struct {
	rec     pool.Lease
	present bool
	since   time.Time
}

// NewObserver returns an empty Observer on the process's monotonic clock.
func NewObserver() *Observer { return NewObserverClock(time.Now) }

// NewObserverClock is NewObserver on the clock now (monotonic readings).
func NewObserverClock(now func() time.Time) *Observer {
	return &Observer{seen: map[key]seen{}, now: now}
}

// Observe records what was read of node's lease in poolName (present false:
// no record at all) and gives the verdict.
func (o *Observer) Observe(poolName, node string, rec pool.Lease, present bool, t Timing) Verdict {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.now()
	k := key{poolName, node}
	s, ok := o.seen[k]
	if !ok || s.present != present || s.rec.Instance != rec.Instance || s.rec.Counter != rec.Counter || s.rec.Released != rec.Released {
		s = seen{rec: rec, present: present, since: now}
		o.seen[k] = s
	}
	if present && rec.Released {
		return Verdict{Expired: true, Why: fmt.Sprintf("node %s released its lease in pool %s", node, poolName)}
	}
	need := t.Expiry(rec)
	held := now.Sub(s.since)
	what := fmt.Sprintf("its lease record (renewal %d of instance %s)", rec.Counter, rec.Instance)
	if !present {
		what = "no lease record"
	}
	if held >= need {
		return Verdict{Expired: true, Why: fmt.Sprintf("node %s has shown %s in pool %s unchanged for %s, more than its lease of %s", node, what, poolName, held.Round(time.Second), need)}
	}
	return Verdict{Wait: need - held, Why: fmt.Sprintf("node %s has shown %s in pool %s unchanged for %s of the %s (lease duration plus margin, by this controller's clock) after which it cannot be writing", node, what, poolName, held.Round(time.Second), need)}
}
