package freeze

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// The node's side of freezing across nodes (coordinator.go): an agent reads this
// node's inbox in every pool, freezes the volume a request names on the
// node's own mount of it, answers, and thaws when the request goes or its
// bound has passed.
//
// The pool is hostile: anyone on any node may write it. So nothing a pool
// record says is opened as a path. The node finds the volume's filesystem
// itself (ownDevice, FreezeVolumeHere): in a shared pool the loop device its
// own stage records name for the volume and the kernel shows holding the
// recorded file (never the device the pool's image path resolves to: a
// writer may make that a link to another image attached here), that
// device's mounts in the kernel's table, and of those a mount root
// opened once below --allowed-path-prefix without following links and
// checked on its descriptor, which is the descriptor frozen and thawed. What
// a restart must thaw is written in this node's own records (nodestate),
// never read from a pool. A freeze's thaw is armed before the freeze and
// does nothing a frozen filesystem could block, and each volume has a budget
// of frozen time whatever the requests say (allowance), kept by the
// identity of the device's backing file, so that no alias of a volume gets
// a budget of its own.

// RecordKind is the node-local records of freezes (nodestate), by volume ID:
// written before a freeze, removed after its thaw, read by the next start.
const RecordKind = "freezes"

// Record is what a node froze: the mount root and the loop device whose
// filesystem it is.
type Record struct {
	Volume string `json:"volume"`
	Path   string `json:"path"`
	Device string `json:"device"`
}

// DefaultRecoveryTimeout bounds how long a start waits for the thaws of
// what a crashed process left frozen before it lets the freeze agent work (it
// never holds up serving: the recovery runs in the background).
const DefaultRecoveryTimeout = 30 * time.Second

// The holders under which the agent and the recovery take a volume's
// in-process lock (internal/driver/request.go lists them).
const (
	HolderFreeze = "a freeze for a snapshot"
	HolderThaw   = "a thaw after a crash"
)

// Deps is what freezes act through.
type Deps struct {
	// NodeID is this node's name in the pools' inboxes and stage records.
	NodeID string
	// Node is this node's kernel (mounts, loop devices, filesystems), its
	// stage records and its own record store, and the allowed path prefix.
	Node *layout.Deps
	// Names lists every pool this node serves, and Pool returns one by name
	// (nil if none).
	Names func() []string
	Pool  func(name string) *pool.Pool
	// Lock takes a volume's in-process lock as a call of holder would,
	// failing at once when it is held.
	Lock func(volume, holder string) (release func(), err error)
	// Verdict is the controller's verdict on node's lease in p
	// (fence.Keeper.Verdict): a node that does not answer is passed over only
	// if it has fenced itself.
	Verdict func(p *pool.Pool, node string, staged bool) (lease.Verdict, error)
	// NodePlugin: this process serves the node service, so it sees this
	// node's mounts, freezes them itself and runs the agent.
	NodePlugin bool
}

// Freezer freezes image volumes' filesystems for consistent copies: the
// controller's side (coordinator.go: Quiesce, QuiesceAll), the node's agent
// that answers other controllers' requests (Run, Tick), and the thaw of what
// a crash left frozen (recover.go: ThawAfterCrash).
type Freezer struct {
	deps Deps
	// Timing is the schedule; tests shorten it.
	Timing Timing
	// RecoveryTimeout is how long ThawAfterCrash's thaws may take before the
	// agent starts all the same (DefaultRecoveryTimeout).
	RecoveryTimeout time.Duration
	// Now is the agent's clock; tests replace it. Only differences of its
	// readings matter.
	Now func() time.Time

	mu   sync.Mutex
	held map[string]*heldFreeze // by volume ID
	// groups are the holds of groups across nodes, by group ID (grouphold.go).
	groups map[string]*groupHold
	// spent are the holds of each device that ended within the last hour,
	// oldest first, by the identity of its backing file (ownDevice): the
	// budget (allowance).
	spent map[string][]span
	// warned holds the inbox entries already reported as unusable, so a
	// planted file is logged once, not every poll.
	warned map[string]bool
	// recovered is closed once the thaws after a crash are done (or given
	// up): no freeze begins before, so a recovery's thaw never ends a new
	// freeze.
	recovered chan struct{}
}

