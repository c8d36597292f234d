package central

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/rpc"
)

// deleteTimeout bounds the background delete of an answered call; the sweeper deletes
// what it leaves.
const deleteTimeout = 10 * time.Second

// byTarget indexes the calls informer by spec.target (supersede).
const byTarget = "central.target"

// ChannelDeps is what a Channel acts through.
type ChannelDeps struct {
	Store nodecall.Store
	// Calls is an informer of every node's PoolCalls: Store.Informer("", resync).
	Calls cache.SharedIndexInformer
	Nodes Nodes
	// NodeUID reads a Node's UID for the call's ownerReference (nil: no owner).
	NodeUID func(ctx context.Context, node string) (string, error)
	// Clock is the controller's clock (nil: the real one).
	Clock clock.Clock
	// Pickup is how long a call may wait for an agent to take it (0: DefaultPickup).
	Pickup time.Duration
	// Lifetime: a call's notAfter is issued + Lifetime (0: DefaultCallLifetime).
	Lifetime time.Duration
	// Metrics records each call (nil: none).
	Metrics *Metrics
}

// Channel carries one Controller call to one node's agent as a PoolCall and waits for
// its answer (docs/design/central-controller.md §2.3, "Controller"). It implements
// Caller.
//
// It waits on the calls informer's events and on timers of its clock, never by polling:
// each call in flight subscribes to the events of its object's name.
type Channel struct {
	d ChannelDeps

	mu      sync.Mutex
	waiters map[string]map[*waiter]struct{} // by call name
	// running is when this process first saw each call Running with its own nonce (for
	// the ABORTED message: how long it has been in progress, by this clock).
	running map[string]runningSince

	bg sync.WaitGroup // background deletes
}

type runningSince struct {
	uid   types.UID
	nonce string
	at    time.Time
}

// waiter is one Call in flight on one object name.
type waiter struct {
	poke chan struct{}
	gone map[types.UID]bool // deletions seen, guarded by Channel.mu
}

// NewChannel returns a Channel over d and registers its handler and index on d.Calls
// (before d.Calls runs, for the index; without it supersede scans the cache).
func NewChannel(d ChannelDeps) *Channel {
	if d.Clock == nil {
		d.Clock = clock.RealClock{}
	}
	if d.Pickup <= 0 {
		d.Pickup = DefaultPickup
	}
	if d.Lifetime <= 0 {
		d.Lifetime = DefaultCallLifetime
	}
	ch := &Channel{d: d, waiters: map[string]map[*waiter]struct{}{}, running: map[string]runningSince{}}
	// Fails only once the informer runs; supersede then scans the whole cache.
	_ = d.Calls.AddIndexers(cache.Indexers{byTarget: func(obj any) ([]string, error) {
		if c := nodecall.FromCache(obj); c != nil {
			return []string{c.Spec.Target}, nil
		}
		return nil, nil
	}})
	_, _ = d.Calls.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    ch.changed,
		UpdateFunc: func(_, obj any) { ch.changed(obj) },
		DeleteFunc: ch.deleted,
	})
	return ch
}

func (ch *Channel) changed(obj any) {
	c := nodecall.FromCache(obj)
	if c == nil {
		return
	}
	ch.mu.Lock()
	defer ch.mu.Unlock()
	ch.sawRunning(c)
	ch.notify(c.Name)
}

// sawRunning records when this process first saw c Running; ch.mu held.
func (ch *Channel) sawRunning(c *nodecall.Call) {
	if c.Status.Phase != nodecall.Running || c.Status.Nonce != c.Spec.Nonce {
		return
	}
	if r, ok := ch.running[c.Name]; ok && r.uid == c.UID && r.nonce == c.Spec.Nonce {
		return
	}
	ch.running[c.Name] = runningSince{uid: c.UID, nonce: c.Spec.Nonce, at: ch.d.Clock.Now()}
}

