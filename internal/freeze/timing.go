// Package freeze freezes image volumes' filesystems so that a snapshot's or
// a clone's copy is of one point in time (docs/snapshots.md#freezing-across-nodes):
// the controller's coordinator (coordinator.go), the node's agent that
// answers other controllers' requests through the pool's inboxes (agent.go),
// and the thaw of what a crashed process left frozen (recover.go). It takes
// a narrow Deps, never the driver: this node's kernel and records
// (layout.Deps), the pools, a lock function and the lease verdict.
package freeze

import (
	"errors"
	"fmt"
	"time"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// Timing is the schedule of freezes across nodes.
type Timing struct {
	// Poll is how often a node's agent reads its inbox.
	Poll time.Duration
	// MaxHold is the longest a node keeps a filesystem frozen for a
	// request, by its own clock: a controller that dies mid-copy never
	// leaves it frozen for longer.
	MaxHold time.Duration
	// AckTimeout is how long a controller waits for a node to confirm a
	// freeze before it looks at the node's lease.
	AckTimeout time.Duration
	// Budget is the most a node keeps one volume frozen for requests
	// within any hour (0: DefaultBudget, or MaxHold if that is
	// longer). After each hold the volume is not frozen again for as long
	// as that hold lasted. Requests cannot change either: a pool writer
	// that sends new nonces gets no more frozen time.
	Budget time.Duration
}

// DefaultBudget is the frozen time per volume and hour a node allows
// when Timing.Budget is zero: five holds of the default maximum.
const DefaultBudget = 5 * time.Minute

// budget is the budget in force.
func (t Timing) BudgetInForce() time.Duration {
	if t.Budget > 0 {
		return t.Budget
	}
	return max(DefaultBudget, t.MaxHold)
}

// DefaultTiming is the schedule when none is given.
var DefaultTiming = Timing{Poll: 500 * time.Millisecond, MaxHold: 60 * time.Second, AckTimeout: 10 * time.Second}

// Validate refuses a schedule in which a node could not answer in time.
func (t Timing) Validate() error {
	switch {
	case t.Poll <= 0 || t.MaxHold <= 0 || t.AckTimeout <= 0:
		return errors.New("freeze poll interval, maximum hold and acknowledgement timeout must be positive")
	case t.AckTimeout < 2*t.Poll:
		return fmt.Errorf("freeze acknowledgement timeout %s must be at least two poll intervals (%s)", t.AckTimeout, t.Poll)
	case t.MaxHold < 2*t.Poll:
		return fmt.Errorf("freeze maximum hold %s must be at least two poll intervals (%s)", t.MaxHold, t.Poll)
	case t.Budget < 0 || (t.Budget > 0 && t.Budget < t.MaxHold):
		return fmt.Errorf("freeze budget %s must be at least the maximum hold (%s)", t.Budget, t.MaxHold)
	}
	return nil
}

// freezable tells whether quiesce can freeze v where it is staged: only an
// image volume's own filesystem. A block volume may hold a filesystem poolcsi
// never made and a pod's mount of it poolcsi cannot see; a dir volume is a
// directory of the pool's filesystem, which a freeze would stop for every
// volume in it.
func Freezable(v *pool.Volume) bool {
	return v.Layout == pool.LayoutImage && v.AccessType == pool.AccessFilesystem
}