// New returns a Freezer over deps, with schedule t, holding nothing.
func New(deps Deps, t Timing) *Freezer {
	done := make(chan struct{})
	close(done)
	return &Freezer{deps: deps, Timing: t, RecoveryTimeout: DefaultRecoveryTimeout, Now: time.Now,
		held: map[string]*heldFreeze{}, groups: map[string]*groupHold{}, spent: map[string][]span{}, warned: map[string]bool{}, recovered: done}
}

// span is a stretch of time a volume was frozen, by the agent's clock.
type span struct{ start, end time.Time }

// heldFreeze is a filesystem this node froze for a request.
type heldFreeze struct {
	pool *pool.Pool
	id   pool.VolumeID
	// key is the frozen device's budget key (ownDevice).
	key   string
	nonce string
	local *localHold
	since time.Time
	// bound is how long the hold may last: the thaw armed with the freeze
	// fires then; the agent thaws one poll before, writing "thawed" first.
	bound   time.Duration
	release func() // the volume's in-process lock, held while frozen
}

// localHold is a freeze of a volume's filesystem on this node.
type localHold struct {
	id        pool.VolumeID
	path, dev string
	fs        mount.FrozenFS
}

// Recovered tells whether no thaw after a crash is pending any more.
func (f *Freezer) Recovered() bool {
	f.mu.Lock()
	ch := f.recovered
	f.mu.Unlock()
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// ownDevice is the loop device of volume id of p that this node attached, and
// the identity of its backing file as the kernel keeps it (dev:ino), the key
// of the device's freeze budget; dev is "" when there is none. In a shared
// pool anyone may make the volume's image a link (symbolic or hard) to
// another image attached here, so the device comes from this node's own
// stage records, and only while the kernel shows it holding the recorded
// file; the pool's image path is not used. A local pool is written by this
// node's driver alone and its stages are not recorded: its image path is
// used, and only for calls of this node's own CSI socket (the agent reads
// only shared pools' inboxes).
func (f *Freezer) ownDevice(p *pool.Pool, id pool.VolumeID) (dev, key string, err error) {
	devs, err := f.deps.Node.Loops.List(layout.IdentifyWait)
	if err != nil {
		return "", "", csierr.Failf(pool.ErrUnavailable, "list the loop devices: %w", err)
	}
	if p.Shared() {
		recs, err := f.deps.Node.VolumeRecords(id)
		if err != nil {
			return "", "", csierr.Failf(pool.ErrUnavailable, "read this node's stage records: %w", err)
		}
		for _, r := range recs {
			for _, ld := range devs {
				if r.Device != "" && ld.Device == r.Device && !ld.Fenced && r.Holds(ld) {
					return ld.Device, fmt.Sprintf("%d:%d", ld.Dev, ld.Ino), nil
				}
			}
		}
		return "", "", nil
	}
	dev, ok, err := f.deps.Node.AttachedDevice(p.ImagePath(id))
	if err != nil || !ok {
		return "", "", err
	}
	for _, ld := range devs {
		if ld.Device == dev && ld.Err == nil {
			return dev, fmt.Sprintf("%d:%d", ld.Dev, ld.Ino), nil
		}
	}
	return dev, dev, nil
}

// FreezeVolumeHere freezes the filesystem on dev, this node's loop device of
// volume id (ownDevice), as this node mounted it, for at most bound, and
// records the freeze in this node's own records first. why says, when h is
// nil and err is nil, why there is nothing here to freeze.
func (f *Freezer) FreezeVolumeHere(ctx context.Context, id pool.VolumeID, dev string, bound time.Duration) (h *localHold, why string, err error) {
	if dev == "" {
		return nil, "no loop device this node staged the volume on", nil
	}
	points, err := f.deps.Node.Mounts.MountPoints(dev)
	if err != nil {
		return nil, "", fmt.Errorf("read the mount table: %w", err)
	}
	// A record there already is a crash's whose thaw has not run (or was
	// given up): its filesystem may still be frozen, and a failed freeze
	// (EBUSY on a frozen one) must leave it for the next start to thaw.
	var crashed Record
	hadRecord, err := f.deps.Node.State.Get(RecordKind, id.String(), &crashed)
	if err != nil {
		return nil, "", fmt.Errorf("read the volume's freeze record: %w", err)
	}
	var failed error
	for _, path := range points {
		// Recorded first: a crash of this process while frozen is thawed
		// at the next start (ThawAfterCrash).
		if err := f.deps.Node.State.Put(RecordKind, id.String(), Record{Volume: id.String(), Path: path, Device: dev}); err != nil {
			return nil, "", fmt.Errorf("record the freeze: %w", err)
		}
		fz, err := f.deps.Node.FS.FreezeMount(f.deps.Node.PathPrefix, path, dev, bound)
		if err == nil {
			return &localHold{id: id, path: path, dev: dev, fs: fz}, "", nil
		}
		if hadRecord {
			if err := f.deps.Node.State.Put(RecordKind, id.String(), crashed); err != nil {
				klog.FromContext(ctx).Error(err, "Restoring the freeze record of a crash failed", "volume", id)
			}
		} else {
			f.clearFreeze(ctx, id)
		}
		// A bind of a subdirectory or of the device node, a mount outside
		// the allowed prefix or reached through a link, one gone since the
		// table was read: not a place to freeze it from; the next may be.
		klog.FromContext(ctx).V(4).Info("Not freezing through this mount of the volume", "volume", id, "path", path, "err", err)
		if failed == nil && !errors.Is(err, mount.ErrNotTheMount) {
			failed = err
		}
	}
	if failed != nil {
		return nil, "", failed
	}
	return nil, "no mount of the volume's filesystem on this node", nil
}

// thawHere thaws a local hold (unless its bound did) and drops its record.
func (f *Freezer) thawHere(ctx context.Context, h *localHold) error {
	if err := h.fs.Thaw(); err != nil {
		return err
	}
	f.clearFreeze(ctx, h.id)
	return nil
}

// allowance is how long the device whose budget key is id (ownDevice) may be
// frozen now, or why not: after a hold it is not frozen again for as long as
// that hold lasted, and within any hour it is frozen for at most the budget.
// Requests cannot change either: a pool writer that rotates nonces, or names
// the device through other volumes, gets no more.
func (f *Freezer) allowance(id string, now time.Time, t Timing) (time.Duration, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, h := range f.held {
		if h.key == id {
			return 0, fmt.Sprintf("the volume's device is frozen already, for volume %s", h.id)
		}
	}
	var used time.Duration
	var keep []span
	for _, s := range f.spent[id] {
		if now.Sub(s.end) >= time.Hour {
			continue
		}
		keep = append(keep, s)
		start := s.start
		if now.Sub(start) > time.Hour {
			start = now.Add(-time.Hour)
		}
		used += s.end.Sub(start)
	}
	if len(keep) == 0 {
		delete(f.spent, id)
	} else {
		f.spent[id] = keep
		last := keep[len(keep)-1]
		if until := last.end.Add(last.end.Sub(last.start)); now.Before(until) {
			return 0, fmt.Sprintf("freeze budget: the volume was frozen for %s until %s ago, and is not frozen again for as long (retry in %s)",
				last.end.Sub(last.start).Round(time.Millisecond), now.Sub(last.end).Round(time.Millisecond), until.Sub(now).Round(time.Millisecond))
		}
	}
	bound := min(t.MaxHold, t.BudgetInForce()-used)
	if bound < 2*t.Poll {
		return 0, fmt.Sprintf("freeze budget: the volume was frozen for %s within the last hour, the most this node allows (%s); retry later",
			used.Round(time.Millisecond), t.BudgetInForce())
	}
	return bound, ""
}

// spend counts a hold against its volume's budget.
func (f *Freezer) spend(id string, start, end time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.spent[id] = append(f.spent[id], span{start, end})
}

// Run answers freeze requests every poll interval until ctx ends,
// then thaws whatever it still holds.
func (f *Freezer) Run(ctx context.Context) error {
	// The first reading one interval after the start, then every interval.
	t := time.NewTimer(f.Timing.Poll)
	select {
	case <-ctx.Done():
	case <-t.C:
		wait.UntilWithContext(ctx, f.Tick, f.Timing.Poll)
	}
	t.Stop()
	f.thawAllHeld(klog.NewContext(context.Background(), klog.FromContext(ctx)), "the node plugin stopped")
	f.endAllGroupHolds(klog.NewContext(context.Background(), klog.FromContext(ctx)), "the node plugin stopped")
	return nil
}

// Tick reads every shared pool's inbox once: thaws what was withdrawn
// or held too long, then answers new requests. A local pool has no other
// node to ask: its controller runs in this process and freezes in place, so
// its inbox is never read (two directory reads a second saved per pool).
func (f *Freezer) Tick(ctx context.Context) {
	log := klog.FromContext(ctx)
	node := f.deps.NodeID
	for _, pn := range f.deps.Names() {
		p := f.deps.Pool(pn)
		if p == nil || !p.Shared() {
			continue
		}
		entries, acked, listErr := p.Freezes().Inbox(node)
		if listErr != nil {
			log.V(2).Info("Cannot read this node's freeze inbox", "pool", pn, "err", listErr)
		}
		requests := map[string]pool.FreezeRequest{}
		seen := map[string]bool{}
		for _, e := range entries {
			if e.Err != nil {
				seen[pn+"/"+e.Name] = true
				if !f.warnOnce(pn + "/" + e.Name) {
					log.Error(e.Err, "Ignoring an unusable entry of this node's freeze inbox", "pool", pn, "entry", e.Name)
				}
				continue
			}
			requests[e.Volume.String()] = e.Request
		}
		f.forgetWarnings(pn, seen)
		now := f.Now()
		for _, h := range f.heldIn(p) {
			r, ok := requests[h.id.String()]
			switch {
			case listErr == nil && (!ok || r.Nonce != h.nonce):
				f.thawHeld(ctx, h, "")
			case now.Sub(h.since) >= h.bound-f.Timing.Poll || h.local.fs.Expired():
				f.thawHeld(ctx, h, fmt.Sprintf("held for its bound of %s (--freeze-max-hold, and the volume's freeze budget) by node %s's clock, and the request is still there", h.bound, node))
			}
		}
		if listErr != nil || !f.Recovered() {
			continue // no new freeze before the thaws after a crash are done
		}
		for _, id := range acked {
			if _, ok := requests[id.String()]; !ok && !f.holds(id) {
				if err := p.Freezes().RemoveAck(node, id); err != nil {
					log.Error(err, "Removing an answer to a withdrawn freeze request", "volume", id)
				}
			}
		}
		for _, r := range requests {
			if !f.holds(mustVolumeID(r.Volume)) {
				f.answerFreeze(ctx, p, r)
			}
		}
	}
}

func mustVolumeID(s string) pool.VolumeID {
	id, _ := pool.ParseVolumeID(s) // the pool parsed it already
	return id
}

func (f *Freezer) warnOnce(key string) (warned bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	warned = f.warned[key]
	f.warned[key] = true
	return warned
}

// forgetWarnings drops the warnings of pool pn's entries that are gone.
func (f *Freezer) forgetWarnings(pn string, present map[string]bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for k := range f.warned {
		if len(k) > len(pn) && k[:len(pn)+1] == pn+"/" && !present[k] {
			delete(f.warned, k)
		}
	}
}

func (f *Freezer) holds(id pool.VolumeID) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.held[id.String()]
	return ok
}