func (ch *Channel) deleted(obj any) {
	c := nodecall.FromCache(obj)
	if c == nil {
		return
	}
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if r, ok := ch.running[c.Name]; ok && r.uid == c.UID {
		delete(ch.running, c.Name)
	}
	for w := range ch.waiters[c.Name] {
		w.gone[c.UID] = true
	}
	ch.notify(c.Name)
}

// notify pokes every waiter on name; ch.mu held.
func (ch *Channel) notify(name string) {
	for w := range ch.waiters[name] {
		select {
		case w.poke <- struct{}{}:
		default: // a poke is pending already
		}
	}
}

func (ch *Channel) subscribe(name string) *waiter {
	w := &waiter{poke: make(chan struct{}, 1), gone: map[types.UID]bool{}}
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.waiters[name] == nil {
		ch.waiters[name] = map[*waiter]struct{}{}
	}
	ch.waiters[name][w] = struct{}{}
	return w
}

func (ch *Channel) unsubscribe(name string, w *waiter) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	delete(ch.waiters[name], w)
	if len(ch.waiters[name]) == 0 {
		delete(ch.waiters, name)
	}
}

// isGone reports whether a deletion of the object uid was seen while w waited.
func (ch *Channel) isGone(w *waiter, uid types.UID) bool {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	return w.gone[uid]
}

// cached is the informer's version of the call name (nil: none).
func (ch *Channel) cached(name string) *nodecall.Call {
	obj, ok, err := ch.d.Calls.GetStore().GetByKey(ch.d.Store.Namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return nodecall.FromCache(obj)
}

// Call runs method on node's agent and waits for its answer (Caller).
func (ch *Channel) Call(ctx context.Context, node, method, target string, req proto.Message) (proto.Message, error) {
	m, ok := nodecall.Lookup(method)
	if !ok {
		return nil, status.Errorf(codes.Internal, "%s is not a call a node runs for the controller", method)
	}
	// Recorded by the allow-listed method only: the label's values are bounded.
	start := ch.d.Clock.Now()
	end := ch.d.Metrics.start(node, method)
	resp, err := ch.call(ctx, node, m, target, req)
	end(err, ch.d.Clock.Since(start))
	return resp, err
}

// call is Call of the allow-listed method m.
func (ch *Channel) call(ctx context.Context, node string, m nodecall.Method, target string, req proto.Message) (proto.Message, error) {
	method := m.Name
	log := klog.FromContext(ctx).WithValues("node", node, "method", method, "target", target)
	ctx = klog.NewContext(ctx, log)
	// 1. Liveness: nothing is created for a node that is down.
	if live, since := ch.d.Nodes.Live(node); !live {
		return nil, notLive(node, since)
	}

	now := ch.d.Clock.Now()
	ask := nodecall.Ask{Node: node, Method: method, Target: target, Request: req, Issued: now, NotAfter: now.Add(ch.d.Lifetime)}
	if ch.d.NodeUID != nil {
		uid, err := ch.d.NodeUID(ctx, node)
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "reading Node %s for its call's owner: %v", node, err)
		}
		ask.NodeUID = uid
	}
	c, err := nodecall.NewCall(ask)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "%s for node %s: %v", method, node, err)
	}

	cw := ch.newWait(ctx, node, c.Name, now)
	defer cw.stop()

	// 2. Find or create.
	cur, err := cw.findOrCreate(c)
	if err != nil {
		return nil, err
	}
	log = log.WithValues("call", cur.Name)
	ctx = klog.NewContext(ctx, log)

	// 3. Supersede.
	if method == "ControllerModifyVolume" || method == "ControllerExpandVolume" {
		ch.supersede(ctx, cur)
	}

	// 4. Wait.
	done, err := cw.answer(cur, subject(target, req))
	if err != nil {
		return nil, err
	}
	// 5. Answer, and delete the call: its retry, if any, finds the volume by itself.
	ch.bg.Go(func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), deleteTimeout)
		defer cancel()
		if err := ch.d.Store.Delete(dctx, done.Name, done.ResourceVersion); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			log.V(2).Info("Answered PoolCall not deleted; the sweeper will", "err", err)
		}
	})
	if code := codes.Code(done.Status.Code); code != codes.OK {
		return nil, status.Error(code, done.Status.Message)
	}
	resp, err := m.DecodeResponse(done.Status.Response)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "node %s answered %s with a response that does not decode: %v", node, method, err)
	}
	return resp, nil
}

