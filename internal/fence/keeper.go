// Package fence is this node's lease keeper and self-fence (docs/fencing.md),
// and the controller's view of other nodes' leases: the verdict a force-detach
// waits for, and the watch of peers whose leases stopped changing. It holds
// only Deps: the pools come from a lister, the node's kernel and stage records
// from internal/layout's Deps, a volume's lock from a function.
package fence

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/logrepeat"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/nodestate"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/runner"
)

// Node leases in shared pools (docs/fencing.md). A node plugin renews its lease
// in every shared pool it serves; one that cannot renew for the lease's
// duration fences itself: every loop device backed by an image of that pool
// stops taking I/O, for good. A controller asked to take an image volume away
// from a node that still has it staged read-write (Kubernetes' force-detach,
// after the out-of-service taint) waits until that node's lease has expired by
// its own clock, so the volume reaches another node only after the first one
// has fenced itself, whether it died or is cut off and still running.

// Deps is what the keeper acts through.
type Deps struct {
	// NodeID is this node's name in the leases.
	NodeID string
	// Timing is the leases' schedule.
	Timing lease.Timing
	// Names lists every pool this node serves (configured and shares'),
	// and Pool returns one by name (nil if none).
	Names func() []string
	Pool  func(name string) *pool.Pool
	// Node is the node's kernel and its stage records.
	Node *layout.Deps
	// Lock takes a volume's in-process lock as a call of holder would,
	// failing at once when it is held.
	Lock func(volume, holder string) (release func(), err error)
	// Startup, if set, is the guard over this process's start: Run stops
	// it, and counts from its start.
	Startup *StartupFence
}

// Keeper is the driver's lease state: this node's leases in shared pools
// and the controller's view of other nodes'.
type Keeper struct {
	deps     Deps
	timing   lease.Timing
	instance string
	observer *lease.Observer // controller side
	peers    *peerWatch      // controller side: what an operator watches

	mu    sync.Mutex
	pools map[string]*poolLease // node side, by pool name
	// now is the clock of the node side; tests replace it. Only differences
	// of its readings matter (monotonic).
	now func() time.Time
	// write renews a lease; tests replace it to make a pool hang or fail.
	write func(p *pool.Pool, l pool.Lease) error
	// repair removes a damaged lease entry of this node (pool.Leases().Repair).
	repair func(p *pool.Pool, node string) error
	// adoption is, by pool, how the start-up pass that adds records
	// (AdoptDevices) ended: errAdoptionUnderWay until it returns, then what
	// it could not decide (nil: nothing). Until every one is nil, this
	// node's records may miss a device it holds, and ReleaseLeases releases
	// nothing.
	adoption map[string]error
}

// errAdoptionUnderWay marks a start-up adoption pass that has not returned.
var errAdoptionUnderWay = errors.New("the start-up pass recording loop devices staged before this node kept records has not finished (a pool that is slow or hangs?)")

// poolLease is this node's lease in one pool.
type poolLease struct {
	first    time.Time // when this process first tried to renew it
	last     time.Time // the start of the last renewal that succeeded (zero: none)
	counter  uint64
	inFlight bool
	started  time.Time // when the renewal under way (inFlight) began
	// waiters get the outcome of the renewal under way (RenewAsync with a
	// done channel while one was in flight).
	waiters []chan<- error
	lastErr error
	// logged spaces out the log lines of a failure that repeats at every
	// renewal (a pool never laid out: forever)
	logged logrepeat.Failures
	fenced time.Time // when it fenced itself (zero: not)
	// fenceCause says why the renewals failed, for the health reason.
	fenceCause string
	// fence is what the fence found and did (planFence).
	fence fencePlan
}

// NewKeeper makes the lease state over deps; Run keeps the leases.
func NewKeeper(deps Deps) *Keeper {
	var b [8]byte
	_, _ = rand.Read(b[:])
	ls := &Keeper{
		deps: deps, timing: deps.Timing, instance: hex.EncodeToString(b[:]),
		pools: map[string]*poolLease{}, adoption: map[string]error{}, now: time.Now,
		write:  func(p *pool.Pool, l pool.Lease) error { return p.Leases().Write(l) },
		repair: func(p *pool.Pool, node string) error { return p.Leases().Repair(node) },
	}
	ls.observer = lease.NewObserverClock(func() time.Time { return ls.now() })
	ls.peers = newPeerWatch(func() time.Time { return ls.now() })
	return ls
}