func (f *Freezer) heldIn(p *pool.Pool) []*heldFreeze {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*heldFreeze
	for _, h := range f.held {
		if h.pool == p {
			out = append(out, h)
		}
	}
	return out
}

// answerFreeze acts on a request not answered yet: it freezes the volume if
// this node has it staged read-write, on this node's own mount of it, within
// the volume's budget, and writes the answer.
func (f *Freezer) answerFreeze(ctx context.Context, p *pool.Pool, r pool.FreezeRequest) {
	node := f.deps.NodeID
	id := mustVolumeID(r.Volume)
	log := klog.FromContext(ctx).WithValues("volume", id)
	if prev, ok, err := p.Freezes().ReadAck(node, id); err == nil && ok && prev.Nonce == r.Nonce {
		return // answered; a request thawed early is not frozen again
	}
	// Held while frozen: an unstage (its unmount) meanwhile is ABORTED and
	// retried after the thaw, never an unmount of a frozen filesystem.
	release, err := f.deps.Lock(id.String(), HolderFreeze)
	if err != nil {
		log.V(2).Info("Volume busy; answering the freeze request at the next poll", "err", err)
		return
	}
	ack := pool.FreezeAck{Volume: id.String(), Node: node, Nonce: r.Nonce}
	h, state, reason := f.freezeForRequest(ctx, p, id, r)
	ack.State, ack.Reason = state, reason
	if h != nil {
		ack.HoldMillis = h.bound.Milliseconds()
	}
	if err := p.Freezes().WriteAck(ack); err != nil {
		if h != nil {
			f.thawNow(ctx, h)
			f.spend(h.key, h.since, f.Now())
		}
		release()
		log.Error(err, "Cannot answer a freeze request; not keeping the filesystem frozen")
		return
	}
	if h == nil {
		release()
		log.Info("Answered a freeze request without freezing", "state", state, "reason", reason)
		return
	}
	h.release = release
	f.mu.Lock()
	f.held[id.String()] = h
	f.mu.Unlock()
	// Logged after the freeze: the thaw at the bound was armed with it and
	// needs no log line, nor anything else, to happen.
	log.Info("Froze filesystem for another node's snapshot", "path", h.local.path, "device", h.local.dev, "bound", h.bound)
}