func notLive(node string, since time.Duration) error {
	if since == 0 {
		return status.Errorf(codes.Unavailable, "poolcsi on node %s has not renewed since this controller started", node)
	}
	return status.Errorf(codes.Unavailable, "poolcsi on node %s has not renewed for %d s", node, seconds(since))
}

func seconds(d time.Duration) int64 { return int64(d.Round(time.Second) / time.Second) }

// subject is what the ABORTED message names: the request's name (a create), else the
// target.
func subject(target string, req proto.Message) string {
	if n, ok := req.(interface{ GetName() string }); ok && n.GetName() != "" {
		return n.GetName()
	}
	return target
}

// staleLimit is implemented by NodeView: with it, a wait wakes when the node would go
// stale; without it, DefaultStaleAfter is assumed.
type staleLimit interface{ StaleAfter() time.Duration }

// callWait is one Call's wait: its subscription and its timers, on the Channel's clock.
type callWait struct {
	ch   *Channel
	ctx  context.Context
	node string
	name string
	w    *waiter

	budget, pickup, stale clock.Timer
}

type wake int

const (
	wakeEvent wake = iota
	wakeBudget
	wakePickup
	wakeStale
	wakeDone // ctx ended
)

func (ch *Channel) newWait(ctx context.Context, node, name string, now time.Time) *callWait {
	cw := &callWait{ch: ch, ctx: ctx, node: node, name: name, w: ch.subscribe(name)}
	if deadline, ok := ctx.Deadline(); ok {
		left := deadline.Sub(now)
		cw.budget = ch.d.Clock.NewTimer(left - rpc.AnswerMargin(left))
	}
	cw.pickup = ch.d.Clock.NewTimer(ch.d.Pickup)
	cw.stale = ch.d.Clock.NewTimer(cw.untilStale())
	return cw
}

// untilStale is how long until the node goes stale if it is not seen renewing.
func (cw *callWait) untilStale() time.Duration {
	limit := DefaultStaleAfter
	if s, ok := cw.ch.d.Nodes.(staleLimit); ok {
		limit = s.StaleAfter()
	}
	_, since := cw.ch.d.Nodes.Live(cw.node)
	return max(limit-since, time.Millisecond)
}

func (cw *callWait) stop() {
	cw.ch.unsubscribe(cw.name, cw.w)
	for _, t := range []clock.Timer{cw.budget, cw.pickup, cw.stale} {
		if t != nil {
			t.Stop()
		}
	}
}

func timerC(t clock.Timer) <-chan time.Time {
	if t == nil {
		return nil
	}
	return t.C()
}

// next waits for an event of the call, a timer or the end of ctx. A stale timer that
// finds the node renewed meanwhile is set again.
func (cw *callWait) next() wake {
	for {
		select {
		case <-cw.w.poke:
			return wakeEvent
		case <-timerC(cw.budget):
			return wakeBudget
		case <-timerC(cw.pickup):
			cw.pickup = nil
			return wakePickup
		case <-cw.stale.C():
			if live, _ := cw.ch.d.Nodes.Live(cw.node); !live {
				return wakeStale
			}
			cw.stale.Reset(cw.untilStale())
		case <-cw.ctx.Done():
			return wakeDone
		}
	}
}

