// Package centraltest stands the channel's two ends up in one process, for tests: the
// controller's Channel and NodeView over one fake API server (nodecalltest), and nodes,
// each a real driver over the fake kernel (internal/mount/fake, no root) on its own unix
// socket with its own agent (internal/agent) before it.
//
// The controller's clock is a fake one that only the test moves: a node stays live and
// a call's timers never fire until the test steps it. The agents run on the real clock
// and beat every few milliseconds.
package centraltest

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/poolcsi/poolcsi/internal/agent"
	"github.com/poolcsi/poolcsi/internal/central"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/nodecall/nodecalltest"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// The fixture's names and timings.
const (
	Namespace = "poolcsi"
	// Pool is the local pool every node has.
	Pool = "local"
	// DriverName is the nodes' driver name.
	DriverName = "poolcsi.test"
	// StaleAfter is the controller's stale limit: longer than a call's budget in the
	// tests (a minute at most), so that stepping the clock to a budget leaves a node
	// live unless the test means otherwise.
	StaleAfter = 2 * time.Minute
	// Heartbeat is the agents' (real time).
	Heartbeat = 20 * time.Millisecond
)

// Cluster is the controller and its nodes.
type Cluster struct {
	Client *nodecalltest.Client
	Store  nodecall.Store
	// Clock is the controller's.
	Clock     *clocktesting.FakeClock
	Calls     cache.SharedIndexInformer
	PoolNodes cache.SharedIndexInformer
	Nodes     *central.NodeView
	Channel   *central.Channel

	nodes map[string]*Node
}

// Node is one node: a real driver on its socket, and its agent.
type Node struct {
	Name string
	// Conn is the node's own CSI socket.
	Conn *grpc.ClientConn
	// Endpoint is that socket's address (unix://...), for a client of its own.
	Endpoint string
	// Host is the node's fake kernel (what is mounted, what is frozen).
	Host *fake.Host

	deps agent.Deps
	mu   sync.Mutex
	stop func()
	// blocked holds the agent's calls of a gRPC method until the channel closes (Block).
	blocked map[string]chan struct{}
}

// Block holds every call the node's agent makes of the gRPC method fullMethod on its
// socket, until release is called: a node whose call runs on and on.
func (n *Node) Block(fullMethod string) (release func()) {
	n.mu.Lock()
	defer n.mu.Unlock()
	ch := make(chan struct{})
	if n.blocked == nil {
		n.blocked = map[string]chan struct{}{}
	}
	n.blocked[fullMethod] = ch
	var once sync.Once
	return func() {
		once.Do(func() {
			n.mu.Lock()
			delete(n.blocked, fullMethod)
			n.mu.Unlock()
			close(ch)
		})
	}
}

// gatedConn is the agent's connection to its node's socket, through Block.
type gatedConn struct {
	grpc.ClientConnInterface
	n *Node
}

func (g gatedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	g.n.mu.Lock()
	ch := g.n.blocked[method]
	g.n.mu.Unlock()
	if ch != nil {
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return g.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
}

// New starts the controller's informers and one node per name, each with its agent,
// and waits until every node is live. Everything stops in t.Cleanup.
func New(t testing.TB, names ...string) *Cluster {
	t.Helper()
	objs := make([]runtime.Object, 0, len(names))
	for _, n := range names {
		objs = append(objs, nodecalltest.Node(n, "uid-"+n))
	}
	c := &Cluster{Client: nodecalltest.NewClient(objs...), Clock: clocktesting.NewFakeClock(time.Now()), nodes: map[string]*Node{}}
	c.Store = nodecall.Store{Client: c.Client, Namespace: Namespace}
	c.Calls = c.Store.Informer("", 0)
	c.PoolNodes = c.Store.NodeInformer(0)
	c.Nodes = central.NewNodeView(c.PoolNodes, StaleAfter, c.Clock)
	c.Channel = central.NewChannel(central.ChannelDeps{Store: c.Store, Calls: c.Calls, Nodes: c.Nodes, Clock: c.Clock,
		NodeUID: func(ctx context.Context, node string) (string, error) {
			uid, err := c.Store.NodeUID(ctx, node)
			return string(uid), err
		}})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { c.Calls.RunWithContext(ctx) })
	wg.Go(func() { c.PoolNodes.RunWithContext(ctx) })
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	if !cache.WaitForCacheSync(ctx.Done(), c.Calls.HasSynced, c.PoolNodes.HasSynced) {
		t.Fatal("centraltest: the informers never synced")
	}
	for _, name := range names {
		n := &Node{Name: name}
		n.Conn, n.Endpoint, n.Host = serveNode(t, name)
		n.deps = agent.Deps{Calls: c.Store, Node: name, Conn: gatedConn{ClientConnInterface: n.Conn, n: n}, Pools: []string{Pool}, Heartbeat: Heartbeat, Version: "test", Pod: "poolcsi-" + name}
		c.nodes[name] = n
		n.StartAgent(t)
		t.Cleanup(n.StopAgent)
	}
	for _, name := range names {
		c.WaitLive(t, name)
	}
	return c
}