func (ls *Keeper) state(name string) *poolLease {
	pl, ok := ls.pools[name]
	if !ok {
		pl = &poolLease{first: ls.now()}
		ls.pools[name] = pl
	}
	return pl
}

// Run renews this node's lease in every shared pool every interval and
// fences the pools it could not renew in time, until ctx ends; then it
// releases the leases of pools where this node holds no loop device.
func (k *Keeper) Run(ctx context.Context) error {
	if ok, kernel := mount.FenceHolds(); !ok && len(k.SharedPools()) > 0 {
		klog.FromContext(ctx).Error(nil, "This kernel lets I/O through to a loop device of size zero, which the self-fence relies on (Linux 6.5 and later refuse it): a node cut off from a shared pool cannot stop its pods' writes; do not force-detach volumes of a running node", "kernel", kernel)
	}
	if g := k.deps.Startup; g != nil {
		// This process's time without a renewal counts from its start,
		// not from here: a start that hung on a pool must not delay the
		// fence.
		k.StartLeases(ctx, g.at)
		g.Started()
	}
	// The start-up passes run on their own: with many stale records, or a
	// hung backing file anywhere on the node, a pass takes longer than half
	// the margin, and the fence must not wait behind it (a fence that runs
	// first and meets a stale record fails closed: it fences more, never
	// less); a pool may hang its pass. The renewals and the fence check are
	// two loops, the check's first one interval after the start (it gives
	// the first renewal, started at once, that long to land).
	// An adoption pass adds records: until it has ended having decided
	// every device, the records may miss one this node holds, and no lease
	// is released from them (ReleaseLeases).
	passes := []runner.Runner{runner.Func(func(ctx context.Context) error { k.DropStaleRecords(ctx); return nil })}
	for _, p := range k.SharedPools() {
		k.mu.Lock()
		k.adoption[p.Name()] = errAdoptionUnderWay
		k.mu.Unlock()
		passes = append(passes, runner.Func(func(ctx context.Context) error {
			err := k.adoptDevices(ctx, p)
			if err != nil {
				klog.FromContext(ctx).Error(err, "Recording the loop devices staged before this node kept records left some undecided: this process will not release its leases on its way out (they expire)", "pool", p.Name())
			}
			k.mu.Lock()
			k.adoption[p.Name()] = err
			k.mu.Unlock()
			return nil
		}))
	}
	stopPasses := runner.Start(ctx, passes...)
	t := k.timing
	_ = runner.Stages(ctx, []runner.Runner{
		runner.Every{Interval: t.Interval, AtStart: true, F: k.renewAll},
		runner.Every{Interval: min(time.Second, t.Interval/2), F: k.FenceExpired},
	})
	// The passes are waited for before the release, which decides from
	// the records they complete. A pass stuck on a hung pool is not waited
	// for past releaseWait: the process may end without it, as it may with
	// a renewal stuck there, and then releases nothing.
	waitPasses(ctx, stopPasses)
	k.ReleaseLeases(ctx)
	return nil
}

// waitPasses waits for the start-up passes stop stops, at most releaseWait.
func waitPasses(ctx context.Context, stop func() error) {
	done := make(chan struct{})
	go func() { defer close(done); _ = stop() }()
	select {
	case <-done:
	case <-time.After(releaseWait):
		klog.FromContext(ctx).Info("A start-up pass over this node's stage records has not ended (a pool that hangs?); stopping without it")
	}
}

// StartLeases makes this process's time without a renewal count from at, its
// start (StartupFence), for the pools it answers for at start: those it
// serves now and those its stage records name (their devices may be an
// earlier process's). A pool added later (a share's) counts from when it is
// added: counted from the start, it would fence at the first tick after half
// the margin, with nothing staged yet, and stay fenced for nothing.
func (k *Keeper) StartLeases(ctx context.Context, at time.Time) {
	var names []string
	for _, p := range k.SharedPools() {
		names = append(names, p.Name())
	}
	recorded, err := k.deps.Node.RecordedPools(false)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading this node's stage records for the pools it answers for at start")
	}
	ls := k
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, name := range append(names, recorded...) {
		if pl := ls.state(name); at.Before(pl.first) {
			pl.first = at
		}
	}
}

