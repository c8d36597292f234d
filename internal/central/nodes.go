package central

import (
	"context"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// NodeView is the controller's view of the nodes' PoolNodes, over a PoolNode informer
// (nodecall.Store.NodeInformer). It implements Nodes.
//
// A node is live while this process has seen its PoolNode change (a new resourceVersion)
// within staleAfter, timed by this process's clock: the agent's renewTime is never
// compared with it (DESIGN.md: "by the reader's own clock"). The first sighting of a
// PoolNode (the informer's initial list, after a restart of this process) is not a
// change: a PoolNode a dead agent left behind looks exactly like a live one until its
// next write, so a node counts as live from the first heartbeat this process sees.
type NodeView struct {
	inf        cache.SharedIndexInformer
	staleAfter time.Duration
	clk        clock.Clock

	mu   sync.Mutex
	seen map[string]sighting
	// made is when the view was made: a node never seen is judged staleAfter later.
	made time.Time
	// wake is closed, and replaced, at each event: AwaitVerdict's waiters look again.
	wake chan struct{}
	// listeners are told of each event, after the view has taken it (OnChange).
	listeners []func(node string, rose bool)
}

// sighting is what this process last saw of one PoolNode.
type sighting struct {
	rv string
	// changed is when this process saw the resourceVersion change (zero: not yet).
	changed time.Time
	// first is when this process first saw it: with no change seen, the node is
	// judged (not live) staleAfter later.
	first time.Time
	pools []nodecall.PoolCapacity
	// nodeUID is the UID of the Node the PoolNode names as its owner (its agent read it):
	// the owner of that node's calls, without a read of the Node per call.
	nodeUID string
}

// NewNodeView returns the view of the PoolNodes inf watches and registers its handler
// on inf (before or after inf runs). staleAfter 0 is DefaultStaleAfter; clk nil the real
// clock.
func NewNodeView(inf cache.SharedIndexInformer, staleAfter time.Duration, clk clock.Clock) *NodeView {
	if staleAfter <= 0 {
		staleAfter = DefaultStaleAfter
	}
	if clk == nil {
		clk = clock.RealClock{}
	}
	v := &NodeView{inf: inf, staleAfter: staleAfter, clk: clk, seen: map[string]sighting{}, made: clk.Now(), wake: make(chan struct{})}
	// The error is only that inf was stopped; a stopped informer never syncs, so Probe
	// says why.
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    v.observe,
		UpdateFunc: func(_, obj any) { v.observe(obj) },
		DeleteFunc: v.forget,
	})
	return v
}

func (v *NodeView) observe(obj any) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return
	}
	n, err := nodecall.NodeFrom(u)
	name := u.GetName()
	v.mu.Lock()
	s, known := v.seen[name]
	before := v.servable(s)
	rv := u.GetResourceVersion()
	if known && rv != s.rv {
		s.changed = v.clk.Now()
	}
	if !known {
		s.first = v.clk.Now()
	}
	close(v.wake)
	v.wake = make(chan struct{})
	s.rv = rv
	s.nodeUID = ""
	for _, o := range u.GetOwnerReferences() {
		if o.APIVersion == "v1" && o.Kind == "Node" && o.Name == name {
			s.nodeUID = string(o.UID)
		}
	}
	if err == nil {
		s.pools = n.Status.Pools
	} else {
		// Written by someone who may write PoolNodes, badly: no figures.
		s.pools = nil
	}
	v.seen[name] = s
	rose := false
	for p := range v.servable(s) {
		if !before[p] {
			rose = true
		}
	}
	listeners := v.listeners
	v.mu.Unlock()
	for _, f := range listeners {
		f(name, rose)
	}
}

// servable is the pools of s for which GetCapacity answers more than 0 now: the node
// live, the pool Ok with bytes available. v.mu is held.
func (v *NodeView) servable(s sighting) map[string]bool {
	if live, _ := v.live(s); !live {
		return nil
	}
	out := map[string]bool{}
	for _, p := range s.pools {
		if p.Condition == nodecall.PoolOk && p.AvailableBytes > 0 {
			out[p.Name] = true
		}
	}
	return out
}

