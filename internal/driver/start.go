package driver

import (
	"context"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// The start-up passes: what a restarted process must do in each pool before
// the pool serves a call (the node's registration, quota detection, the
// thaw of what a crash left frozen, the I/O limits' publications found
// again). Each pool gets them on a goroutine of its own, once it answers, and
// is held (poolset.Hold: its calls wait for them at most the lease margin,
// then answer UNAVAILABLE) until they have run.
// The server answers once the passes of every pool that opened at start have
// run, or after one start wait (Options.StartWait) at the latest; a pool
// whose open is still pending (its filesystem hangs) or failed is not waited
// for at all. So a pool that hangs costs the start the open's one wait, or
// one start wait if it hangs in the middle of a pass, and then holds up only
// itself. The lease keeper does not wait for any of this (it is its own
// stage, docs/fencing.md).

// poolRetry is how often a pool that is not available yet (its open failed,
// or its filesystem answered with an error) is looked at again for its
// start-up passes.
const poolRetry = time.Second

// maxStartWait bounds the default start wait (Options.StartWait).
const maxStartWait = 5 * time.Second

// startWait is how long Serve waits for the pools' start-up passes before it
// answers: Options.StartWait, else a quarter of the lease margin, at most
// maxStartWait (the pools' open wait at start).
func (d *core) startWait() time.Duration {
	if d.opts.StartWait > 0 {
		return d.opts.StartWait
	}
	return max(min(d.opts.Lease.Margin/4, maxStartWait), 100*time.Millisecond)
}

// startup is one start's pool passes: which pools ran them within the
// start's wait (the crash thaw covers those at once, ThawAfterCrashOf) and
// which ran them later (each thaws its own before it is released).
type startup struct {
	d   *core
	ctx context.Context
	mu  sync.Mutex
	// started: the pools whose passes were started; running counts those
	// within the start's wait still running.
	started map[string]bool
	running int
	// closed: the start's wait is over; early are the pools whose passes
	// ran within it.
	closed bool
	early  []*pool.Pool
}

// startPools holds every pool the driver serves and starts each one's passes
// on its own goroutine; the share pools Recover serves later join through
// startPool (poolset.Deps.Recovered).
func (d *core) startPools(ctx context.Context) *startup {
	st := &startup{d: d, ctx: ctx, started: map[string]bool{}}
	d.starting.Store(st)
	for _, name := range d.pools.Names() {
		if p := d.pools.Pool(name); p != nil {
			d.pools.Hold(name)
			// A pool whose open is still pending, or failed, is not
			// waited for: its passes run when it answers.
			st.startPool(p, !p.OpenPending() && p.OpenError() == nil)
		}
	}
	return st
}

// startPool runs p's passes once on a goroutine of its own; p is held. The
// start waits for them (at most its wait) when wait is true.
func (st *startup) startPool(p *pool.Pool, wait bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.started[p.Name()] {
		return
	}
	st.started[p.Name()] = true
	counted := wait && !st.closed
	if counted {
		st.running++
	}
	go func() {
		st.run(st.ctx, p)
		if counted {
			st.mu.Lock()
			st.running--
			st.mu.Unlock()
		}
	}()
}

// run waits until p answers, runs its passes and releases it. When ctx ends
// first, p stays held: nothing serves any more.
func (st *startup) run(ctx context.Context, p *pool.Pool) {
	d := st.d
	log := klog.FromContext(ctx).WithValues("pool", p.Name())
	if d.beforePasses != nil {
		d.beforePasses(ctx, p)
	}
	if p.OpenPending() {
		select {
		case <-p.Opened():
		case <-ctx.Done():
			return
		}
	}
	// Check lays the pool out once it answers (a mount that landed, a
	// pool.json repaired); a filesystem that hangs costs it one open wait.
	_ = wait.PollUntilContextCancel(ctx, poolRetry, true, func(context.Context) (bool, error) {
		return p.Check() == nil, nil
	})
	if ctx.Err() != nil {
		return
	}
	d.detectQuota(ctx, p)
	if d.opts.Mode.node() {
		d.registerPool(ctx, p)
		// Before the pool serves any publish: a restarted node plugin
		// knows its pods again only from the mount table.
		d.throttle.RebuildPool(ctx, p)
	}
	st.mu.Lock()
	late := st.closed
	if !late {
		st.early = append(st.early, p)
	}
	st.mu.Unlock()
	if late {
		// The start's crash thaw did not cover this pool: its own, now,
		// before any call (or a freeze request) reaches it.
		d.freezes.ThawPool(ctx, p)
		log.Info("Pool answered after the start: its start-up passes have run, it serves now")
	}
	d.pools.Release(p.Name())
}

// startPoll is how often await looks whether every pool's passes have run.
const startPoll = 10 * time.Millisecond

// await waits for the passes of the pools started so far, at most until
// deadline, then closes the start: a pool whose passes run later thaws on
// its own (ThawPool). It returns the pools whose passes ran by then and the
// names of those left held.
func (st *startup) await(ctx context.Context, deadline time.Time) (early []*pool.Pool, left []string) {
	wctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	_ = wait.PollUntilContextCancel(wctx, startPoll, true, func(context.Context) (bool, error) {
		st.mu.Lock()
		defer st.mu.Unlock()
		return st.running == 0, nil
	})
	st.mu.Lock()
	defer st.mu.Unlock()
	st.closed = true
	for name := range st.started {
		if !slices.ContainsFunc(st.early, func(p *pool.Pool) bool { return p.Name() == name }) {
			left = append(left, name)
		}
	}
	slices.Sort(left)
	return slices.Clone(st.early), left
}

// recovered is poolset.Deps.Recovered: a share's pool Recover served, held,
// gets its passes like the configured pools.
func (d *core) recovered(p *pool.Pool) {
	if st := d.starting.Load(); st != nil {
		st.startPool(p, true)
		return
	}
	d.pools.Release(p.Name())
}

// startPasses is Serve's start: every pool held and its passes started, the
// shares mounted before a restart served again (Recover, whose pools join
// as they come), then at most one start wait for all of them. The crash thaw
// of the pools whose passes ran by then starts in the background
// (ThawAfterCrashOf, with what this node's own records say it froze); the
// other pools run theirs when they answer, and are held until then.
func (d *core) startPasses(ctx context.Context) {
	start := time.Now()
	deadline := start.Add(d.startWait())
	st := d.startPools(ctx)
	recovered := make(chan struct{})
	go func() {
		defer close(recovered)
		d.pools.Recover(ctx)
	}()
	wctx, cancel := context.WithDeadline(ctx, deadline)
	select {
	case <-recovered:
	case <-wctx.Done():
	}
	cancel()
	early, left := st.await(ctx, deadline)
	d.freezes.ThawAfterCrashOf(ctx, early)
	log := klog.FromContext(ctx)
	if len(left) > 0 {
		log.Info("Serving before the start-up passes of some pools ran (their filesystem has not answered): their calls wait for them at most the lease margin, then answer UNAVAILABLE", "pools", left, "waited", time.Since(start).Round(time.Millisecond).String())
		return
	}
	log.V(2).Info("Start-up passes done", "after", time.Since(start).Round(time.Millisecond).String())
}

// detectQuota runs quota detection for p, so the log says at once what its
// dir volumes get, waiting for it at most one start wait: detection holds one
// lock for every pool (layout.Deps.QuotaFor), so a pool that hangs in it
// would hold up the passes of the others. Nothing is lost by not waiting: a
// dir volume's create detects again what is not known.
func (d *core) detectQuota(ctx context.Context, p *pool.Pool) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := d.QuotaFor(ctx, p); err != nil {
			klog.FromContext(ctx).V(2).Info("Quota detection postponed", "pool", p.Name(), "err", err)
		}
	}()
	t := time.NewTimer(d.startWait())
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		klog.FromContext(ctx).Info("Quota detection still under way; the pool serves without waiting for it (a dir volume's create detects it)", "pool", p.Name(), "waited", d.startWait().String())
	case <-ctx.Done():
	}
}