// SharedPools are the pools this node keeps a lease in.
func (k *Keeper) SharedPools() []*pool.Pool {
	var out []*pool.Pool
	for _, name := range k.deps.Names() {
		if p := k.deps.Pool(name); p != nil && p.Shared() {
			out = append(out, p)
		}
	}
	return out
}

// renewAll starts a renewal in every shared pool that has none under way: a
// renewal that hangs (a pool whose filesystem stopped answering) holds up
// nothing but itself.
func (k *Keeper) renewAll(ctx context.Context) {
	for _, p := range k.SharedPools() {
		k.RenewAsync(ctx, p, nil)
	}
}

// RenewAsync starts one renewal of p unless one is under way; done, if not
// nil (and buffered), gets its outcome, or the outcome of the one under way.
func (k *Keeper) RenewAsync(ctx context.Context, p *pool.Pool, done chan<- error) {
	ls := k
	ls.mu.Lock()
	pl := ls.state(p.Name())
	if pl.inFlight {
		// A caller that wants an outcome waits for the renewal under way
		// (the keeper's first one on a slow pool, say) rather than being
		// told the pool is busy; it bounds the wait with its own context.
		if done != nil {
			pl.waiters = append(pl.waiters, done)
		}
		ls.mu.Unlock()
		return
	}
	pl.inFlight = true
	rec := pool.Lease{Node: k.deps.NodeID, Instance: ls.instance, Counter: pl.counter + 1, DurationSeconds: int64(ls.timing.Duration / time.Second)}
	start := ls.now()
	pl.started = start
	write, repair := ls.write, ls.repair
	ls.mu.Unlock()
	go func() {
		// Only where this node's writers are: a lease renewed into a
		// filesystem that covers the pool keeps the fence quiet while the
		// pool's other nodes see this node silent (writers.go).
		err := k.VerifyWriters(p)
		if err == nil {
			err = write(p, rec)
		}
		if renewalCause(err) == causeDamaged {
			// The pool answers; only this node's own entry is wrong (anyone
			// who can write the pool can put a directory or a link there).
			// Fencing would stop this node's volumes for nothing: repair it
			// and write anew. A repair that fails leaves the renewal failed,
			// and the fence comes at the lease's duration as for any other
			// failure, since readers see no renewal either.
			klog.FromContext(ctx).Info("This node's lease file in the pool is damaged while the pool answers: removing it and writing it anew", "pool", p.Name(), "damage", err.Error())
			if rerr := repair(p, rec.Node); rerr != nil {
				err = fmt.Errorf("%w; repairing it failed: %w", err, rerr)
			} else {
				err = write(p, rec)
			}
		}
		ls.mu.Lock()
		pl.inFlight = false
		pl.lastErr = err
		waiters := pl.waiters
		pl.waiters = nil
		var logIt bool
		var suppressed, recovered int
		if err != nil {
			logIt, suppressed = pl.logged.Failed(err.Error(), ls.now())
		} else {
			recovered = pl.logged.Succeeded()
		}
		if err == nil {
			pl.last, pl.counter = start, rec.Counter
			if !pl.fenced.IsZero() && !start.Before(pl.fenced) {
				// A renewal that started after the fence: the episode
				// is over, and the pool lost again fences again. The
				// devices it fenced stay fenced until they are unstaged
				// (attach refuses them, dropStaleStage replaces them).
				pl.fenced, pl.fenceCause, pl.fence = time.Time{}, "", fencePlan{}
			}
		}
		ls.mu.Unlock()
		switch {
		case logIt && suppressed > 0:
			klog.FromContext(ctx).Error(err, "Renewing this node's lease failed", "pool", p.Name(), "cause", renewalCause(err).String(),
				"failedUnloggedSinceLastLine", suppressed, "nextLineIn", logrepeat.Interval.String())
		case logIt:
			klog.FromContext(ctx).Error(err, "Renewing this node's lease failed", "pool", p.Name(), "cause", renewalCause(err).String(),
				"sameFailureLoggedAgainIn", logrepeat.Interval.String())
		case recovered > 0:
			klog.FromContext(ctx).Info("Renewed this node's lease after failed renewals", "pool", p.Name(), "failures", recovered)
		}
		if done != nil {
			done <- err
		}
		for _, w := range waiters {
			w <- err // buffered: a waiter that gave up is not waited for
		}
	}()
}