// freezeForRequest checks a request against the volume's record, this
// node's own mount of it and the volume's budget, and freezes: a hold, or no
// hold and the answer that says why. The path the request names is not used.
func (f *Freezer) freezeForRequest(ctx context.Context, p *pool.Pool, id pool.VolumeID, r pool.FreezeRequest) (*heldFreeze, pool.FreezeState, string) {
	v, err := p.Load(id)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return nil, pool.FreezeNotStaged, "the volume does not exist"
	case err != nil:
		return nil, pool.FreezeFailed, fmt.Sprintf("read the volume: %v", err)
	case !Freezable(v):
		return nil, pool.FreezeNotStaged, "not an image volume with a filesystem"
	}
	staged := false
	for _, st := range v.Staged {
		staged = staged || (st.Node == f.deps.NodeID && !st.ReadOnly)
	}
	if !staged {
		return nil, pool.FreezeNotStaged, "no read-write stage of this node"
	}
	dev, key, err := f.ownDevice(p, id)
	switch {
	case err != nil:
		return nil, pool.FreezeFailed, fmt.Sprintf("find the volume's loop device: %v", err)
	case dev == "":
		return nil, pool.FreezeNotStaged, "no loop device this node staged the volume on"
	}
	now := f.Now()
	bound, refused := f.allowance(key, now, f.Timing)
	if refused != "" {
		return nil, pool.FreezeFailed, refused
	}
	local, why, err := f.FreezeVolumeHere(ctx, id, dev, bound)
	switch {
	case err != nil:
		return nil, pool.FreezeFailed, fmt.Sprintf("freeze: %v", err)
	case local == nil:
		return nil, pool.FreezeNotStaged, why
	}
	return &heldFreeze{pool: p, id: id, key: key, nonce: r.Nonce, local: local, since: now, bound: bound}, pool.FreezeFrozen, ""
}

