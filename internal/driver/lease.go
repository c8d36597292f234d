package driver

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

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/nodestate"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Node leases in shared pools (docs/fencing.md). A node plugin renews its lease
// in every shared pool it serves; one that cannot renew for the lease's
// duration fences itself: every loop device backed by an image of that pool
// stops taking I/O, for good. A controller asked to take an image volume away
// from a node that still has it staged read-write (Kubernetes' force-detach,
// after the out-of-service taint) waits until that node's lease has expired by
// its own clock, so the volume reaches another node only after the first one
// has fenced itself, whether it died or is cut off and still running.

// leases is the driver's lease state.
type leases struct {
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
	// repair removes a damaged lease entry of this node (pool.RepairLease).
	repair func(p *pool.Pool, node string) error
}

// poolLease is this node's lease in one pool.
type poolLease struct {
	first    time.Time // when this process first tried to renew it
	last     time.Time // the start of the last renewal that succeeded (zero: none)
	counter  uint64
	inFlight bool
	started  time.Time // when the renewal under way (inFlight) began
	lastErr  error
	fenced   time.Time // when it fenced itself (zero: not)
	// fenceCause says why the renewals failed, for the health reason.
	fenceCause string
	// fence is what the fence found and did (planFence).
	fence fencePlan
}

func newLeases(t lease.Timing) *leases {
	var b [8]byte
	_, _ = rand.Read(b[:])
	ls := &leases{
		timing: t, instance: hex.EncodeToString(b[:]),
		pools: map[string]*poolLease{}, now: time.Now,
		write:  func(p *pool.Pool, l pool.Lease) error { return p.WriteLease(l) },
		repair: func(p *pool.Pool, node string) error { return p.RepairLease(node) },
	}
	ls.observer = lease.NewObserverClock(func() time.Time { return ls.now() })
	ls.peers = newPeerWatch(func() time.Time { return ls.now() })
	return ls
}

func (ls *leases) state(name string) *poolLease {
	pl, ok := ls.pools[name]
	if !ok {
		pl = &poolLease{first: ls.now()}
		ls.pools[name] = pl
	}
	return pl
}

// keepLeases renews this node's lease in every shared pool every interval and
// fences the pools it could not renew in time, until ctx ends; then it
// releases the leases of pools where this node holds no loop device.
func (d *Driver) keepLeases(ctx context.Context) {
	if ok, kernel := mount.FenceHolds(); !ok && len(d.sharedPools()) > 0 {
		klog.FromContext(ctx).Error(nil, "This kernel lets I/O through to a loop device of size zero, which the self-fence relies on (Linux 6.5 and later refuse it): a node cut off from a shared pool cannot stop its pods' writes; do not force-detach volumes of a running node", "kernel", kernel)
	}
	if g := d.opts.StartupFence; g != nil {
		// This process's time without a renewal counts from its start,
		// not from here: a start that hung on a pool must not delay the
		// fence.
		d.startLeases(ctx, g.at)
		g.Started()
	}
	// On its own: with many stale records, or a hung backing file anywhere
	// on the node, the pass takes longer than half the margin, and the fence
	// must not wait behind it (a fence that runs first and meets a stale
	// record fails closed: it fences more, never less).
	go d.dropStaleRecords(ctx)
	for _, p := range d.sharedPools() {
		go d.adoptDevices(ctx, p) // on its own: a pool may hang
	}
	t := d.leases.timing
	renew := time.NewTicker(t.Interval)
	defer renew.Stop()
	watch := time.NewTicker(min(time.Second, t.Interval/2))
	defer watch.Stop()
	d.renewAll(ctx)
	for {
		select {
		case <-ctx.Done():
			d.releaseLeases()
			return
		case <-renew.C:
			d.renewAll(ctx)
		case <-watch.C:
			d.fenceExpired(ctx)
		}
	}
}