// renewalFailure classifies why a renewal failed: the node repairs a damaged
// lease entry of its own and fences for the rest at the lease's duration, but
// the health reason and the logs say which it was.
type renewalFailure int

const (
	causeNone renewalFailure = iota
	// causeCutOff: the pool does not answer as this pool (its root gone or
	// not the pool any more, EIO, ESTALE, ENOTCONN, a timeout, read-only).
	causeCutOff
	// causeDamaged: the pool answers, but this node's own lease entry is no
	// lease file (a directory, a link, a FIFO): repaired, not fenced for.
	causeDamaged
	// causeOther: anything else that kept the record from being written
	// (EACCES, ENOSPC, ...).
	causeOther
	// causeHung: a renewal has not returned for a renewal interval.
	causeHung
)

func (c renewalFailure) String() string {
	switch c {
	case causeCutOff:
		return "cut off from the pool"
	case causeDamaged:
		return "lease file damaged"
	case causeHung:
		return "renewal timed out"
	case causeOther:
		return "lease not writable"
	}
	return "none"
}

// cutOffErrnos are the errors of a filesystem that does not answer as the
// pool any more.
var cutOffErrnos = []error{unix.EIO, unix.ESTALE, unix.ENOTCONN, unix.ETIMEDOUT, unix.EROFS, unix.ENODEV, unix.ENXIO, unix.EHOSTDOWN, unix.EHOSTUNREACH, unix.ECONNRESET, unix.ECONNREFUSED, unix.ESHUTDOWN}

// renewalCause classifies the outcome of one renewal.
func renewalCause(err error) renewalFailure {
	switch {
	case err == nil:
		return causeNone
	case errors.Is(err, errRenewalHung):
		return causeHung
	case errors.Is(err, pool.ErrUnavailable):
		return causeCutOff
	}
	for _, e := range cutOffErrnos {
		if errors.Is(err, e) {
			return causeCutOff
		}
	}
	if errors.Is(err, pool.ErrLeaseDamaged) {
		return causeDamaged
	}
	return causeOther
}

// errRenewalHung marks a renewal that did not return within an interval.
var errRenewalHung = errors.New("a renewal of the lease has not returned")

// failure is why this lease is not being renewed, at now: a renewal under way
// for longer than interval has timed out (the pool hangs), whatever the one
// before said; otherwise the last renewal's error (nil: it worked).
func (pl *poolLease) failure(now time.Time, interval time.Duration) error {
	if pl.inFlight && now.Sub(pl.started) >= interval {
		return fmt.Errorf("%w for %s (the pool hangs)", errRenewalHung, now.Sub(pl.started).Round(time.Second))
	}
	return pl.lastErr
}

// describeFailure is the health reason's account of a failure.
func describeFailure(err error) string {
	c := renewalCause(err)
	if c == causeNone {
		return "no renewal succeeded since this node plugin started"
	}
	return c.String() + ": " + err.Error()
}

// FenceExpired fences every pool whose lease this node has not renewed for the
// lease's duration. That includes the pools this node's records name
// read-write stages of but that it does not serve (a share whose mount was
// gone when this process started is never served, yet its devices may still
// write): never renewed, they fence after the startup allowance.
func (k *Keeper) FenceExpired(ctx context.Context) {
	ls := k
	var names []string
	for _, p := range k.SharedPools() {
		names = append(names, p.Name())
	}
	recorded, err := k.deps.Node.RecordedPools(true)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading this node's stage records for the pools it does not serve")
	}
	for _, name := range recorded {
		if k.deps.Pool(name) == nil && !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	for _, name := range names {
		ls.mu.Lock()
		pl := ls.state(name)
		since := ls.since(pl)
		must := pl.fenced.IsZero() && ls.timing.MustFence(since, ls.now())
		lastErr := pl.failure(ls.now(), ls.timing.Interval)
		at := ls.now()
		if must {
			pl.fenced = at
			pl.fenceCause = describeFailure(lastErr)
		}
		ls.mu.Unlock()
		if must {
			k.fence(ctx, name, pl, at, since, lastErr)
		}
	}
}

// since is when pl's time without a renewal counts from, for the fence.
// Callers hold ls.mu.
func (ls *Keeper) since(pl *poolLease) time.Time {
	if pl.last.IsZero() {
		// Never renewed by this process. Its devices may be a previous
		// process's, whose last renewal this one cannot know: it gives
		// itself half the margin to renew, so that a restart within the
		// lease's duration still fences before any reader's expiry.
		return pl.first.Add(min(ls.timing.Margin/2, ls.timing.Duration) - ls.timing.Duration)
	}
	return pl.last
}