// thawHeld thaws a hold. early, when not empty, says why it ends while the
// request is still there (the controller then learns its copy may not be of
// one point in time); empty, the request was withdrawn. Either way the answer
// says "thawed" before the thaw, so "frozen" is only ever read while it is;
// a withdrawn request's answer then goes.
func (f *Freezer) thawHeld(ctx context.Context, h *heldFreeze, early string) {
	log := klog.FromContext(ctx).WithValues("volume", h.id, "path", h.local.path)
	node := f.deps.NodeID
	why := early
	if why == "" {
		why = "the request was withdrawn"
	}
	ackErr := h.pool.Freezes().WriteAck(pool.FreezeAck{Volume: h.id.String(), Node: node, Nonce: h.nonce, State: pool.FreezeThawed, Reason: why})
	// Thawed all the same if the answer cannot be written: a frozen
	// filesystem hangs every writer (and the bound thaws it anyway).
	f.thawNow(ctx, h)
	if ackErr != nil {
		log.Error(ackErr, "Cannot write down the thaw; thawed all the same")
	}
	f.mu.Lock()
	delete(f.held, h.id.String())
	f.mu.Unlock()
	f.spend(h.key, h.since, f.Now())
	if h.release != nil {
		h.release()
	}
	if early != "" {
		log.Info("Thawed a filesystem before the snapshot's controller withdrew its request", "why", early)
	}
	// Last: an inbox without the answer means the volume is free again.
	if early == "" {
		if err := h.pool.Freezes().RemoveAck(node, h.id); err != nil {
			log.Error(err, "Removing the answer to a withdrawn freeze request")
		}
		log.Info("Thawed filesystem after another node's snapshot")
	}
}

