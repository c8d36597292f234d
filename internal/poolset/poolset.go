// Package poolset is the driver's pool registry: the operator's pools and
// the pools on the shares StorageClasses name, which join while the driver
// runs (docs/pools.md, "Shares named by a StorageClass"). A call finds the
// pool an ID names with Lookup, which never mounts anything, or with Ensure,
// which mounts the ID's share where the call may (internal/driver/request.go
// decides which call may).
package poolset

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Deps is what the registry takes from the driver.
type Deps struct {
	// NodeID is this node, named in messages and in the pools it opens.
	NodeID string
	// Shares mounts the shares StorageClasses name; nil: none can be named.
	Shares ShareMounter
	// ShareTypes are the allowed share types; nil takes DefaultShareTypes.
	ShareTypes []string
	// ShareKeys are the cluster's share keys: the first tags the IDs this
	// driver makes, any verifies a tag (so a key can be rotated).
	ShareKeys [][]byte
	// Joined is called when a share's pool joins the set (the node
	// registers with it); may be nil.
	Joined func(ctx context.Context)
	// Recovered is called for each share's pool Recover serves, which it
	// holds (Hold) first: the driver runs the pool's start-up passes, then
	// releases it. nil: Recover holds nothing.
	Recovered func(p *pool.Pool)
	// HeldWait is how long a call that finds its pool held (Hold) waits for
	// the pool's start-up passes before it answers UNAVAILABLE: a pool only
	// slow to open (a CephFS client revoking capabilities) serves its first
	// calls as it did when each call waited the pool's open. 0: no wait.
	HeldWait time.Duration
	// LayoutGuard, if set, is the guard each pool on a share is opened
	// with (pool.WithLayoutGuard), given the pool's name.
	LayoutGuard func(name string) func() error
}

// Set is the pools this driver serves.
type Set struct {
	deps Deps
	// mu guards pools and names: the pools on shares join them while the
	// driver runs.
	mu    sync.RWMutex
	pools map[string]*pool.Pool
	names []string
	// configured are the names of the operator's pools, sorted.
	configured []string
	shares     shareState
	// starting are the served pools whose start-up passes have not run
	// (Hold): name → chan struct{}, closed by Release.
	starting sync.Map
}

// ErrStarting is why a pool held by Hold answers no call: its start-up
// passes (the recovery of what a restart interrupted) have not run yet.
// Errors that carry it are UNAVAILABLE (pool.ErrUnavailable).
var ErrStarting = errors.New("the pool's start-up passes have not run yet")

// Hold keeps the pool of name from every call that finds a pool through the
// set (Lookup, Ensure, ForCreate): each waits for Release at most
// Deps.HeldWait, then answers UNAVAILABLE (ready). The pool stays listed (Names, Pool), so what must reach it whatever it is
// (the lease keeper, the start-up passes themselves) still does.
func (s *Set) Hold(name string) { s.starting.LoadOrStore(name, make(chan struct{})) }

// Release ends Hold: the pool's start-up passes have run.
func (s *Set) Release(name string) {
	if ch, ok := s.starting.LoadAndDelete(name); ok {
		close(ch.(chan struct{}))
	}
}

// Held tells whether the pool of name is held (Hold).
func (s *Set) Held(name string) bool {
	_, held := s.starting.Load(name)
	return held
}

// Served is Names without the pools held (Hold): the pools the driver's
// own loops may act on for calls.
func (s *Set) Served() []string {
	var out []string
	for _, n := range s.Names() {
		if !s.Held(n) {
			out = append(out, n)
		}
	}
	return out
}