// ended is the answer for a wait ended by wk, with the call as last seen.
func (cw *callWait) ended(wk wake, last *nodecall.Call, taken bool, what string) error {
	switch wk {
	case wakeStale:
		_, since := cw.ch.d.Nodes.Live(cw.node)
		return notLive(cw.node, since)
	case wakeDone:
		return status.FromContextError(cw.ctx.Err()).Err()
	case wakePickup:
		return status.Errorf(codes.Unavailable, "poolcsi on node %s has not taken the %s call within %d s", cw.node, last.Spec.Method, seconds(cw.ch.d.Pickup))
	}
	// The budget.
	if !taken || last.Status.Phase != nodecall.Running {
		return status.Errorf(codes.Unavailable, "poolcsi on node %s has not taken the %s call in time", cw.node, last.Spec.Method)
	}
	cw.ch.mu.Lock()
	r, ok := cw.ch.running[last.Name]
	cw.ch.mu.Unlock()
	var running time.Duration
	if ok && r.uid == last.UID && r.nonce == last.Spec.Nonce {
		running = cw.ch.d.Clock.Since(r.at)
	}
	return status.Errorf(codes.Aborted, "%s of %s in progress on node %s (attempt %d, %d s)", last.Spec.Method, what, cw.node, last.Status.Attempts, seconds(running))
}

// findOrCreate creates c, or reads the call of its name that exists; one being deleted
// is waited out and made again.
func (cw *callWait) findOrCreate(c *nodecall.Call) (*nodecall.Call, error) {
	ch := cw.ch
	for {
		made, err := ch.d.Store.Create(cw.ctx, c)
		if err == nil {
			klog.FromContext(cw.ctx).V(2).Info("PoolCall made", "call", made.Name)
			return made, nil
		}
		if !apierrors.IsAlreadyExists(err) {
			return nil, status.Errorf(codes.Unavailable, "making the %s call for node %s: %v", c.Spec.Method, cw.node, err)
		}
		cur, err := ch.d.Store.Get(cw.ctx, c.Name)
		if apierrors.IsNotFound(err) {
			continue // deleted between the two: make it again
		}
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "reading the %s call for node %s: %v", c.Spec.Method, cw.node, err)
		}
		if cur.DeletionTimestamp == nil {
			ch.mu.Lock()
			ch.sawRunning(cur)
			ch.mu.Unlock()
			return cur, nil
		}
		// Being deleted (a finalizer someone added): wait for it to go.
		for !cw.goneNow(cur.UID) {
			if wk := cw.next(); wk != wakeEvent {
				return nil, cw.ended(wk, cur, false, "")
			}
		}
	}
}

// goneNow reports whether the object uid of the call's name is gone: its deletion seen,
// or the API server holding no object of the name or another one. It reads the API
// server only after an event of the name (the cache may lag: an object of another UID
// in it may be an older one as well as a newer one).
func (cw *callWait) goneNow(uid types.UID) bool {
	if cw.ch.isGone(cw.w, uid) {
		return true
	}
	c, err := cw.ch.d.Store.Get(cw.ctx, cw.name)
	return apierrors.IsNotFound(err) || (err == nil && c.UID != uid)
}

// answer waits for cur's answer: Done with its nonce.
func (cw *callWait) answer(cur *nodecall.Call, what string) (*nodecall.Call, error) {
	uid := cur.UID
	last := cur
	taken := false
	inCache := false
	// look judges what the cache holds now: the answer, the end of the call, or nothing.
	look := func() (*nodecall.Call, error) {
		if cw.ch.isGone(cw.w, uid) {
			return nil, deletedMeanwhile(cw.node, last)
		}
		if c := cw.ch.cached(cw.name); c != nil {
			if c.UID != uid {
				if inCache {
					// Ours was in the cache, and another object of the name replaced it.
					return nil, deletedMeanwhile(cw.node, last)
				}
				// An older object of the name the cache still holds: its deletion and
				// ours will come as events.
				return nil, nil
			}
			inCache = true
			// The cache may still hold a version older than the one read: a status
			// without the nonce is no news.
			if c.Status.Nonce == c.Spec.Nonce && c.Status.Phase != "" {
				last = c
			}
		} else if inCache {
			return nil, deletedMeanwhile(cw.node, last)
		}
		if last.Status.Nonce == last.Spec.Nonce && last.Status.Phase != "" {
			taken = true
		}
		if last.Answered() {
			return last, nil
		}
		return nil, nil
	}
	for {
		if last.Answered() {
			return last, nil
		}
		if done, err := look(); done != nil || err != nil {
			return done, err
		}
		wk := cw.next()
		if wk == wakeEvent {
			continue
		}
		// A timer or the caller's end: judged on what the cache holds by then.
		if done, err := look(); done != nil || err != nil {
			return done, err
		}
		if wk == wakePickup && taken {
			continue // taken in time: only the budget, the node and ctx end the wait now
		}
		return nil, cw.ended(wk, last, taken, what)
	}
}

