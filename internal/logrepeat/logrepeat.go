// Package logrepeat decides when a failure that repeats on a timer is logged:
// the first time, each time it changes, and then at a slow interval while it
// stays the same. A pool that was never laid out fails a lease renewal every
// few seconds for as long as the node runs; one line that says so and how to
// fix it, repeated every few minutes, is what an operator can read. What
// shows the state continuously is health and metrics, not the log.
package logrepeat

import "time"

// Interval is how often an unchanged failure is logged again.
const Interval = 5 * time.Minute

// Failures tracks one repeating failure. The zero value is ready; it is not
// safe for concurrent use (its owner's lock guards it).
type Failures struct {
	msg        string    // the failure last logged ("": none since the last success)
	logged     time.Time // when it was last logged
	suppressed int       // failures not logged since then
	total      int       // failures since the last success
}

// Failed records a failure with message msg at now and tells whether to log it,
// and how many failures went unlogged before it (to say so in the line).
func (f *Failures) Failed(msg string, now time.Time) (log bool, suppressed int) {
	f.total++
	if msg != f.msg || now.Sub(f.logged) >= Interval {
		suppressed = f.suppressed
		f.msg, f.logged, f.suppressed = msg, now, 0
		return true, suppressed
	}
	f.suppressed++
	return false, 0
}

// Succeeded records a success and returns how many failures came before it
// (0: it was not failing), for a line saying it recovered.
func (f *Failures) Succeeded() (failures int) {
	failures = f.total
	*f = Failures{}
	return failures
}
