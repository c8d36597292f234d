package central

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/nodecall/nodecalltest"
	"github.com/poolcsi/poolcsi/internal/params"
)

// A node is live while this process sees its PoolNode change, by this process's clock:
// a first sighting is no change, renewTime is never read, and a PoolNode that stops
// changing goes stale after staleAfter.
func TestNodeView(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := nodecalltest.NewClient()
	store := nodecall.Store{Client: client, Namespace: "poolcsi"}
	clk := clocktesting.NewFakeClock(time.Now())
	// A PoolNode a dead agent left before this process started.
	if _, err := store.CreateNode(ctx, &nodecall.PoolNode{ObjectMeta: metav1.ObjectMeta{Name: "b"}}); err != nil {
		t.Fatal(err)
	}
	inf := store.NodeInformer(0)
	v := NewNodeView(inf, 0, clk)
	if v.Synced() {
		t.Error("synced before the informer ran")
	}
	done := make(chan struct{})
	go func() { inf.RunWithContext(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) || !v.Synced() {
		t.Fatal("not synced")
	}

	// beat writes node's status as its agent does; renewTime far in the past on purpose.
	beat := func(node string, pools ...nodecall.PoolCapacity) {
		t.Helper()
		n, err := store.GetNode(ctx, node)
		if err != nil {
			n, err = store.CreateNode(ctx, &nodecall.PoolNode{ObjectMeta: metav1.ObjectMeta{Name: node}})
			if err != nil {
				t.Fatal(err)
			}
		}
		old := metav1.NewMicroTime(time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC))
		n.Status = nodecall.PoolNodeStatus{RenewTime: &old, Pools: pools}
		out, err := store.UpdateNodeStatus(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		until(t, "the view to see "+node+" "+out.ResourceVersion, func() bool {
			v.mu.Lock()
			defer v.mu.Unlock()
			return v.seen[node].rv == out.ResourceVersion
		})
	}
	type want struct {
		node  string
		live  bool
		since time.Duration
	}
	check := func(step string, wants ...want) {
		t.Helper()
		for _, w := range wants {
			if live, since := v.Live(w.node); live != w.live || since != w.since {
				t.Errorf("%s: Live(%s) = %v, %v; want %v, %v", step, w.node, live, since, w.live, w.since)
			}
		}
	}
	check("first sighting", want{"b", false, 0}, want{"a", false, 0})
	if got := v.Known(); len(got) != 1 || got[0] != "b" {
		t.Errorf("Known = %v", got)
	}

	local := nodecall.PoolCapacity{Name: "local", AvailableBytes: 1 << 30, Condition: nodecall.PoolOk}
	beat("b", local)
	beat("a")
	check("renewed", want{"b", true, 0}, want{"a", true, 0})
	clk.Step(DefaultStaleAfter - time.Second)
	check("just in time", want{"b", true, DefaultStaleAfter - time.Second})
	beat("a")
	clk.Step(time.Second)
	check("b stale, a renewed", want{"b", false, DefaultStaleAfter}, want{"a", true, time.Second})
	if p := v.Pools("b"); len(p) != 1 || p[0] != local {
		t.Errorf("Pools(b) = %v", p)
	}
	if got := v.Known(); len(got) != 2 || got[0] != "a" || got[1] != "b" {
		t.Errorf("Known = %v", got)
	}
	beat("b")
	check("b back", want{"b", true, 0})
	if p := v.Pools("b"); len(p) != 0 || v.Pools("c") != nil {
		t.Errorf("Pools: %v %v", p, v.Pools("c"))
	}
}

// The Node's UID comes from the PoolNode's owner, so a call needs no read of the Node;
// an owner that is not that Node is no UID.
func TestNodeViewNodeUID(t *testing.T) {
	v := NewNodeView(cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, cache.Indexers{}), 0, nil)
	pn := func(name string, owners ...metav1.OwnerReference) *unstructured.Unstructured {
		u := &unstructured.Unstructured{}
		u.SetAPIVersion("poolcsi.io/v1alpha1")
		u.SetKind("PoolNode")
		u.SetName(name)
		u.SetResourceVersion("1")
		u.SetOwnerReferences(owners)
		return u
	}
	v.observe(pn("a", nodecall.NodeOwner("a", "uid-a")))
	v.observe(pn("b", nodecall.NodeOwner("c", "uid-c"), metav1.OwnerReference{APIVersion: "apps/v1", Kind: "DaemonSet", Name: "b", UID: "uid-ds"}))
	v.observe(pn("d"))
	for node, want := range map[string]string{"a": "uid-a", "b": "", "d": "", "unknown": ""} {
		if got, ok := v.NodeUID(node); got != want || ok != (want != "") {
			t.Errorf("NodeUID(%s) = %q %v, want %q", node, got, ok, want)
		}
	}
}