func deletedMeanwhile(node string, c *nodecall.Call) error {
	return status.Errorf(codes.Unavailable, "the %s call for node %s was deleted before it was answered", c.Spec.Method, node)
}

// supersede deletes the older calls of cur's target and method on its node that no
// agent has taken, each only at the version read: a class asked for later wins, and a
// call an agent took meanwhile is left to run (the agent runs the calls of a target in
// the order issued).
func (ch *Channel) supersede(ctx context.Context, cur *nodecall.Call) {
	var objs []any
	if o, err := ch.d.Calls.GetIndexer().ByIndex(byTarget, cur.Spec.Target); err == nil {
		objs = o
	} else {
		objs = ch.d.Calls.GetStore().List()
	}
	for _, o := range objs {
		c := nodecall.FromCache(o)
		if c == nil || c.Name == cur.Name || c.Spec.Target != cur.Spec.Target || c.Spec.Method != cur.Spec.Method || c.Spec.Node != cur.Spec.Node ||
			c.DeletionTimestamp != nil || !c.Spec.Issued.Before(&cur.Spec.Issued) {
			continue
		}
		if c.Status.Nonce == c.Spec.Nonce && c.Status.Phase != "" {
			continue // taken: it runs first, and this call after it
		}
		err := ch.d.Store.Delete(ctx, c.Name, c.ResourceVersion)
		switch {
		case err == nil:
			klog.FromContext(ctx).V(2).Info("Superseded an older PoolCall", "older", c.Name)
		case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
			// Gone, or taken since it was read: left alone.
		default:
			klog.FromContext(ctx).Error(err, "Superseding an older PoolCall", "older", c.Name)
		}
	}
}

// Pending is the node of a call of method about target in this process's view that
// may still make, or has made, what it asks (PendingCalls).
func (ch *Channel) Pending(method, target string) (string, bool) {
	return ch.pick(method, target, func(c *nodecall.Call) bool {
		return !c.Answered() || c.Status.Code == 0 // the node refused it: nothing was made there
	})
}

// Underway is the node of a call of method about target in this process's view not
// answered yet (PendingCalls).
func (ch *Channel) Underway(method, target string) (string, bool) {
	return ch.pick(method, target, func(c *nodecall.Call) bool { return !c.Answered() })
}

// pick is the node of the call of method about target, not being deleted, that keep
// admits: one an agent took first, then the oldest.
func (ch *Channel) pick(method, target string, keep func(*nodecall.Call) bool) (string, bool) {
	var objs []any
	if o, err := ch.d.Calls.GetIndexer().ByIndex(byTarget, target); err == nil {
		objs = o
	} else {
		objs = ch.d.Calls.GetStore().List()
	}
	var best *nodecall.Call
	taken := func(c *nodecall.Call) bool { return c.Status.Nonce == c.Spec.Nonce && c.Status.Phase != "" }
	for _, o := range objs {
		c := nodecall.FromCache(o)
		if c == nil || c.Spec.Target != target || c.Spec.Method != method || c.DeletionTimestamp != nil {
			continue
		}
		if !keep(c) {
			continue
		}
		switch {
		case best == nil,
			taken(c) && !taken(best),
			taken(c) == taken(best) && c.Spec.Issued.Before(&best.Spec.Issued):
			best = c
		}
	}
	if best == nil {
		return "", false
	}
	return best.Spec.Node, true
}

var (
	_ Caller       = (*Channel)(nil)
	_ PendingCalls = (*Channel)(nil)
)