// startLeases makes this process's time without a renewal count from at, its
// start (StartupFence), for the pools it answers for at start: those it
// serves now and those its stage records name (their devices may be an
// earlier process's). A pool added later (a share's) counts from when it is
// added: counted from the start, it would fence at the first tick after half
// the margin, with nothing staged yet, and stay fenced for nothing.
func (d *Driver) startLeases(ctx context.Context, at time.Time) {
	var names []string
	for _, p := range d.sharedPools() {
		names = append(names, p.Name())
	}
	recorded, err := d.recordedPools(false)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading this node's stage records for the pools it answers for at start")
	}
	ls := d.leases
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, name := range append(names, recorded...) {
		if pl := ls.state(name); at.Before(pl.first) {
			pl.first = at
		}
	}
}

// sharedPools are the pools this node keeps a lease in.
func (d *Driver) sharedPools() []*pool.Pool {
	var out []*pool.Pool
	for _, name := range d.names() {
		if p := d.pool(name); p != nil && p.Shared() {
			out = append(out, p)
		}
	}
	return out
}

// renewAll starts a renewal in every shared pool that has none under way: a
// renewal that hangs (a pool whose filesystem stopped answering) holds up
// nothing but itself.
func (d *Driver) renewAll(ctx context.Context) {
	for _, p := range d.sharedPools() {
		d.renewAsync(ctx, p, nil)
	}
}