// thawNow thaws and drops the freeze record.
func (f *Freezer) thawNow(ctx context.Context, h *heldFreeze) {
	if err := f.thawHere(ctx, h.local); err != nil {
		klog.FromContext(ctx).Error(err, "Thawing the filesystem failed; its bound thaws it", "volume", h.id, "path", h.local.path)
	}
}

// thawAllHeld thaws every hold, as early thaws.
func (f *Freezer) thawAllHeld(ctx context.Context, why string) {
	f.mu.Lock()
	var all []*heldFreeze
	for _, h := range f.held {
		all = append(all, h)
	}
	f.mu.Unlock()
	for _, h := range all {
		f.thawHeld(ctx, h, why)
	}
}

// abandonFreezeAnswers rewrites as "thawed" every "frozen" answer of this node
// in p, before a start thaws what a crashed process left frozen: the
// controller must not take a thaw it was not told of for a freeze.
func (f *Freezer) abandonFreezeAnswers(ctx context.Context, p *pool.Pool) {
	node := f.deps.NodeID
	_, acked, err := p.Freezes().Inbox(node)
	if err != nil {
		return
	}
	for _, id := range acked {
		a, ok, err := p.Freezes().ReadAck(node, id)
		if err != nil || !ok || a.State != pool.FreezeFrozen {
			continue
		}
		a.State, a.Reason = pool.FreezeThawed, "the node plugin of node "+node+" restarted while the filesystem was frozen"
		if err := p.Freezes().WriteAck(a); err != nil {
			klog.FromContext(ctx).Error(err, "Cannot write down the thaw of a freeze a crash interrupted", "volume", id)
		}
	}
}
