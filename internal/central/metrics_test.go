package central

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// TestCallMetrics: each call is counted by node, method and code (a node not live too,
// with nothing created), timed by the Channel's clock, and in flight while it waits;
// the calls in view are counted by node and state.
func TestCallMetrics(t *testing.T) {
	e := newEnv(t)
	mx := e.ch.d.Metrics
	const target = "local.3f2a"

	// Node c was never seen: UNAVAILABLE, counted, nothing made.
	if _, err := e.ch.Call(context.Background(), "c", "CreateVolume", target, createReq("pvc-1")); status.Code(err) != codes.Unavailable {
		t.Fatalf("node c: %v", err)
	}
	// A method off the allow-list is no label value.
	if _, err := e.ch.Call(context.Background(), "b", "NodeStageVolume", target, createReq("pvc-1")); status.Code(err) != codes.Internal {
		t.Fatalf("off the allow-list: %v", err)
	}

	req := createReq("pvc-1")
	name := nameOf(t, "b", "CreateVolume", req)
	res := e.call("b", "CreateVolume", target, req)
	e.cached(t, name, "")
	e.settle(t, 3)
	if got := testutil.ToFloat64(mx.inFlight.WithLabelValues("b")); got != 1 {
		t.Errorf("in flight on b while waiting: %v", got)
	}
	want := `
# HELP poolcsi_central_pool_calls PoolCalls in the central controller's view, by node and state: untaken (no agent took it yet), running, done (answered, not yet deleted).
# TYPE poolcsi_central_pool_calls gauge
poolcsi_central_pool_calls{node="b",state="untaken"} 1
`
	if err := testutil.GatherAndCompare(e.reg, strings.NewReader(want), "poolcsi_central_pool_calls"); err != nil {
		t.Error(err)
	}
	e.answer(t, name, running)
	e.clock.Step(3 * time.Second) // the call takes 3 s by the Channel's clock
	e.answer(t, name, done(codes.OK, "", encodedCreate(t, target)))
	if r := <-res; r.err != nil {
		t.Fatalf("call on b: %v", r.err)
	}

	for _, c := range []struct {
		node, method, code string
		want               float64
	}{
		{"c", "CreateVolume", "Unavailable", 1},
		{"b", "CreateVolume", "OK", 1},
		{"b", "NodeStageVolume", "Internal", 0},
	} {
		if got := testutil.ToFloat64(mx.calls.WithLabelValues(c.node, c.method, c.code)); got != c.want {
			t.Errorf("calls %s %s %s: %v, want %v", c.node, c.method, c.code, got, c.want)
		}
	}
	if got := testutil.ToFloat64(mx.inFlight.WithLabelValues("b")); got != 0 {
		t.Errorf("in flight on b once answered: %v", got)
	}
	// Two series of calls, and the histogram of the OK create saw 3 s.
	if n := testutil.CollectAndCount(mx.calls); n != 3 { // the Internal one made by WithLabelValues above
		t.Errorf("%d call series", n)
	}
	want = `
# HELP poolcsi_central_node_call_duration_seconds Duration of the central controller's calls to nodes' agents, from the call to its answer, by method and gRPC code.
# TYPE poolcsi_central_node_call_duration_seconds histogram
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="0.005"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="0.01"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="0.025"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="0.05"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="0.1"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="0.25"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="0.5"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="1"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="2.5"} 0
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="5"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="10"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="20"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="30"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="60"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="120"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="OK",method="CreateVolume",le="+Inf"} 1
poolcsi_central_node_call_duration_seconds_sum{code="OK",method="CreateVolume"} 3
poolcsi_central_node_call_duration_seconds_count{code="OK",method="CreateVolume"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="0.005"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="0.01"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="0.025"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="0.05"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="0.1"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="0.25"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="0.5"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="1"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="2.5"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="5"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="10"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="20"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="30"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="60"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="120"} 1
poolcsi_central_node_call_duration_seconds_bucket{code="Unavailable",method="CreateVolume",le="+Inf"} 1
poolcsi_central_node_call_duration_seconds_sum{code="Unavailable",method="CreateVolume"} 0
poolcsi_central_node_call_duration_seconds_count{code="Unavailable",method="CreateVolume"} 1
`
	if err := testutil.GatherAndCompare(e.reg, strings.NewReader(want), "poolcsi_central_node_call_duration_seconds"); err != nil {
		t.Error(err)
	}
}