// renewAsync starts one renewal of p unless one is under way; done, if not
// nil, gets its outcome (or the one under way's, ErrBusy).
func (d *Driver) renewAsync(ctx context.Context, p *pool.Pool, done chan<- error) {
	ls := d.leases
	ls.mu.Lock()
	pl := ls.state(p.Name())
	if pl.inFlight {
		ls.mu.Unlock()
		if done != nil {
			done <- fmt.Errorf("%w: a renewal of the lease in pool %s is still under way", pool.ErrBusy, p.Name())
		}
		return
	}
	pl.inFlight = true
	rec := pool.Lease{Node: d.opts.NodeID, Instance: ls.instance, Counter: pl.counter + 1, DurationSeconds: int64(ls.timing.Duration / time.Second)}
	start := ls.now()
	pl.started = start
	write, repair := ls.write, ls.repair
	ls.mu.Unlock()
	go func() {
		err := write(p, rec)
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
		if err != nil {
			klog.FromContext(ctx).Error(err, "Renewing this node's lease failed", "pool", p.Name(), "cause", renewalCause(err).String())
		}
		if done != nil {
			done <- err
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

// fenceExpired fences every pool whose lease this node has not renewed for the
// lease's duration. That includes the pools this node's records name
// read-write stages of but that it does not serve (a share whose mount was
// gone when this process started is never served, yet its devices may still
// write): never renewed, they fence after the startup allowance.
func (d *Driver) fenceExpired(ctx context.Context) {
	ls := d.leases
	var names []string
	for _, p := range d.sharedPools() {
		names = append(names, p.Name())
	}
	recorded, err := d.recordedPools(true)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading this node's stage records for the pools it does not serve")
	}
	for _, name := range recorded {
		if d.pool(name) == nil && !slices.Contains(names, name) {
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
			d.fence(ctx, name, pl, at, since, lastErr)
		}
	}
}

// since is when pl's time without a renewal counts from, for the fence.
// Callers hold ls.mu.
func (ls *leases) since(pl *poolLease) time.Time {
	if pl.last.IsZero() {
		// Never renewed by this process. Its devices may be a previous
		// process's, whose last renewal this one cannot know: it gives
		// itself half the margin to renew, so that a restart within the
		// lease's duration still fences before any reader's expiry.
		return pl.first.Add(min(ls.timing.Margin/2, ls.timing.Duration) - ls.timing.Duration)
	}
	return pl.last
}

// lost tells whether this node's lease in pool name is fenced or past its
// duration (the fence is due): a device attached now may have been missed
// by the fence's enumeration. A nil ls (no leases) loses nothing.
func (ls *leases) lost(name string) bool {
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
func (d *Driver) fence(ctx context.Context, name string, pl *poolLease, at, since time.Time, cause error) {
	log := klog.FromContext(ctx).WithValues("node", d.opts.NodeID, "lastRenewal", since, "duration", d.leases.timing.Duration)
	fencePool(klog.NewContext(ctx, log), &d.layoutDeps, name, min(identifyWait, d.leases.timing.Margin/4), cause, func(plan fencePlan) {
		d.leases.mu.Lock()
		if pl.fenced.Equal(at) {
			// Still this episode: a renewal may have ended it meanwhile.
			pl.fence = plan
		}
		d.leases.mu.Unlock()
	})
}

// StartupFence covers the start of a node plugin, before its lease keeper
// runs: opening a pool whose filesystem hangs hangs the start itself, and a
// process that never reaches its lease keeper would never fence. Unless
// Started is called first, it fences at half the margin after it was made
// (when a started node plugin that cannot renew fences) every pool this
// node's records name, from the records alone: the previous process's last
// renewal cannot be known.
type StartupFence struct {
	at      time.Time
	started chan struct{}
	once    sync.Once
}

// NewStartupFence starts the guard over the records in state, with the
// node's lease timing t.
func NewStartupFence(ctx context.Context, state *nodestate.Store, t lease.Timing) *StartupFence {
	g := &StartupFence{at: time.Now(), started: make(chan struct{})}
	go func() {
		select {
		case <-g.started:
			return
		case <-ctx.Done():
			return
		case <-time.After(min(t.Margin/2, t.Duration)):
		}
		deps := &layoutDeps{state: state, loops: new(mount.Loops)}
		keys, err := state.Keys(stagesKind)
		if err != nil {
			klog.FromContext(ctx).Error(err, "The node plugin has not started its lease keeper within half the lease margin and cannot read its stage records to fence")
		}
		var pools []string
		for _, k := range keys {
			var r stageRecord
			if ok, err := state.Get(stagesKind, k, &r); err == nil && ok && !slices.Contains(pools, r.Pool) {
				pools = append(pools, r.Pool)
			}
		}
		for _, name := range pools {
			fencePool(ctx, deps, name, min(identifyWait, t.Margin/4),
				errors.New("the node plugin has not started its lease keeper within half the lease margin (a pool that hangs at start), so it cannot renew"), nil)
		}
	}()
	return g
}

// Started tells the guard the lease keeper runs; nil does nothing.
func (g *StartupFence) Started() {
	if g != nil {
		g.once.Do(func() { close(g.started) })
	}
}

// fencePool fences pool name off this node, from the node's records and the
// kernel's loop devices (planFence), waiting at most wait for the kernel to
// identify them; planned gets the plan before any device is fenced.
func fencePool(ctx context.Context, deps *layoutDeps, name string, wait time.Duration, cause error, planned func(fencePlan)) {
	log := klog.FromContext(ctx).WithValues("pool", name)
	recs, rerr := deps.poolRecords(name)
	if rerr != nil {
		log.Error(rerr, "Reading this node's stage records for the fence: failing closed")
	}
	devs, lerr := deps.loops.List(wait)
	if lerr != nil {
		rerr = errors.Join(rerr, lerr)
	}
	plan := planFence(devs, recs, deps.poolDevs(name), rerr != nil)
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
	for _, dev := range plan.devices {
		// Each on its own: the kernel flushes what a device has queued
		// before it changes it, which on a hung filesystem waits for it.
		go func() {
			if err := deps.loops.Fence(dev); err != nil {
				log.Error(err, "Fencing a loop device failed", "device", dev)
				return
			}
			log.Info("Fenced a loop device", "device", dev)
		}()
	}
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

// fenceIfTaken fences this node's loop device of an image volume of a shared
// pool whose records no longer name this node: a controller force-detached
// the volume while this node was cut off or down (its lease expired), and
// another node may have it now. A node that comes back with the volume still
// staged (a kernel that kept its mounts, a node plugin that was down) must
// not let anything of its own reach the image again; unmounting the
// filesystem on it would write its journal and superblock into an image that
// another node has mounted. An unreadable record fences nothing here: the
// lease's own fence covers a pool that does not answer.
func (d *Driver) fenceIfTaken(ctx context.Context, p *pool.Pool, vid pool.VolumeID, image, staging string) error {
	if !p.Shared() {
		return nil
	}
	v, err := p.Load(vid)
	if err != nil || v.Layout != pool.LayoutImage {
		return nil
	}
	for _, s := range v.Staged {
		if s.Node == d.opts.NodeID {
			return nil
		}
	}
	dev, err := d.stageDevice(staging, image)
	if err != nil || dev == "" {
		return err
	}
	if fenced, err := d.loops.Fenced(dev); err == nil && fenced {
		return nil
	}
	klog.FromContext(ctx).Info("Fencing the loop device of a volume this node no longer holds before unmounting it: a controller force-detached it from this node, and another node may have it", "volume", vid, "device", dev)
	if err := d.loops.Fence(dev); err != nil {
		return failf(pool.ErrUnavailable, "fencing %s, the loop device of volume %s that another node may hold, before unmounting it: %w", dev, vid, err)
	}
	return nil
}

// dropStaleStage clears, before a stage that has just claimed a shared pool's
// image volume for this node, whatever this node still has of an earlier stage
// of it: a loop device attached before this node held a stage record can only
// be left by a stage whose record a controller dropped (a force-detach while
// this node was silent), or by a stage that failed half way. Its filesystem's
// view of the image is stale (another node may have written since), so the
// device is fenced, the staging path unmounted if it shows that device, and
// the device detached if nothing else mounts it; the stage then starts anew.
// Reusing it would serve a stale page cache and write it back over the other
// node's data.
func (d *Driver) dropStaleStage(ctx context.Context, nv nodeVolume, staging string, readOnly bool) error {
	// A read-only stage writes nothing back; on one machine running two node
	// plugins (the tests) the device it finds is the other node's read-only one.
	if readOnly || !nv.pool.Shared() || nv.vol.Layout != pool.LayoutImage {
		return nil
	}
	image := nv.pool.ImagePath(nv.id)
	dev, err := d.stageDevice(staging, image)
	if err != nil || dev == "" {
		return err
	}
	log := klog.FromContext(ctx).WithValues("volume", nv.id, "device", dev, "path", staging)
	log.Info("A loop device of the volume was attached on this node before this stage claimed it (a stage a controller force-detached, or one that failed half way): fencing it and staging anew")
	if err := d.loops.Fence(dev); err != nil {
		return failf(pool.ErrUnavailable, "fencing %s, a stale loop device of volume %s: %w", dev, nv.id, err)
	}
	if info, mounted, err := d.mounts.Info(staging); err == nil && mounted && d.loops.Backs(info.Source, image) {
		if err := d.mounts.UnmountChecked(ctx, staging, d.onlyVolume(nv.pool, nv.id, "staging path", staging)); err != nil {
			return fmt.Errorf("unmount the stale stage at %s: %w", staging, err)
		}
	}
	// Detaches the fenced device once nothing mounts it (the publish targets
	// of the stale stage's pods may still: kubelet unmounts those, and a
	// later unstage detaches it).
	if err := d.loops.Detach(ctx, image); err != nil {
		log.Error(err, "Detaching the stale loop device")
	}
	return nil
}

// stageDevice is the loop device of this node's stage of image at staging: the
// one whose filesystem the staging path shows, or, where nothing is mounted
// there (a block stage, or an unstage retried after its unmount), the image's
// device if nothing mounts it. A device of the image mounted elsewhere is not
// this stage's: on one machine running two node plugins (the tests), it is the
// other node's, which must not be fenced for this one.
func (d *Driver) stageDevice(staging, image string) (string, error) {
	if info, mounted, err := d.mounts.Info(staging); err == nil && mounted {
		if d.loops.Backs(info.Source, image) {
			return info.Source, nil
		}
		return "", nil
	}
	dev, found, err := d.attachedDevice(image)
	if err != nil {
		return "", err
	}
	if !found {
		return "", nil
	}
	if mps, err := d.mounts.MountPoints(dev); err != nil || len(mps) > 0 {
		return "", nil
	}
	return dev, nil
}

// releaseLeases marks released the leases of the pools where this node holds
// no loop device by its own records (a record goes only once the kernel shows
// its device detached): a controller may then take their volumes at once. A
// node that still holds one, or cannot read its records, leaves its lease to
// expire.
func (d *Driver) releaseLeases() {
	ls := d.leases
	for _, p := range d.sharedPools() {
		ls.mu.Lock()
		pl := ls.state(p.Name())
		renewed := !pl.last.IsZero() && pl.fenced.IsZero()
		ls.mu.Unlock()
		if !renewed {
			continue
		}
		if recs, err := d.poolRecords(p.Name()); err != nil || len(recs) > 0 {
			continue
		}
		rec := pool.Lease{Node: d.opts.NodeID, Instance: ls.instance, Counter: pl.counter + 1, DurationSeconds: int64(ls.timing.Duration / time.Second), Released: true}
		done := make(chan error, 1)
		go func() { done <- ls.write(p, rec) }()
		select {
		case err := <-done:
			if err != nil {
				klog.ErrorS(err, "Releasing this node's lease", "pool", p.Name())
			}
		case <-time.After(2 * time.Second):
		}
	}
}

// ensureLease makes sure this node's lease in p is fresh enough to take a
// volume read-write: renewed within half its duration and not fenced; if it
// is not, it renews it now, within ctx.
func (d *Driver) ensureLease(ctx context.Context, p *pool.Pool) error {
	if d.leases == nil || !p.Shared() {
		return nil
	}
	ls := d.leases
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
	d.renewAsync(ctx, p, done)
	select {
	case err := <-done:
		if err != nil {
			return failf(pool.ErrUnavailable, "node %s cannot renew its lease in pool %s, so it would not be fenced if cut off: not taking a volume read-write: %w", d.opts.NodeID, p.Name(), err)
		}
		ls.mu.Lock()
		fenced := !pl.fenced.IsZero()
		ls.mu.Unlock()
		if fenced {
			return failf(pool.ErrUnavailable, "node %s fenced itself off pool %s and has not renewed its lease since: not taking a volume read-write", d.opts.NodeID, p.Name())
		}
		return nil
	case <-ctx.Done():
		return failf(pool.ErrUnavailable, "node %s: renewing its lease in pool %s did not finish in time: %w", d.opts.NodeID, p.Name(), ctx.Err())
	}
}

// fencedIssue is the node-side health of a volume of a pool this node has
// fenced itself off, nil if it has not.
func (d *Driver) fencedIssue(p *pool.Pool) *health.Issue {
	if d.leases == nil || !p.Shared() {
		return nil
	}
	d.leases.mu.Lock()
	defer d.leases.mu.Unlock()
	pl, ok := d.leases.pools[p.Name()]
	if !ok || pl.fenced.IsZero() {
		return nil
	}
	is := &health.Issue{Status: health.Inaccessible, Reason: health.ReasonNodeFenced, Message: fmt.Sprintf(
		"node %s could not renew its lease in pool %s for %s and fenced itself off at %s (%s): the volume's loop device takes no I/O any more, and another node may have the volume; unstage it (delete the pod)",
		d.opts.NodeID, p.Name(), d.leases.timing.Duration, pl.fenced.Format(time.RFC3339), pl.fenceCause)}
	if pl.fence.failedClosed {
		is.Reason = health.ReasonFenceFailedClosed
		is.Message += fmt.Sprintf("; the fence failed closed: this node's records name read-write stages of volume(s) %s whose loop devices it did not find, so it fenced every device it could not rule out (%s); check the node",
			strings.Join(pl.fence.unmatched, ", "), strings.Join(pl.fence.devices, ", "))
	}
	return is
}

// fencedPools describes, for NodeGetStorageHealth, the pools this node fenced
// itself off, and separately those whose fence failed closed.
func (d *Driver) fencedPools() (fenced, failedClosed []string) {
	if d.leases == nil {
		return nil, nil
	}
	d.leases.mu.Lock()
	defer d.leases.mu.Unlock()
	for name, pl := range d.leases.pools {
		switch {
		case pl.fenced.IsZero():
		case pl.fence.failedClosed:
			failedClosed = append(failedClosed, fmt.Sprintf("pool %s: node %s fenced itself off at %s and failed closed: its records name read-write stages of %s whose loop devices it did not find; it fenced every device it could not rule out (%s)",
				name, d.opts.NodeID, pl.fenced.Format(time.RFC3339), strings.Join(pl.fence.unmatched, ", "), strings.Join(pl.fence.devices, ", ")))
		default:
			fenced = append(fenced, fmt.Sprintf("pool %s: node %s could not renew its lease and fenced itself off at %s (loop devices %s)",
				name, d.opts.NodeID, pl.fenced.Format(time.RFC3339), strings.Join(pl.fence.matched, ", ")))
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

// LeaseStates reports this node's leases, by pool name.
func (d *Driver) LeaseStates() []LeaseState {
	if d.leases == nil {
		return nil
	}
	ls := d.leases
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

// leaseVerdict is the controller's verdict on node's lease in p, from what
// it reads now and what it saw before. staged: the node still holds a
// read-write stage record of the volume at stake, so a released lease proves
// nothing (lease.Observer.Observe). A damaged record is waited for, as for
// the longest lease; only a pool that cannot be read is an error.
func (d *Driver) leaseVerdict(p *pool.Pool, node string, staged bool) (lease.Verdict, error) {
	rec, ok, err := p.ReadLease(node)
	if err != nil {
		return lease.Verdict{}, err
	}
	return d.leases.observer.Observe(p.Name(), node, rec, ok, d.leases.timing, staged), nil
}

// writers are the nodes holding an image volume staged read-write.
func writers(v *pool.Volume, node string) []string {
	var out []string
	for _, s := range v.Staged {
		if !s.ReadOnly && (node == "" || s.Node == node) {
			out = append(out, s.Node)
		}
	}
	return out
}

// forceDetachable decides whether the records of nodes that still have image
// volume v staged read-write may go (a force-detach: the node never unstaged):
// only once each one's lease has expired. It returns the retryable error to
// answer meanwhile.
func (d *Driver) forceDetachable(p *pool.Pool, v *pool.Volume, nodes []string) error {
	var waits []string
	for _, n := range nodes {
		// Every node here holds a read-write stage record of v.
		verdict, err := d.leaseVerdict(p, n, true)
		if err != nil {
			return fmt.Errorf("volume %s is staged read-write on node %s, whose lease cannot be read: %w", v.ID, n, err)
		}
		if !verdict.Expired {
			waits = append(waits, fmt.Sprintf("%s (%s more: %s)", n, verdict.Wait.Round(time.Second), verdict.Why))
		}
	}
	if len(waits) > 0 {
		return failf(pool.ErrUnavailable, "volume %s is still staged read-write on node(s) %s, which never unstaged it; it goes to another node only once their lease in pool %s has expired by this controller's clock, so that a node that is still running has fenced itself off first (docs/fencing.md): retry later",
			v.ID, strings.Join(waits, "; "), p.Name())
	}
	return nil
}