// Right after the controller starts no node is live (a first sighting is no change), and
// csi-provisioner polls GetCapacity once a minute: GetCapacity waits for the node's next
// heartbeat, so the figures it publishes after a start are the nodes' own, not 0 for
// every node until the next poll. A node whose PoolNode never changes is 0 one stale limit
// after its first sighting; a caller that gives up gets 0 at once.
func TestGetCapacityAfterStart(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	v := NewNodeView(cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, cache.Indexers{}), 0, clk)
	pn := func(name, rv string) *unstructured.Unstructured {
		n := &nodecall.PoolNode{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: rv}}
		n.Status.Pools = []nodecall.PoolCapacity{okPool("local", 10<<30)}
		u, err := n.ToUnstructured()
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	s := NewServer(Deps{Name: "local.poolcsi.io", Version: "test", TopologyKey: testKey,
		Params: params.Config{Pools: []string{"local"}}, Calls: &srvWorld{}, Nodes: v, Hints: newSrvHints()})
	ask := func(ctx context.Context, node string) <-chan int64 {
		out := make(chan int64, 1)
		go func() {
			resp, err := controllerServer{Server: s}.GetCapacity(ctx, &csi.GetCapacityRequest{
				Parameters: map[string]string{"pool": "local"}, AccessibleTopology: &csi.Topology{Segments: map[string]string{testKey: node}}})
			if err != nil {
				t.Error(err)
			}
			out <- resp.GetAvailableCapacity()
		}()
		return out
	}
	answered := func(step string, got <-chan int64, want int64) {
		t.Helper()
		select {
		case n := <-got:
			if n != want {
				t.Errorf("%s: GetCapacity %d, want %d", step, n, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: GetCapacity did not answer", step)
		}
	}
	waiting := func(step string, got <-chan int64) {
		t.Helper()
		select {
		case n := <-got:
			t.Fatalf("%s: GetCapacity answered %d before the node could be judged", step, n)
		case <-time.After(100 * time.Millisecond):
		}
	}

	// The informer's first list: a, b and c as their agents last wrote them.
	for _, n := range []string{"a", "b", "c"} {
		v.observe(pn(n, "1"))
	}
	a := ask(context.Background(), "a")
	waiting("a before its next heartbeat", a)
	v.observe(pn("a", "2"))
	answered("a after its heartbeat", a, 10<<30)

	ctx, cancel := context.WithCancel(context.Background())
	b := ask(ctx, "b")
	waiting("b", b)
	cancel()
	answered("b, its caller gone", b, 0)

	c := ask(context.Background(), "c")
	waiting("c", c)
	for !clk.HasWaiters() {
		time.Sleep(time.Millisecond)
	}
	clk.Step(DefaultStaleAfter)
	answered("c, no heartbeat within the stale limit", c, 0)
	answered("c, judged", ask(context.Background(), "c"), 0)
	v.observe(pn("a", "3"))
	answered("a, renewed", ask(context.Background(), "a"), 10<<30)
	// A node never seen is judged one stale limit after the view was made.
	answered("z, never seen", ask(context.Background(), "z"), 0)
}