// ready refuses a pool that is held (Hold), after waiting for its start-up
// passes at most HeldWait or until ctx ends, whichever comes first: a pool
// only slow to open serves the call, one that hangs answers UNAVAILABLE
// within the wait. A pool whose open failed (its filesystem answered with an
// error: no pool.json, a client evicted) is refused at once, with the open's
// error, as it was before the passes held pools: nothing it could answer
// within the wait. Calls on other pools never wait for it.
func (s *Set) ready(ctx context.Context, p *pool.Pool) (*pool.Pool, error) {
	if p == nil {
		return p, nil
	}
	openFailed := !p.OpenPending() && p.OpenError() != nil
	if ch, held := s.starting.Load(p.Name()); held && s.deps.HeldWait > 0 && !openFailed {
		t := time.NewTimer(s.deps.HeldWait)
		select {
		case <-ch.(chan struct{}):
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	if s.Held(p.Name()) {
		why := "it has not answered since this process started"
		if err := p.OpenError(); err != nil {
			why = err.Error()
		}
		return nil, csierr.Failf(pool.ErrUnavailable, "pool %s on node %s: %w (%s); its calls are answered once they have", p.Name(), s.deps.NodeID, ErrStarting, why)
	}
	return p, nil
}

// readyFor is ready, except for a call that needs none of the start-up
// passes (Access.evenHeld): it gets the pool at once, held or not.
func (s *Set) readyFor(ctx context.Context, p *pool.Pool, acc Access) (*pool.Pool, error) {
	if acc.evenHeld {
		return p, nil
	}
	return s.ready(ctx, p)
}

// New makes the set of the operator's pools.
func New(deps Deps, pools []*pool.Pool) (*Set, error) {
	s := &Set{deps: deps, pools: map[string]*pool.Pool{}}
	for _, p := range pools {
		if _, dup := s.pools[p.Name()]; dup {
			return nil, fmt.Errorf("pool %s is configured twice", p.Name())
		}
		if p.Config().Share != nil || pool.IsSharePoolName(p.Name()) {
			return nil, fmt.Errorf("pool %s: the names of the form s-<16 hex digits> are those of shares' pools", p.Name())
		}
		p.Ledger().SetKeys(deps.ShareKeys)
		s.pools[p.Name()] = p
		s.names = append(s.names, p.Name())
	}
	sort.Strings(s.names)
	s.configured = append([]string(nil), s.names...)
	if err := s.shares.init(deps); err != nil {
		return nil, err
	}
	return s, nil
}

// Pool returns the pool of a name (configured, or a share's this driver has
// mounted), or nil.
func (s *Set) Pool(name string) *pool.Pool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.pools[name]
}

// Names returns the names of every pool, configured or a share's, sorted.
func (s *Set) Names() []string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.names
}

// Configured returns the names of the operator's pools, sorted.
func (s *Set) Configured() []string { return s.configured }

// Add adds a share's pool, or returns the one of its name already served.
// names is replaced, never changed in place: Names hands it out.
func (s *Set) Add(p *pool.Pool) *pool.Pool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old, ok := s.pools[p.Name()]; ok {
		return old
	}
	s.addLocked(p)
	return p
}

// add adds p unless a pool of its name is served, held (Hold) if hold; it
// tells whether it added p.
func (s *Set) add(p *pool.Pool, hold bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.pools[p.Name()]; ok {
		return false
	}
	if hold {
		s.Hold(p.Name())
	}
	s.addLocked(p)
	return true
}

func (s *Set) addLocked(p *pool.Pool) {
	p.Ledger().SetKeys(s.deps.ShareKeys)
	s.pools[p.Name()] = p
	names := append(append([]string(nil), s.names...), p.Name())
	sort.Strings(names)
	s.names = names
}

// Params is what the request parsers know of this set: the configured
// pools' names and what the share machinery allows.
func (s *Set) Params() params.Config {
	return params.Config{Pools: s.configured, Shares: s.shares.config()}
}

// ShareTypes are the allowed share types, sorted (none without a mounter).
func (s *Set) ShareTypes() []string { return s.shares.typeList() }

// WireID is the ID of a volume, snapshot or group as the CO gets it: on a
// share, tagged (when the driver has a share key).
func (s *Set) WireID(p *pool.Pool, id string) string {
	if p == nil || p.Config().Share == nil {
		return id
	}
	if tag := s.shares.tag(*p.Config().Share); tag != "" {
		return id + "." + tag
	}
	return id
}

// Recover serves, after a restart, the pools on the shares this node has
// mounted (found through the records next to their mount points), so
// ListVolumes and the health calls see them before any call names them.
func (s *Set) Recover(ctx context.Context) {
	if s.shares.m == nil {
		return
	}
	log := klog.FromContext(ctx)
	known, err := s.shares.m.Known()
	if err != nil {
		log.Error(err, "Looking for shares mounted before a restart")
		return
	}
	// Side by side: a share whose filesystem hangs holds up only itself.
	var wg sync.WaitGroup
	for r, path := range known {
		if s.shares.allowed(r) != nil {
			log.Info("A share mounted before is not of an allowed type now; not served", "share", r.String())
			continue
		}
		wg.Go(func() {
			p, err := s.openSharePool(r, path)
			if err != nil || !p.LaidOut() {
				return
			}
			// Held before anyone can find it: its start-up passes
			// (Recovered) release it.
			if !s.add(p, s.deps.Recovered != nil) {
				return // a call mounted it meanwhile
			}
			log.Info("Serving the pool on a share mounted before", "pool", p.Name(), "share", r.String(), "path", path)
			if s.deps.Recovered != nil {
				s.deps.Recovered(p)
			}
		})
	}
	wg.Wait()
}

// JoinNames lists pool names in a message.
func JoinNames(names []string) string { return strings.Join(names, ", ") }
