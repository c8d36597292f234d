package agent

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// nodeWrites counts the PoolNode status writes the fake took.
func (e *env) nodeWrites() int {
	n := 0
	for _, a := range e.client.Actions() {
		if a.GetVerb() == "update" && a.GetResource() == nodecall.NodesResource && a.GetSubresource() == "status" {
			n++
		}
	}
	return n
}

// The first beat creates the PoolNode, owned by the Node, and reports each pool as the
// node's own GetCapacity answers it, with this node's topology; a pool that does not
// answer is Unavailable.
func TestPublisherFirstBeat(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	e.deps.Pools = []string{"local", "broken"}
	e.deps.Version, e.deps.Pod = "0.3.0", "poolcsi-node-x"
	e.srv.handle = func(_ context.Context, _ string, req proto.Message) (proto.Message, error) {
		r := req.(*csi.GetCapacityRequest)
		if r.GetAccessibleTopology().GetSegments()[topologyKey] != "b" {
			t.Errorf("asked with topology %v", r.GetAccessibleTopology())
		}
		if r.GetParameters()[poolParam] == "broken" {
			return nil, status.Error(codes.Unavailable, "pool broken does not answer")
		}
		return &csi.GetCapacityResponse{AvailableCapacity: 16 << 30, MaximumVolumeSize: wrapperspb.Int64(16 << 30), MinimumVolumeSize: wrapperspb.Int64(1 << 20)}, nil
	}
	_, p := New(e.deps)
	if err := p.Beat(ctx, false); err != nil {
		t.Fatal(err)
	}
	n, err := e.store.GetNode(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if len(n.OwnerReferences) != 1 || n.OwnerReferences[0].UID != "uid-b" || n.OwnerReferences[0].Kind != "Node" {
		t.Errorf("owner %v", n.OwnerReferences)
	}
	want := []nodecall.PoolCapacity{
		{Name: "local", AvailableBytes: 16 << 30, MaximumVolumeSize: 16 << 30, MinimumVolumeSize: 1 << 20, Condition: nodecall.PoolOk},
		{Name: "broken", Condition: nodecall.PoolUnavailable},
	}
	if len(n.Status.Pools) != 2 || n.Status.Pools[0] != want[0] || n.Status.Pools[1] != want[1] {
		t.Errorf("pools %+v, want %+v", n.Status.Pools, want)
	}
	if n.Status.RenewTime == nil || n.Status.Agent.Pod != "poolcsi-node-x" || n.Status.Agent.Version != "0.3.0" {
		t.Errorf("status %+v", n.Status)
	}
	// Someone else wrote it meanwhile: the beat fails, and the next one reads it again.
	other := n.DeepCopy()
	other.Status.Agent.Pod = "someone"
	if _, err := e.store.UpdateNodeStatus(ctx, other); err != nil {
		t.Fatal(err)
	}
	if err := p.Beat(ctx, false); err == nil {
		t.Error("a beat over a changed PoolNode succeeded")
	}
	if err := p.Beat(ctx, false); err != nil {
		t.Errorf("beat after a re-read: %v", err)
	}
}

// The figures are refreshed when one moves by 1 MiB or more, when prompted, and at least
// every minute; each beat still renews.
func TestPublisherCapacityRefresh(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	var avail atomic.Int64
	avail.Store(100 << 20)
	e.srv.handle = func(context.Context, string, proto.Message) (proto.Message, error) {
		return &csi.GetCapacityResponse{AvailableCapacity: avail.Load()}, nil
	}
	_, p := New(e.deps)
	if err := p.Beat(ctx, false); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		name    string
		avail   int64
		fresh   bool
		advance time.Duration
		want    int64
	}{
		{"moved less than 1 MiB", 100<<20 - 1000, false, time.Second, 100 << 20},
		{"prompted", 100<<20 - 1000, true, time.Second, 100<<20 - 1000},
		{"moved 1 MiB", 99<<20 - 1000, false, time.Second, 99<<20 - 1000},
		{"small move", 99 << 20, false, time.Second, 99<<20 - 1000},
		{"a minute on", 99 << 20, false, time.Minute, 99 << 20},
	} {
		avail.Store(step.avail)
		e.clock.Step(step.advance)
		before, _ := e.store.GetNode(ctx, "b")
		if err := p.Beat(ctx, step.fresh); err != nil {
			t.Fatal(err)
		}
		n, _ := e.store.GetNode(ctx, "b")
		if got := n.Status.Pools[0].AvailableBytes; got != step.want {
			t.Errorf("%s: published %d, want %d", step.name, got, step.want)
		}
		if !n.Status.RenewTime.After(before.Status.RenewTime.Time) {
			t.Errorf("%s: not renewed", step.name)
		}
	}
}

// Pokes coalesce: many before the publisher gets to them make one write, and Run then
// waits for the heartbeat.
func TestPublisherCoalesces(t *testing.T) {
	e := newEnv(t, "b")
	_, p := New(e.deps)
	for range 5 {
		p.Poke()
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	waitFor := func(writes int) {
		t.Helper()
		// Run is idle once it waits on the clock; then the count is final.
		if err := wait.PollUntilContextTimeout(ctx, time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return e.clock.HasWaiters() && e.nodeWrites() >= writes, nil
		}); err != nil {
			t.Fatalf("waiting for %d writes: %v (have %d)", writes, err, e.nodeWrites())
		}
		if got := e.nodeWrites(); got != writes {
			t.Fatalf("%d writes, want %d", got, writes)
		}
	}
	waitFor(1)
	e.clock.Step(DefaultHeartbeat)
	waitFor(2)
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
}

// A pool whose GetCapacity hangs is Unavailable within a heartbeat; the heartbeat goes on.
func TestPublisherHungPool(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	e.deps.Heartbeat = time.Millisecond // at least a second: the bound of one GetCapacity
	e.srv.handle = func(ctx context.Context, _ string, _ proto.Message) (proto.Message, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	_, p := New(e.deps)
	if err := p.Beat(ctx, false); err != nil {
		t.Fatal(err)
	}
	n, err := e.store.GetNode(ctx, "b")
	if err != nil || len(n.Status.Pools) != 1 || n.Status.Pools[0].Condition != nodecall.PoolUnavailable || n.Status.RenewTime == nil {
		t.Errorf("PoolNode %+v %v", n, err)
	}
}