// OnChange registers f, called after each event of a PoolNode (never under the view's
// lock, from the informer's goroutine: f must not block). rose says that the event
// made GetCapacity answer more than 0 for a pool of node for which it answered 0 just
// before: the node live again (a first heartbeat after it went stale, or the first
// change of its PoolNode this process sees), or a pool Ok again or with room again. csi-provisioner
// asks GetCapacity only once per poll (a minute): CapacityRefresh uses rose to make it
// ask again at once.
func (v *NodeView) OnChange(f func(node string, rose bool)) {
	v.mu.Lock()
	v.listeners = append(slices.Clip(v.listeners), f)
	v.mu.Unlock()
}

func (v *NodeView) forget(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return
	}
	v.mu.Lock()
	delete(v.seen, u.GetName())
	v.mu.Unlock()
}

// Live reports whether this process saw node's PoolNode change within the stale limit,
// and how long ago it last saw it change (0 when it never did).
func (v *NodeView) Live(node string) (bool, time.Duration) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.live(v.seen[node])
}

// live is Live of a sighting (the zero one for a node never seen); v.mu is held.
func (v *NodeView) live(s sighting) (bool, time.Duration) {
	if s.changed.IsZero() {
		return false, 0
	}
	since := v.clk.Since(s.changed)
	return since < v.staleAfter, since
}

// AwaitVerdict waits, at most until ctx ends, until this process can tell whether node
// is live: it has seen node's PoolNode change, or staleAfter has passed since it first saw
// it (since the view was made, for a node it never saw). Right after this process starts
// no node is live yet (a first sighting is no change); what answers from liveness once,
// and is not asked again soon, waits here for the nodes' next heartbeat instead of taking
// every node for down: GetCapacity, which csi-provisioner polls once a minute, would
// otherwise publish 0 for every node after each start of the controller, and no new local
// claim would be scheduled until the next poll.
func (v *NodeView) AwaitVerdict(ctx context.Context, node string) {
	for {
		v.mu.Lock()
		s, ok := v.seen[node]
		from := v.made
		if ok {
			from = s.first
		}
		judged := ok && !s.changed.IsZero()
		wait, wake := v.staleAfter-v.clk.Since(from), v.wake
		v.mu.Unlock()
		if judged || wait <= 0 {
			return
		}
		t := v.clk.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
			return
		case <-wake:
			t.Stop()
		}
	}
}

// StaleAfter is the stale limit: a node not seen changing for this long is not live.
func (v *NodeView) StaleAfter() time.Duration { return v.staleAfter }

// Known lists the nodes that have a PoolNode, live or not, sorted.
func (v *NodeView) Known() []string {
	v.mu.Lock()
	out := make([]string, 0, len(v.seen))
	for name := range v.seen {
		out = append(out, name)
	}
	v.mu.Unlock()
	slices.Sort(out)
	return out
}

// Pools is node's pools as its agent last published them (nil when unknown).
func (v *NodeView) Pools(node string) []nodecall.PoolCapacity {
	v.mu.Lock()
	defer v.mu.Unlock()
	s, ok := v.seen[node]
	if !ok {
		return nil
	}
	return slices.Clone(s.pools)
}

// NodeUID is the UID of node's Node as its PoolNode's owner names it ("", false when
// unknown). A wrong one, written by that node's own agent, only gets that node's calls
// collected: the admission policy lets a node write its own PoolNode alone.
func (v *NodeView) NodeUID(node string) (string, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	s, ok := v.seen[node]
	return s.nodeUID, ok && s.nodeUID != ""
}

// Synced says whether the informer has its first full list.
func (v *NodeView) Synced() bool { return v.inf.HasSynced() }

var _ Nodes = (*NodeView)(nil)