// Node returns the node of that name.
func (c *Cluster) Node(name string) *Node { return c.nodes[name] }

// WaitLive waits until the controller sees node live.
func (c *Cluster) WaitLive(t testing.TB, node string) {
	t.Helper()
	c.until(t, "node "+node+" live", func() bool {
		live, _ := c.Nodes.Live(node)
		return live
	})
}

// MakeStale moves the controller's clock until node, whose agent the test stopped, is
// not live. A heartbeat still on its way when the clock moved counts as a change at the
// new time; with no agent to write another, a second step ends it.
func (c *Cluster) MakeStale(t testing.TB, node string) {
	t.Helper()
	c.until(t, "node "+node+" stale", func() bool {
		if live, _ := c.Nodes.Live(node); !live {
			return true
		}
		c.Clock.Step(StaleAfter)
		return false
	})
}

// WaitCached waits until the controller's informer holds the call name and cond holds
// for it, and returns it.
func (c *Cluster) WaitCached(t testing.TB, name string, cond func(*nodecall.Call) bool) *nodecall.Call {
	t.Helper()
	var got *nodecall.Call
	c.until(t, "PoolCall "+name, func() bool {
		obj, ok, err := c.Calls.GetStore().GetByKey(Namespace + "/" + name)
		if err != nil || !ok {
			return false
		}
		got = nodecall.FromCache(obj)
		return got != nil && cond(got)
	})
	return got
}

// WaitTimers waits until n timers wait on the controller's clock (a Call sets its
// timers before it makes its PoolCall; the agents use the real clock), so that a Step
// reaches them.
func (c *Cluster) WaitTimers(t testing.TB, n int) {
	t.Helper()
	c.until(t, "the controller's timers", func() bool { return c.Clock.Waiters() >= n })
}

// until waits for cond; how long it takes is never what a test asserts.
func (c *Cluster) until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		return cond(), nil
	}); err != nil {
		t.Fatalf("centraltest: waiting for %s: %v", what, err)
	}
}

// StartAgent starts the node's agent (again, after StopAgent: a restarted agent).
func (n *Node) StartAgent(t testing.TB) {
	t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stop != nil {
		t.Fatalf("centraltest: the agent of %s runs already", n.Name)
	}
	w, p := agent.New(n.deps)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = w.Run(ctx) })
	wg.Go(func() { _ = p.Run(ctx) })
	n.stop = func() {
		cancel()
		wg.Wait()
	}
}

// StopAgent stops the node's agent and waits until it has returned; its driver stays.
func (n *Node) StopAgent() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stop != nil {
		n.stop()
		n.stop = nil
	}
}

// serveNode serves a real driver for node, pool Pool over the fake kernel, on a unix
// socket, and returns a connection to it, its endpoint and its kernel.
func serveNode(t testing.TB, node string) (*grpc.ClientConn, string, *fake.Host) {
	t.Helper()
	root := t.TempDir()
	p, err := pool.Initialise(pool.Config{Name: Pool, Path: filepath.Join(root, "pool")})
	if err != nil {
		t.Fatal(err)
	}
	h := fake.New()
	d, err := driver.New(driver.Options{Name: DriverName, Version: "test", NodeID: node, Mode: driver.ModeAll, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: h, Loops: h, Devices: h, FS: h, Cgroups: h}})
	if err != nil {
		t.Fatal(err)
	}
	// A short directory: a unix socket's path has a small limit.
	dir, err := os.MkdirTemp("", "poolcsi-central")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Serve(ctx, endpoint) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("centraltest: node %s: serve: %v", node, err)
		}
	})
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	// Serve listens on its own goroutine: a call made before it does fails at once
	// (UNAVAILABLE, "no such file or directory"), as an agent's first call did under
	// load. The node is handed out once its socket answers.
	wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer wcancel()
	if _, err := csi.NewIdentityClient(conn).GetPluginInfo(wctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("centraltest: node %s: its socket never answered: %v", node, err)
	}
	return conn, endpoint, h
}
