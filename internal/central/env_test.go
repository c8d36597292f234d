package central

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/nodecall/nodecalltest"
)

// fakeNodes is a Nodes whose liveness the test sets: when each node was last seen
// changing, by the test's clock.
type fakeNodes struct {
	clk   *clocktesting.FakeClock
	mu    sync.Mutex
	seen  map[string]time.Time
	limit time.Duration
}

func (f *fakeNodes) renew(node string) {
	f.mu.Lock()
	f.seen[node] = f.clk.Now()
	f.mu.Unlock()
}

func (f *fakeNodes) Live(node string) (bool, time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.seen[node]
	if !ok {
		return false, 0
	}
	since := f.clk.Since(at)
	return since < f.limit, since
}

// AwaitVerdict: this fake judges every node at once.
func (f *fakeNodes) AwaitVerdict(context.Context, string) {}

func (f *fakeNodes) StaleAfter() time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.limit
}

func (f *fakeNodes) setLimit(d time.Duration) {
	f.mu.Lock()
	f.limit = d
	f.mu.Unlock()
}

func (f *fakeNodes) Known() []string                      { return nil }
func (f *fakeNodes) Pools(string) []nodecall.PoolCapacity { return nil }
func (f *fakeNodes) Synced() bool                         { return true }
func (f *fakeNodes) set(node string, since time.Duration) {
	f.mu.Lock()
	f.seen[node] = f.clk.Now().Add(-since)
	f.mu.Unlock()
}
func newFakeNodes(clk *clocktesting.FakeClock) *fakeNodes {
	return &fakeNodes{clk: clk, seen: map[string]time.Time{}, limit: DefaultStaleAfter}
}

func nameOf(t *testing.T, node, method string, req proto.Message) string {
	t.Helper()
	m, _ := nodecall.Lookup(method)
	name, err := m.ObjectName(node, req)
	if err != nil {
		t.Fatal(err)
	}
	return name
}

// env is a Channel and a Sweeper over the fake API server, with an informer of every
// call; the test plays the agent by writing the calls' status.
type env struct {
	client *nodecalltest.Client
	store  nodecall.Store
	clock  *clocktesting.FakeClock
	calls  cache.SharedIndexInformer
	nodes  *fakeNodes
	ch     *Channel
	sweep  *Sweeper
	// reg holds the Channel's and the Sweeper's metrics.
	reg    *prometheus.Registry
	cancel context.CancelFunc
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{client: nodecalltest.NewClient(), clock: clocktesting.NewFakeClock(time.Now())}
	e.store = nodecall.Store{Client: e.client, Namespace: "poolcsi"}
	e.calls = e.store.Informer("", 0)
	e.nodes = newFakeNodes(e.clock)
	e.nodes.renew("a")
	e.nodes.renew("b")
	e.reg = prometheus.NewRegistry()
	mx, err := NewMetrics(MetricsDeps{Registry: e.reg, Calls: e.calls})
	if err != nil {
		t.Fatal(err)
	}
	e.ch = NewChannel(ChannelDeps{Store: e.store, Calls: e.calls, Nodes: e.nodes, Clock: e.clock, Metrics: mx})
	e.sweep = NewSweeper(e.store, e.calls, e.clock)
	e.sweep.Metrics = mx
	ctx, cancel := context.WithCancel(context.Background())
	e.cancel = cancel
	done := make(chan struct{})
	go func() { e.calls.RunWithContext(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
		e.ch.bg.Wait()
	})
	if !cache.WaitForCacheSync(ctx.Done(), e.calls.HasSynced) {
		t.Fatal("calls informer never synced")
	}
	return e
}

type result struct {
	resp proto.Message
	err  error
}

// call starts a Call with a deadline of a minute.
func (e *env) call(node, method, target string, req proto.Message) <-chan result {
	out := make(chan result, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		resp, err := e.ch.Call(ctx, node, method, target, req)
		out <- result{resp, err}
	}()
	return out
}

// until waits for cond; how long it takes is never asserted.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	}); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

// cached waits until the informer holds the call name at resourceVersion rv (any
// version if rv is empty), and returns it.
func (e *env) cached(t *testing.T, name, rv string) *nodecall.Call {
	t.Helper()
	var c *nodecall.Call
	until(t, "the informer to see "+name+" "+rv, func() bool {
		c = e.ch.cached(name)
		return c != nil && (rv == "" || c.ResourceVersion == rv)
	})
	return c
}

// gone waits until the informer no longer holds name.
func (e *env) gone(t *testing.T, name string) {
	t.Helper()
	until(t, "the informer to lose "+name, func() bool { return e.ch.cached(name) == nil })
}

// answer writes st over the call name's status as an agent would, and waits until the
// informer holds it.
func (e *env) answer(t *testing.T, name string, st func(c *nodecall.Call) nodecall.CallStatus) *nodecall.Call {
	t.Helper()
	c, err := e.store.Get(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	c.Status = st(c)
	out, err := e.store.UpdateStatus(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	// The Call may take the answer and delete the call before the informer is seen
	// holding it.
	until(t, "the informer to see "+name+" "+out.ResourceVersion+" or its deletion", func() bool {
		if c := e.ch.cached(name); c != nil && c.ResourceVersion == out.ResourceVersion {
			return true
		}
		_, err := e.store.Get(context.Background(), name)
		return apierrors.IsNotFound(err)
	})
	return out
}

// settle waits until every timer a Call set is in place, so that a Step reaches it.
func (e *env) settle(t *testing.T, timers int) {
	t.Helper()
	until(t, "the Call's timers", func() bool { return e.clock.Waiters() >= timers })
}

func metav1Now(e *env) metav1.Time { return metav1.NewTime(e.clock.Now()) }

func deleteReq(id string) *csi.DeleteVolumeRequest { return &csi.DeleteVolumeRequest{VolumeId: id} }

// judged waits until the sweeper's handler has seen the call name in state.
func (e *env) judged(t *testing.T, name string, state nodecall.Phase) {
	t.Helper()
	until(t, "the sweeper to see "+name+" "+string(state), func() bool {
		e.sweep.mu.Lock()
		defer e.sweep.mu.Unlock()
		o, ok := e.sweep.seen[name]
		return ok && o.state == state
	})
}

// seenRunning waits until the Channel's handler has seen the call name Running.
func (e *env) seenRunning(t *testing.T, name string) {
	t.Helper()
	until(t, "the Channel to see "+name+" Running", func() bool {
		e.ch.mu.Lock()
		defer e.ch.mu.Unlock()
		_, ok := e.ch.running[name]
		return ok
	})
}
