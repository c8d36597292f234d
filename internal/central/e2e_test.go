package central_test

// The channel end to end in one process: the Channel and two real agents, each before a
// real driver over the fake kernel, over one fake API server.

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/poolcsi/poolcsi/internal/central/centraltest"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
)

const topologyKey = "topology.poolcsi.io/node"

func createOn(node, name string) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
		Parameters:                map[string]string{"pool": centraltest.Pool},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{topologyKey: node}}}}}
}

func volumes(t *testing.T, n *centraltest.Node) []string {
	t.Helper()
	l, err := csi.NewControllerClient(n.Conn).ListVolumes(context.Background(), &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range l.GetEntries() {
		ids = append(ids, e.GetVolume().GetVolumeId())
	}
	return ids
}

func TestEndToEnd(t *testing.T) {
	c := centraltest.New(t, "a", "b")
	call := func(node string, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		resp, err := c.Channel.Call(ctx, node, "CreateVolume", "local.x", req)
		if err != nil {
			return nil, err
		}
		return resp.(*csi.CreateVolumeResponse), nil
	}

	// A create sent to b is made in b's pool only, and answered.
	resp, err := call("b", createOn("b", "pvc-1"))
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	if got := volumes(t, c.Node("b")); len(got) != 1 || got[0] != id {
		t.Errorf("b's pool: %v, want [%s]", got, id)
	}
	if got := volumes(t, c.Node("a")); len(got) != 0 {
		t.Errorf("a's pool: %v, want none", got)
	}
	if seg := resp.GetVolume().GetAccessibleTopology(); len(seg) != 1 || seg[0].GetSegments()[topologyKey] != "b" {
		t.Errorf("topology %v", seg)
	}

	// b's agent dies after the node made pvc-2, before its answer was written.
	b := c.Node("b")
	b.StopAgent()
	req := createOn("b", "pvc-2")
	m, _ := nodecall.Lookup("CreateVolume")
	name, err := m.ObjectName("b", req)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		resp *csi.CreateVolumeResponse
		err  error
	}
	res := make(chan result, 1)
	go func() {
		r, err := call("b", req)
		res <- result{r, err}
	}()
	made := c.WaitCached(t, name, func(*nodecall.Call) bool { return true })
	made2, err := csi.NewControllerClient(b.Conn).CreateVolume(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	made.Status = nodecall.CallStatus{Nonce: made.Spec.Nonce, Phase: nodecall.Running, Attempts: 1}
	if _, err := c.Store.UpdateStatus(context.Background(), made); err != nil {
		t.Fatal(err)
	}
	c.WaitCached(t, name, func(cl *nodecall.Call) bool { return cl.Status.Phase == nodecall.Running })
	c.WaitTimers(t, 3) // the Call's budget, pickup and stale timers
	// Past the budget (the 30 s less the margin, counted from the clock's start), short
	// of the stale limit.
	c.Clock.Step(40 * time.Second)
	if r := <-res; status.Code(r.err) != codes.Aborted {
		t.Fatalf("running at the budget: %v %v", r.resp, r.err)
	}
	// The restarted agent runs it again; the retry finds it and its answer.
	b.StartAgent(t)
	c.WaitLive(t, "b")
	again, err := call("b", req)
	if err != nil {
		t.Fatal(err)
	}
	if again.GetVolume().GetVolumeId() != made2.GetVolume().GetVolumeId() {
		t.Errorf("retry answered %v, the node made %v", again.GetVolume(), made2.GetVolume())
	}
	if got := volumes(t, b); len(got) != 2 {
		t.Errorf("b's pool after the crash: %v, want pvc-1's and pvc-2's", got)
	}

	// a's agent stops: once a is stale, a call to it is UNAVAILABLE and nothing is made.
	c.Node("a").StopAgent()
	c.MakeStale(t, "a")
	reqA := createOn("a", "pvc-3")
	if _, err := call("a", reqA); status.Code(err) != codes.Unavailable {
		t.Fatalf("call to a stale node: %v", err)
	}
	nameA, _ := m.ObjectName("a", reqA)
	if _, err := c.Store.Get(context.Background(), nameA); !apierrors.IsNotFound(err) {
		t.Errorf("a call was made for a stale node: %v", err)
	}
	if got := volumes(t, c.Node("a")); len(got) != 0 {
		t.Errorf("a's pool: %v", got)
	}
}

// TestEndToEndSnapshotCrash: b's agent dies after the node made the snapshot, before its
// answer was written; the retry through the restarted agent answers the same snapshot,
// and the pool holds one.
func TestEndToEndSnapshotCrash(t *testing.T) {
	c := centraltest.New(t, "b")
	b := c.Node("b")
	ctx := context.Background()
	vol, err := c.Channel.Call(ctx, "b", "CreateVolume", "local.x", createOn("b", "pvc-1"))
	if err != nil {
		t.Fatal(err)
	}
	vid := vol.(*csi.CreateVolumeResponse).GetVolume().GetVolumeId()
	req := &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: vid}
	sid := pool.NewSnapshotID(centraltest.Pool, req.GetName()).String()
	call := func() (*csi.CreateSnapshotResponse, error) {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		resp, err := c.Channel.Call(ctx, "b", "CreateSnapshot", sid, req)
		if err != nil {
			return nil, err
		}
		return resp.(*csi.CreateSnapshotResponse), nil
	}

	b.StopAgent()
	m, _ := nodecall.Lookup("CreateSnapshot")
	name, err := m.ObjectName("b", req)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		resp *csi.CreateSnapshotResponse
		err  error
	}
	res := make(chan result, 1)
	go func() {
		r, err := call()
		res <- result{r, err}
	}()
	made := c.WaitCached(t, name, func(*nodecall.Call) bool { return true })
	// What the agent did before it died: Running written, the node ran the call.
	made.Status = nodecall.CallStatus{Nonce: made.Spec.Nonce, Phase: nodecall.Running, Attempts: 1}
	if _, err := c.Store.UpdateStatus(ctx, made); err != nil {
		t.Fatal(err)
	}
	snap, err := csi.NewControllerClient(b.Conn).CreateSnapshot(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	c.WaitCached(t, name, func(cl *nodecall.Call) bool { return cl.Status.Phase == nodecall.Running })
	c.WaitTimers(t, 3) // the Call's budget, pickup and stale timers
	c.Clock.Step(40 * time.Second)
	if r := <-res; status.Code(r.err) != codes.Aborted {
		t.Fatalf("running at the budget: %v %v", r.resp, r.err)
	}

	b.StartAgent(t)
	c.WaitLive(t, "b")
	again, err := call()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := again.GetSnapshot().GetSnapshotId(), snap.GetSnapshot().GetSnapshotId(); got != want || got != sid {
		t.Errorf("retry answered snapshot %s, the node made %s (target %s)", got, want, sid)
	}
	l, err := csi.NewControllerClient(b.Conn).ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(l.GetEntries()); n != 1 {
		t.Errorf("b's pool holds %d snapshots after the crash, want 1: %v", n, l.GetEntries())
	}
}
