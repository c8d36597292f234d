package central

import (
	"context"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/runner"
)

// The sweeper's limits (docs/design/central-controller.md §2.4), each counted from when
// this process's informer first saw the call in that state.
const (
	// SweepEvery paces the sweeper.
	SweepEvery = time.Minute
	// DoneFor: an answer no retry came for is deleted after this long.
	DoneFor = 10 * time.Minute
	// UntakenFor: a call no agent took is deleted after this long (its node stayed
	// down; a node back later skips it by notAfter).
	UntakenFor = DefaultCallLifetime
	// RunningFor: a call running this long is logged; the node owns it.
	RunningFor = time.Hour
)

// Sweeper deletes the calls nobody will delete: answered ones whose retry never came,
// and ones no agent took. It runs in every controller replica; every delete is
// conditional on the resourceVersion it judged, so a sweep racing an agent's commit
// point or another replica's sweep ends with one winner. No two machines' clocks are
// compared: an age is how long this process has seen the call in its state.
type Sweeper struct {
	// Metrics counts the calls swept (nil: none); set before Run.
	Metrics *Metrics

	store nodecall.Store
	calls cache.SharedIndexInformer
	clk   clock.Clock

	mu   sync.Mutex
	seen map[string]observed // by call name
}

// observed is a call's state as this process saw it, and since when.
type observed struct {
	uid    types.UID
	state  nodecall.Phase // "" for not taken (or a status without the nonce)
	since  time.Time
	logged bool // a Running call over RunningFor was logged
}

// NewSweeper returns the sweeper of the calls calls watches (every node's) and registers
// its handler on it. clk nil is the real clock.
func NewSweeper(store nodecall.Store, calls cache.SharedIndexInformer, clk clock.Clock) *Sweeper {
	if clk == nil {
		clk = clock.RealClock{}
	}
	s := &Sweeper{store: store, calls: calls, clk: clk, seen: map[string]observed{}}
	_, _ = calls.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observe(nodecall.FromCache(obj)) },
		UpdateFunc: func(_, obj any) { s.observe(nodecall.FromCache(obj)) },
		DeleteFunc: func(obj any) {
			if c := nodecall.FromCache(obj); c != nil {
				s.mu.Lock()
				if o, ok := s.seen[c.Name]; ok && o.uid == c.UID {
					delete(s.seen, c.Name)
				}
				s.mu.Unlock()
			}
		},
	})
	return s
}

func stateOf(c *nodecall.Call) nodecall.Phase {
	if c.Status.Nonce != c.Spec.Nonce {
		return ""
	}
	return c.Status.Phase
}

func (s *Sweeper) observe(c *nodecall.Call) {
	if c == nil {
		return
	}
	st := stateOf(c)
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, ok := s.seen[c.Name]; ok && o.uid == c.UID && o.state == st {
		return
	}
	s.seen[c.Name] = observed{uid: c.UID, state: st, since: s.clk.Now()}
}

// Run sweeps every SweepEvery until ctx ends (runner.Runner).
func (s *Sweeper) Run(ctx context.Context) error {
	return runner.Every{Interval: SweepEvery, F: s.Sweep}.Run(ctx)
}

// Sweep makes one pass over the calls the informer holds.
func (s *Sweeper) Sweep(ctx context.Context) {
	log := klog.FromContext(ctx)
	now := s.clk.Now()
	for _, obj := range s.calls.GetStore().List() {
		c := nodecall.FromCache(obj)
		if c == nil || c.DeletionTimestamp != nil {
			continue
		}
		s.mu.Lock()
		o, ok := s.seen[c.Name]
		if !ok || o.uid != c.UID || o.state != stateOf(c) {
			// Not yet judged in this state (its event is on the way).
			s.mu.Unlock()
			continue
		}
		age := now.Sub(o.since)
		logRunning := o.state == nodecall.Running && age >= RunningFor && !o.logged
		if logRunning {
			o.logged = true
			s.seen[c.Name] = o
		}
		s.mu.Unlock()

		var why, reason string
		switch {
		case o.state == nodecall.Done && age >= DoneFor:
			why, reason = "answered and never asked for again", sweptAnswered
		case o.state == "" && age >= UntakenFor:
			why, reason = "no agent took it", sweptUntaken
		case logRunning:
			log.Info("PoolCall running for long on its node; the node owns it", "call", c.Name, "node", c.Spec.Node,
				"method", c.Spec.Method, "target", c.Spec.Target, "attempts", c.Status.Attempts, "seenRunningFor", age.Round(time.Second))
			continue
		default:
			continue
		}
		err := s.store.Delete(ctx, c.Name, c.ResourceVersion)
		switch {
		case err == nil:
			s.Metrics.sweptOne(reason)
			log.V(2).Info("Swept PoolCall", "call", c.Name, "node", c.Spec.Node, "method", c.Spec.Method, "reason", why, "for", age.Round(time.Second))
		case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
			// Gone, or changed since it was judged: its new state is judged afresh.
		default:
			log.Error(err, "Sweeping PoolCall", "call", c.Name)
		}
	}
}