// Lost tells whether this node's lease in pool name is fenced or past its
// duration (the fence is due): a device attached now may have been missed
// by the fence's enumeration. A nil ls (no leases) loses nothing.
func (ls *Keeper) Lost(name string) bool {
	if ls == nil {
		return false
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	pl := ls.state(name)
	return !pl.fenced.IsZero() || ls.timing.MustFence(ls.since(pl), ls.now())
}

// fence stops I/O through every loop device of this node's images of pool name, found
// from the kernel and this node's records, never from the pool's path (a node
// that lost its pool cannot resolve it): see planFence. It never blocks on the
// pool: the kernel's answers are waited for a bounded time, and each device is
// fenced on its own goroutine.
func (k *Keeper) fence(ctx context.Context, name string, pl *poolLease, at, since time.Time, cause error) {
	log := klog.FromContext(ctx).WithValues("node", k.deps.NodeID, "lastRenewal", since, "duration", k.timing.Duration)
	fencePool(klog.NewContext(ctx, log), k.deps.Node, name, min(layout.IdentifyWait, k.timing.Margin/4), cause, func(plan fencePlan) {
		k.mu.Lock()
		if pl.fenced.Equal(at) {
			// Still this episode: a renewal may have ended it meanwhile.
			pl.fence = plan
		}
		k.mu.Unlock()
	})
}

// StartupFence covers the start of a node plugin, before its lease keeper
// runs: opening a pool whose filesystem hangs hangs the start itself, and a
// process that never reaches its lease keeper would never fence. Unless
// Started is called first, it fences at half the margin after it was made
// (when a started node plugin that cannot renew fences) every pool this
// node's records name, from the records alone: the previous process's last
// renewal cannot be known. A start that fails hands it to Abandon, which
// keeps the process until that fence is done.
type StartupFence struct {
	at      time.Time
	delay   time.Duration // from at to the fence
	state   *nodestate.Store
	started chan struct{}
	once    sync.Once
	// done is closed when the guard is over: stopped by Started or ctx
	// before it fenced, or its fence decided and every device's fence
	// returned.
	done chan struct{}
}

// NewStartupFence starts the guard over the records in state, with the
// node's lease timing t.
func NewStartupFence(ctx context.Context, state *nodestate.Store, t lease.Timing) *StartupFence {
	g := &StartupFence{at: time.Now(), delay: min(t.Margin/2, t.Duration), state: state, started: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(g.done)
		select {
		case <-g.started:
			return
		case <-ctx.Done():
			return
		case <-time.After(g.delay):
		}
		deps := &layout.Deps{State: state, Loops: new(mount.Loops)}
		pools, err := g.recordedPools()
		if err != nil {
			klog.FromContext(ctx).Error(err, "The node plugin has not started its lease keeper within half the lease margin and cannot read its stage records to fence")
		}
		var fenced []<-chan struct{}
		for _, name := range pools {
			fenced = append(fenced, fencePool(ctx, deps, name, min(layout.IdentifyWait, t.Margin/4),
				errors.New("the node plugin has not started its lease keeper within half the lease margin (a pool that hangs at start, or a start that failed), so it cannot renew"), nil))
		}
		for _, done := range fenced {
			select {
			case <-done:
			case <-ctx.Done():
				return
			}
		}
	}()
	return g
}

// recordedPools are the pools this node's stage records name.
func (g *StartupFence) recordedPools() ([]string, error) {
	keys, err := g.state.Keys(layout.StagesKind)
	var pools []string
	for _, k := range keys {
		var r layout.StageRecord
		if ok, err := g.state.Get(layout.StagesKind, k, &r); err == nil && ok && !slices.Contains(pools, r.Pool) {
			pools = append(pools, r.Pool)
		}
	}
	return pools, err
}

// Started tells the guard the lease keeper runs; nil does nothing.
func (g *StartupFence) Started() {
	if g != nil {
		g.once.Do(func() { close(g.started) })
	}
}

// Abandon is for a start that failed (cause): the process is about to exit
// without its lease keeper, so nothing renews this node's leases and another
// node may take its volumes once they expire, while their loop devices here
// still take writes. Unless the lease keeper ran (Started), Abandon does not
// stop the guard: it waits until the guard has fenced every pool the node's
// records name, at half the margin after the start as a node plugin that
// cannot renew does, and every device's fence has returned; or until ctx
// ends. A node without stage records has nothing to fence: it returns at
// once. nil does nothing.
func (g *StartupFence) Abandon(ctx context.Context, cause error) {
	if g == nil {
		return
	}
	select {
	case <-g.started:
		return
	case <-g.done:
		return
	default:
	}
	log := klog.FromContext(ctx)
	pools, err := g.recordedPools()
	if err == nil && len(pools) == 0 {
		g.Started()
		return
	}
	log.Error(cause, "The node plugin failed to start; it stays until its start-up fence has fenced this node off the pools its records name, as a node plugin that cannot renew its leases must, then exits",
		"pools", pools, "recordsError", fmt.Sprint(err), "fenceDecidesIn", time.Until(g.at.Add(g.delay)).Round(time.Millisecond).String())
	every := time.NewTicker(10 * time.Second)
	defer every.Stop()
	for {
		select {
		case <-g.done:
			log.Info("The start-up fence is done; exiting")
			return
		case <-ctx.Done():
			log.Info("Stopped before the start-up fence was done", "cause", fmt.Sprint(context.Cause(ctx)))
			return
		case <-every.C:
			log.Info("Still waiting for the start-up fence's loop devices before exiting (a device's fence waits for what its backing file's filesystem has queued)")
		}
	}
}

// fencePool fences pool name off this node, from the node's records and the
// kernel's loop devices (planFence), waiting at most wait for the kernel to
// identify them; planned gets the plan before any device is fenced. The
// channel it returns is closed once every device's fence has returned.
func fencePool(ctx context.Context, deps *layout.Deps, name string, wait time.Duration, cause error, planned func(fencePlan)) <-chan struct{} {
	log := klog.FromContext(ctx).WithValues("pool", name)
	recs, rerr := deps.PoolRecords(name)
	if rerr != nil {
		log.Error(rerr, "Reading this node's stage records for the fence: failing closed")
	}
	devs, lerr := deps.Loops.List(wait)
	if lerr != nil {
		rerr = errors.Join(rerr, lerr)
	}
	plan := planFence(devs, recs, deps.PoolDevs(name), rerr != nil)
	if lerr != nil {
		// Not even the kernel's list: nothing can be fenced, and no record
		// is accounted for.
		plan.failedClosed = true
		for _, r := range recs {
			if !r.ReadOnly && !slices.Contains(plan.unmatched, r.Volume) {
				plan.unmatched = append(plan.unmatched, r.Volume)
			}
		}
	}
	if planned != nil {
		planned(plan)
	}
	switch {
	case plan.failedClosed:
		log.Error(errors.Join(cause, rerr), "FENCE FAILED CLOSED: this node's lease in the pool was not renewed for the lease duration, and its records say it holds images of the pool read-write whose loop devices the fence did not find (or its records or the kernel's list could not be read). Fencing every loop device it cannot rule out: every one whose backing file is on the pool's filesystem, and every one whose backing file the kernel cannot identify. Check the node: another node may take these volumes",
			"unmatched", plan.unmatched, "devices", plan.devices, "matched", plan.matched, "unidentified", unidentified(devs))
	case len(plan.devices) == 0 && len(plan.matched) == 0:
		log.Info("This node's lease in the pool was not renewed for the lease duration, so another node may take its volumes; this node holds no loop device of the pool (by its own records), so there is nothing to fence", "cause", fmt.Sprint(cause))
	case len(plan.devices) == 0:
		log.Error(cause, "Fencing this node off the pool: its lease was not renewed for the lease duration; its loop devices there were fenced already", "devices", plan.matched)
	default:
		log.Error(cause, "Fencing this node off the pool: its lease was not renewed for the lease duration, so another node may take its volumes; I/O through their loop devices stops for good (until they are unstaged)",
			"devices", plan.devices)
	}
	var wg sync.WaitGroup
	for _, dev := range plan.devices {
		// Each on its own: the kernel flushes what a device has queued
		// before it changes it, which on a hung filesystem waits for it.
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := deps.Loops.Fence(dev); err != nil {
				log.Error(err, "Fencing a loop device failed", "device", dev)
				return
			}
			log.Info("Fenced a loop device", "device", dev)
		}()
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// unidentified lists the devices whose backing file the kernel did not
// identify.
func unidentified(devs []mount.LoopDevice) []string {
	var out []string
	for _, ld := range devs {
		if ld.Err != nil {
			out = append(out, ld.Device+": "+ld.Err.Error())
		}
	}
	return out
}

// releaseWait bounds what the keeper waits for on its way out, in a pool
// that may hang: a lease's release, the start-up passes.
const releaseWait = 2 * time.Second

// ReleaseLeases marks released the leases of the pools where this node holds
// no loop device by its own records (a record goes only once the kernel shows
// its device detached): a controller may then take their volumes at once. A
// node that still holds one, or cannot read its records, leaves its lease to
// expire. So does every pool while a start-up pass that adds records has not
// ended, or left a device undecided: the records may then miss a device this
// node holds, and a release would let another node take its volume at once,
// beside this node's device (two writers); an expiry makes the taker wait
// for it, as after a crash.
func (k *Keeper) ReleaseLeases(ctx context.Context) {
	ls := k
	k.mu.Lock()
	var incomplete []error
	for name, err := range k.adoption {
		if err != nil {
			incomplete = append(incomplete, fmt.Errorf("pool %s: %w", name, err))
		}
	}
	k.mu.Unlock()
	if len(incomplete) > 0 {
		klog.FromContext(ctx).Info("Not releasing this node's leases: its records may not list every loop device it holds, as a start-up pass that records them has not finished or left a device undecided; the leases expire instead, and another node waits for that expiry to take a volume",
			"why", errors.Join(incomplete...).Error())
		return
	}
	for _, p := range k.SharedPools() {
		ls.mu.Lock()
		pl := ls.state(p.Name())
		renewed := !pl.last.IsZero() && pl.fenced.IsZero()
		ls.mu.Unlock()
		if !renewed {
			continue
		}
		if recs, err := k.deps.Node.PoolRecords(p.Name()); err != nil || len(recs) > 0 {
			continue
		}
		rec := pool.Lease{Node: k.deps.NodeID, Instance: ls.instance, Counter: pl.counter + 1, DurationSeconds: int64(ls.timing.Duration / time.Second), Released: true}
		done := make(chan error, 1)
		go func() { done <- ls.write(p, rec) }()
		select {
		case err := <-done:
			if err != nil {
				klog.FromContext(ctx).Error(err, "Releasing this node's lease", "pool", p.Name())
			}
		case <-time.After(releaseWait):
		}
	}
}

// EnsureLease makes sure this node's lease in p is fresh enough to take a
// volume read-write: renewed within half its duration and not fenced; if it
// is not, it renews it now, within ctx.
func (k *Keeper) EnsureLease(ctx context.Context, p *pool.Pool) error {
	if k == nil || !p.Shared() {
		return nil
	}
	ls := k
	ls.mu.Lock()
	pl := ls.state(p.Name())
	// A pool fenced and not renewed since (by a renewal that started after
	// the fence, which ends the episode) is not fresh, whatever its last
	// renewal says.
	fresh := !pl.last.IsZero() && ls.now().Sub(pl.last) < ls.timing.Duration/2 && pl.fenced.IsZero()
	ls.mu.Unlock()
	if fresh {
		return nil
	}
	done := make(chan error, 1)
	k.RenewAsync(ctx, p, done)
	select {
	case err := <-done:
		if err != nil {
			return csierr.Failf(pool.ErrUnavailable, "node %s cannot renew its lease in pool %s, so it would not be fenced if cut off: not taking a volume read-write: %w", k.deps.NodeID, p.Name(), err)
		}
		ls.mu.Lock()
		fenced := !pl.fenced.IsZero()
		// The renewal waited for may have started long before this call
		// (one that hung, then answered): what counts is when it began.
		stale := ls.now().Sub(pl.last) >= ls.timing.Duration/2
		ls.mu.Unlock()
		if fenced {
			return csierr.Failf(pool.ErrUnavailable, "node %s fenced itself off pool %s and has not renewed its lease since: not taking a volume read-write", k.deps.NodeID, p.Name())
		}
		if stale {
			return csierr.Failf(pool.ErrUnavailable, "node %s: the renewal of its lease in pool %s that this call waited for began too long ago to count: not taking a volume read-write", k.deps.NodeID, p.Name())
		}
		return nil
	case <-ctx.Done():
		return csierr.Failf(pool.ErrUnavailable, "node %s: renewing its lease in pool %s did not finish in time: %w", k.deps.NodeID, p.Name(), ctx.Err())
	}
}

// FencedIssue is the node-side health of a volume of a pool this node has
// fenced itself off, nil if it has not.
func (k *Keeper) FencedIssue(p *pool.Pool) *health.Issue {
	if k == nil || !p.Shared() {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	pl, ok := k.pools[p.Name()]
	if !ok || pl.fenced.IsZero() {
		return nil
	}
	is := &health.Issue{Status: health.Inaccessible, Reason: health.ReasonNodeFenced, Message: fmt.Sprintf(
		"node %s could not renew its lease in pool %s for %s and fenced itself off at %s (%s): the volume's loop device takes no I/O any more, and another node may have the volume; unstage it (delete the pod)",
		k.deps.NodeID, p.Name(), k.timing.Duration, pl.fenced.Format(time.RFC3339), pl.fenceCause)}
	if pl.fence.failedClosed {
		is.Reason = health.ReasonFenceFailedClosed
		is.Message += fmt.Sprintf("; the fence failed closed: this node's records name read-write stages of volume(s) %s whose loop devices it did not find, so it fenced every device it could not rule out (%s); check the node",
			strings.Join(pl.fence.unmatched, ", "), strings.Join(pl.fence.devices, ", "))
	}
	return is
}

// FencedPools describes, for NodeGetStorageHealth, the pools this node fenced
// itself off, and separately those whose fence failed closed.
func (k *Keeper) FencedPools() (fenced, failedClosed []string) {
	if k == nil {
		return nil, nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for name, pl := range k.pools {
		switch {
		case pl.fenced.IsZero():
		case pl.fence.failedClosed:
			failedClosed = append(failedClosed, fmt.Sprintf("pool %s: node %s fenced itself off at %s and failed closed: its records name read-write stages of %s whose loop devices it did not find; it fenced every device it could not rule out (%s)",
				name, k.deps.NodeID, pl.fenced.Format(time.RFC3339), strings.Join(pl.fence.unmatched, ", "), strings.Join(pl.fence.devices, ", ")))
		default:
			fenced = append(fenced, fmt.Sprintf("pool %s: node %s could not renew its lease and fenced itself off at %s (loop devices %s)",
				name, k.deps.NodeID, pl.fenced.Format(time.RFC3339), strings.Join(pl.fence.matched, ", ")))
		}
	}
	sort.Strings(fenced)
	sort.Strings(failedClosed)
	return fenced, failedClosed
}

// LeaseState is this node's lease in one pool, for metrics.
type LeaseState struct {
	Pool string
	// Age is how long ago the last successful renewal started (-1: never).
	Age    time.Duration
	Fenced bool
	// FailedClosed: the fence did not find the loop device of a read-write
	// stage this node's records hold in the pool (or could not read them),
	// and fenced every device it could not rule out. An alarm.
	FailedClosed bool
}

// States reports this node's leases, by pool name.
func (k *Keeper) States() []LeaseState {
	if k == nil {
		return nil
	}
	ls := k
	ls.mu.Lock()
	defer ls.mu.Unlock()
	out := make([]LeaseState, 0, len(ls.pools))
	for name, pl := range ls.pools {
		age := time.Duration(-1)
		if !pl.last.IsZero() {
			age = ls.now().Sub(pl.last)
		}
		out = append(out, LeaseState{Pool: name, Age: age, Fenced: !pl.fenced.IsZero(), FailedClosed: pl.fence.failedClosed})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pool < out[j].Pool })
	return out
}

// Verdict is the controller's verdict on node's lease in p, from what
// it reads now and what it saw before. staged: the node still holds a
// read-write stage record of the volume at stake, so a released lease proves
// nothing (lease.Observer.Observe). A damaged record is waited for, as for
// the longest lease; only a pool that cannot be read is an error.
func (k *Keeper) Verdict(p *pool.Pool, node string, staged bool) (lease.Verdict, error) {
	rec, ok, err := p.Leases().Read(node)
	if err != nil {
		return lease.Verdict{}, err
	}
	return k.observer.Observe(p.Name(), node, rec, ok, k.timing, staged), nil
}
