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
	"math"
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

// MaxDuration bounds a lease's duration and a reader's margin. A node refuses
// to start with a longer one, so no legitimate holder ever declares more: a
// record that does (written by anyone who can write the pool, or damaged) is
// read as declaring MaxDuration, which bounds how long one record can hold a
// dead node's volumes, while never waiting less than its holder could have
// meant. It is part of the record format: every node of a cluster must share
// it (docs/fencing.md, "Lease records are input").
const MaxDuration = 10 * time.Minute

// Validate checks that a holder renews often enough to survive a few failed
// renewals, that the reader's margin covers at least one, and that neither
// the duration nor the margin is over MaxDuration.
func (t Timing) Validate() error {
	switch {
	case t.Interval <= 0 || t.Duration <= 0 || t.Margin <= 0:
		return errors.New("lease duration, renewal interval and margin must be positive")
	case t.Duration > MaxDuration || t.Margin > MaxDuration:
		return fmt.Errorf("lease duration %s and margin %s must each be at most %s: a reader takes a longer duration in a lease record for damage", t.Duration, t.Margin, MaxDuration)
	case t.Interval*3 > t.Duration:
		return fmt.Errorf("lease duration %s must be at least three renewal intervals (%s)", t.Duration, t.Interval)
	case t.Margin < t.Interval:
		return fmt.Errorf("lease margin %s must be at least one renewal interval (%s)", t.Margin, t.Interval)
	}
	return nil
}

// Expiry is how long a reader must see a record unchanged: the longer of
// the holder's duration and the reader's own, plus the margin. The holder's
// duration is input (anyone who can write the pool can write it): one over
// MaxDuration counts as MaxDuration, zero or less as none, and a damaged
// record as MaxDuration, so that no value shortens the wait below what its
// holder could legitimately have meant, and none lengthens it past
// MaxDuration plus the margin. The arithmetic saturates: nothing wraps
// around to a short or negative wait.
func (t Timing) Expiry(holder pool.Lease) time.Duration {
	d := t.Duration
	if h := HolderDuration(holder); h > d {
		d = h
	}
	return addSat(d, t.Margin)
}

// HolderDuration is the duration a reader takes a record to declare: its
// durationSeconds clamped to (0, MaxDuration], MaxDuration for a damaged
// record, and 0 (none: the reader's own applies) for a value of zero or less.
func HolderDuration(holder pool.Lease) time.Duration {
	switch s := holder.DurationSeconds; {
	case holder.Damaged != "":
		return MaxDuration
	case s <= 0:
		return 0
	case s >= int64(MaxDuration/time.Second):
		return MaxDuration
	default:
		return time.Duration(s) * time.Second
	}
}

// addSat is a+b for non-negative durations, saturating at the largest one.
func addSat(a, b time.Duration) time.Duration {
	if a < 0 {
		a = 0
	}
	if b < 0 {
		b = 0
	}
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
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
// no record at all) and gives the verdict. staged says that the node still
// holds a read-write stage record of the volume being taken: a released
// lease is then no proof that it stopped writing (a node releases only when
// it holds no device in the pool, so its own release never comes with such a
// record; anyone who can write the pool can write "released"), and the
// record is waited for like any other.
func (o *Observer) Observe(poolName, node string, rec pool.Lease, present bool, t Timing, staged bool) Verdict {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.now()
	k := key{poolName, node}
	s, ok := o.seen[k]
	// Any change of the record, of any field, starts the wait anew: a
	// change can only make it longer.
	if !ok || s.present != present || s.rec != rec {
		s = seen{rec: rec, present: present, since: now}
		o.seen[k] = s
	}
	if present && rec.Released && rec.Damaged == "" && !staged {
		return Verdict{Expired: true, Why: fmt.Sprintf("node %s released its lease in pool %s", node, poolName)}
	}
	need := t.Expiry(rec)
	held := max(now.Sub(s.since), 0)
	what := fmt.Sprintf("its lease record (renewal %d of instance %s)", rec.Counter, rec.Instance)
	switch {
	case !present:
		what = "no lease record"
	case rec.Damaged != "":
		what = "a damaged lease record (" + rec.Damaged + ")"
	case rec.Released:
		what = fmt.Sprintf("a released lease record (renewal %d of instance %s) while it still holds the volume staged read-write", rec.Counter, rec.Instance)
	}
	if held >= need {
		return Verdict{Expired: true, Why: fmt.Sprintf("node %s has shown %s in pool %s unchanged for %s, more than its lease of %s", node, what, poolName, held.Round(time.Second), need)}
	}
	return Verdict{Wait: need - held, Why: fmt.Sprintf("node %s has shown %s in pool %s unchanged for %s of the %s (lease duration plus margin, by this controller's clock) after which it cannot be writing", node, what, poolName, held.Round(time.Second), need)}
}

// Unchanged records what was read of node's lease in poolName, as Observe
// does, and says how long this observer has seen it unchanged: what an
// operator watches for a node that stopped renewing (docs/fencing.md).
func (o *Observer) Unchanged(poolName, node string, rec pool.Lease, present bool) time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.now()
	k := key{poolName, node}
	s, ok := o.seen[k]
	if !ok || s.present != present || s.rec != rec {
		s = seen{rec: rec, present: present, since: now}
		o.seen[k] = s
	}
	return max(now.Sub(s.since), 0)
}