// TestSweptMetrics: each call the sweeper deletes is counted by reason; one it leaves
// (running) is not.
func TestSweptMetrics(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	mk := func(target string) *nodecall.Call {
		t.Helper()
		c, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: "DeleteVolume", Target: target, Request: deleteReq(target), Issued: e.clock.Now(), NotAfter: e.clock.Now()})
		if err != nil {
			t.Fatal(err)
		}
		made, err := e.store.Create(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		e.cached(t, made.Name, made.ResourceVersion)
		e.judged(t, made.Name, "")
		return made
	}
	untaken, answered, run := mk("local.1"), mk("local.2"), mk("local.3")
	e.answer(t, answered.Name, done(codes.OK, "", ""))
	e.judged(t, answered.Name, nodecall.Done)
	e.answer(t, run.Name, running)
	e.judged(t, run.Name, nodecall.Running)
	e.clock.Step(UntakenFor)
	e.sweep.Sweep(ctx)
	for _, n := range []string{untaken.Name, answered.Name} {
		e.gone(t, n)
	}
	want := `
# HELP poolcsi_central_swept_calls_total PoolCalls the sweeper deleted, by reason: answered (no retry came for the answer) or untaken (no agent took the call).
# TYPE poolcsi_central_swept_calls_total counter
poolcsi_central_swept_calls_total{reason="answered"} 1
poolcsi_central_swept_calls_total{reason="untaken"} 1
`
	if err := testutil.GatherAndCompare(e.reg, strings.NewReader(want), "poolcsi_central_swept_calls_total"); err != nil {
		t.Error(err)
	}
}

// TestNodeMetrics: every node with a PoolNode, live or not, and how long since it was
// seen changing (-1: not since this process started); computed on each scrape.
func TestNodeMetrics(t *testing.T) {
	n := &srvNodes{down: map[string]bool{"b": true}, pools: map[string][]nodecall.PoolCapacity{"a": nil, "b": nil}}
	reg := prometheus.NewRegistry()
	if _, err := NewMetrics(MetricsDeps{Registry: reg, Nodes: n}); err != nil {
		t.Fatal(err)
	}
	want := `
# HELP poolcsi_central_node_live 1 while the central controller has seen the node's PoolNode change within --node-stale-after (its agent renews it), else 0: calls for the node answer UNAVAILABLE.
# TYPE poolcsi_central_node_live gauge
poolcsi_central_node_live{node="a"} 1
poolcsi_central_node_live{node="b"} 0
# HELP poolcsi_central_node_unchanged_seconds Seconds since the central controller saw the node's PoolNode change, by its own clock; -1 while it has not seen it change since it started.
# TYPE poolcsi_central_node_unchanged_seconds gauge
poolcsi_central_node_unchanged_seconds{node="a"} 1
poolcsi_central_node_unchanged_seconds{node="b"} 34
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "poolcsi_central_node_live", "poolcsi_central_node_unchanged_seconds"); err != nil {
		t.Error(err)
	}
	// A node whose PoolNode this process never saw change.
	v := &NodeView{staleAfter: DefaultStaleAfter, clk: clocktesting.NewFakeClock(time.Now()), seen: map[string]sighting{"a": {rv: "1"}}}
	reg = prometheus.NewRegistry()
	if _, err := NewMetrics(MetricsDeps{Registry: reg, Nodes: v}); err != nil {
		t.Fatal(err)
	}
	want = `
# HELP poolcsi_central_node_unchanged_seconds Seconds since the central controller saw the node's PoolNode change, by its own clock; -1 while it has not seen it change since it started.
# TYPE poolcsi_central_node_unchanged_seconds gauge
poolcsi_central_node_unchanged_seconds{node="a"} -1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "poolcsi_central_node_unchanged_seconds"); err != nil {
		t.Error(err)
	}
	// Registered twice on one registry: an error, not a panic.
	if _, err := NewMetrics(MetricsDeps{Registry: reg}); err == nil {
		t.Error("registering twice: no error")
	}
}
