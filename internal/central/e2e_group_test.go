package central_test

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/central"
	"github.com/poolcsi/poolcsi/internal/central/centraltest"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// groupEnv is the central server over two real nodes, a and b, each with its agent.
type groupEnv struct {
	c       *centraltest.Cluster
	s       *central.Server
	ctrl    csi.ControllerClient
	grp     csi.GroupControllerClient
	staging string
}

func newGroupEnv(t *testing.T) *groupEnv {
	c := centraltest.New(t, "a", "b")
	s := central.NewServer(central.Deps{Name: centraltest.DriverName, Version: "test", TopologyKey: topologyKey,
		Params: params.Config{Pools: []string{centraltest.Pool}},
		Calls:  c.Channel, Nodes: c.Nodes, Hints: &learntHints{m: map[string]string{}}, Clock: c.Clock})
	conn := dialCentral(t, serveCentral(t, s))
	return &groupEnv{c: c, s: s, ctrl: csi.NewControllerClient(conn), grp: csi.NewGroupControllerClient(conn), staging: t.TempDir()}
}

func ctx30(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// volume makes a volume on node through central and stages it there (cap: mount ext4,
// or block), and returns its ID and staging path.
func (e *groupEnv) volume(t *testing.T, node, name string, block bool) (string, string) {
	t.Helper()
	req := createOn(node, name)
	if block {
		req.VolumeCapabilities[0].AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	}
	resp, err := e.ctrl.CreateVolume(ctx30(t), req)
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	staging := filepath.Join(e.staging, node, id)
	if _, err := csi.NewNodeClient(e.c.Node(node).Conn).NodeStageVolume(ctx30(t), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, VolumeCapability: req.VolumeCapabilities[0]}); err != nil {
		t.Fatal(err)
	}
	return id, staging
}

// nodeSnapshots are the snapshots node's own driver lists.
func (e *groupEnv) nodeSnapshots(t *testing.T, node string) []string {
	t.Helper()
	l, err := csi.NewControllerClient(e.c.Node(node).Conn).ListSnapshots(ctx30(t), &csi.ListSnapshotsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, en := range l.GetEntries() {
		out = append(out, en.GetSnapshot().GetSnapshotId())
	}
	return out
}

// TestEndToEndGroupAcrossNodes: a group with a member on each of two agents is
// created (both frozen at once, thawed after), got and listed through central, and
// deleted from both nodes.
func TestEndToEndGroupAcrossNodes(t *testing.T) {
	e := newGroupEnv(t)
	v1, st1 := e.volume(t, "a", "pvc-1", false)
	v2, st2 := e.volume(t, "b", "pvc-2", false)
	resp, err := e.grp.CreateVolumeGroupSnapshot(ctx30(t), &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: []string{v1, v2}})
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetGroupSnapshot()
	gid := pool.GroupSnapshotID{SnapshotID: pool.NewSnapshotID(centraltest.Pool, "db")}
	if g.GetGroupSnapshotId() != gid.String() || !g.GetReadyToUse() || len(g.GetSnapshots()) != 2 {
		t.Fatalf("group %v", g)
	}
	var ids []string
	for i, v := range []string{v1, v2} {
		want := pool.GroupMemberID(gid, v).String()
		if s := g.GetSnapshots()[i]; s.GetSnapshotId() != want || s.GetSourceVolumeId() != v || s.GetGroupSnapshotId() != gid.String() {
			t.Errorf("member %d: %v, want %s of %s", i, s, want, v)
		}
		ids = append(ids, want)
	}
	// Each node holds its own member, and froze it for the copy (and thawed it).
	if got := e.nodeSnapshots(t, "a"); !slices.Equal(got, ids[:1]) {
		t.Errorf("a's snapshots %v, want %v", got, ids[:1])
	}
	if got := e.nodeSnapshots(t, "b"); !slices.Equal(got, ids[1:]) {
		t.Errorf("b's snapshots %v, want %v", got, ids[1:])
	}
	for node, st := range map[string]string{"a": st1, "b": st2} {
		h := e.c.Node(node).Host
		if h.Frozen(st) || h.Faults.Calls("Freeze") != 1 || h.Faults.Calls("Thaw") != 1 {
			t.Errorf("node %s: frozen now %v, froze %d times, thawed %d times; want once each, thawed", node, h.Frozen(st), h.Faults.Calls("Freeze"), h.Faults.Calls("Thaw"))
		}
	}

	// Got and listed through central.
	got, err := e.grp.GetVolumeGroupSnapshot(ctx30(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: gid.String(), SnapshotIds: ids})
	if err != nil || len(got.GetGroupSnapshot().GetSnapshots()) != 2 || !got.GetGroupSnapshot().GetReadyToUse() {
		t.Fatalf("get: %v %v", got, err)
	}
	l, err := e.ctrl.ListSnapshots(ctx30(t), &csi.ListSnapshotsRequest{})
	if err != nil || len(l.GetEntries()) != 2 {
		t.Fatalf("list: %v %v", l, err)
	}
	// A retry of the create answers the same group, copying nothing again.
	again, err := e.grp.CreateVolumeGroupSnapshot(ctx30(t), &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: []string{v1, v2}})
	if err != nil || again.GetGroupSnapshot().GetGroupSnapshotId() != gid.String() || len(again.GetGroupSnapshot().GetSnapshots()) != 2 {
		t.Fatalf("retry: %v %v", again, err)
	}

	if _, err := e.grp.DeleteVolumeGroupSnapshot(ctx30(t), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: gid.String(), SnapshotIds: ids}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"a", "b"} {
		if got := e.nodeSnapshots(t, n); len(got) != 0 {
			t.Errorf("%s's snapshots after the delete: %v", n, got)
		}
	}
	_, err = e.grp.GetVolumeGroupSnapshot(ctx30(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: gid.String(), SnapshotIds: ids})
	if status.Code(err) != codes.NotFound {
		t.Errorf("get after delete: %v", err)
	}
}

// TestEndToEndGroupAcrossNodesHoldRefused: b refuses its hold (its member is a block
// volume staged read-write, which cannot be frozen); a, which froze its member, is
// thawed, and no node records a part.
func TestEndToEndGroupAcrossNodesHoldRefused(t *testing.T) {
	e := newGroupEnv(t)
	v1, st1 := e.volume(t, "a", "pvc-1", false)
	v2, _ := e.volume(t, "b", "pvc-2", true)
	_, err := e.grp.CreateVolumeGroupSnapshot(ctx30(t), &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: []string{v1, v2}})
	if status.Code(err) != codes.Aborted {
		t.Fatalf("create: %v, want ABORTED", err)
	}
	h := e.c.Node("a").Host
	if h.Frozen(st1) || h.Faults.Calls("Freeze") != h.Faults.Calls("Thaw") {
		t.Errorf("a: frozen %v, froze %d, thawed %d", h.Frozen(st1), h.Faults.Calls("Freeze"), h.Faults.Calls("Thaw"))
	}
	// a's member is free again: its stage (idempotent) is not refused as busy.
	if _, err := csi.NewNodeClient(e.c.Node("a").Conn).NodeStageVolume(ctx30(t), &csi.NodeStageVolumeRequest{
		VolumeId: v1, StagingTargetPath: st1, VolumeCapability: createOn("a", "pvc-1").VolumeCapabilities[0]}); err != nil {
		t.Errorf("a's member after the refusal: %v", err)
	}
	for _, n := range []string{"a", "b"} {
		if got := e.nodeSnapshots(t, n); len(got) != 0 {
			t.Errorf("%s's snapshots: %v", n, got)
		}
	}
}

func dialCentral(t *testing.T, endpoint string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// callOf waits until the controller's informer holds a call of method for node for
// which cond holds.
func (e *groupEnv) callOf(t *testing.T, node, method string, cond func(*nodecall.Call) bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, o := range e.c.Calls.GetStore().List() {
			if cl := nodecall.FromCache(o); cl != nil && cl.Spec.Node == node && cl.Spec.Method == method && cond(cl) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s call of node %s as waited for", method, node)
		}
		time.Sleep(time.Millisecond)
	}
}

func done(cl *nodecall.Call) bool { return cl.Answered() }

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s", what)
		}
	}
}

// TestEndToEndGroupAcrossNodesHoldRunsOn: b's hold runs on past the create's
// budget (its node is stuck): the create is ABORTED, a (which froze its member) is
// thawed at once, and no part is recorded. When b's hold ends at last, b runs the
// thaw queued behind it (a node runs a group's calls in the order issued): b is left
// thawed too.
func TestEndToEndGroupAcrossNodesHoldRunsOn(t *testing.T) {
	e := newGroupEnv(t)
	v1, st1 := e.volume(t, "a", "pvc-1", false)
	v2, st2 := e.volume(t, "b", "pvc-2", false)
	b := e.c.Node("b")
	release := b.Block(nodecall.GroupHoldFullMethod(nodecall.MethodFreezeGroupHold))
	t.Cleanup(release)
	res := make(chan error, 1)
	go func() {
		_, err := e.grp.CreateVolumeGroupSnapshot(ctx30(t), &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: []string{v1, v2}})
		res <- err
	}()
	// a's hold is answered (its member frozen); b's runs on.
	a := e.c.Node("a").Host
	waitUntil(t, "a's member frozen in phase 1", func() bool { return a.Frozen(st1) })
	e.callOf(t, "b", nodecall.MethodFreezeGroupHold, func(cl *nodecall.Call) bool { return cl.Status.Phase == nodecall.Running })
	e.c.WaitTimers(t, 3) // b's call's budget, pickup and stale timers
	e.c.Clock.Step(40 * time.Second)
	// The abort: a's thaw is answered at once; b's waits behind its hold, not taken.
	waitUntil(t, "a thawed by the abort", func() bool { return !a.Frozen(st1) })
	e.callOf(t, "b", nodecall.MethodThawGroup, func(*nodecall.Call) bool { return true })
	e.c.WaitTimers(t, 3)
	e.c.Clock.Step(11 * time.Second)
	if err := <-res; status.Code(err) != codes.Aborted {
		t.Fatalf("create: %v, want ABORTED", err)
	}
	for _, n := range []string{"a", "b"} {
		if got := e.nodeSnapshots(t, n); len(got) != 0 {
			t.Errorf("%s's snapshots: %v", n, got)
		}
	}
	// b's hold ends at last: it freezes, then its queued thaw runs.
	release()
	e.callOf(t, "b", nodecall.MethodThawGroup, done)
	h := b.Host
	if h.Frozen(st2) || h.Faults.Calls("Freeze") != 1 || h.Faults.Calls("Thaw") != 1 {
		t.Errorf("b after its hold: frozen %v, froze %d, thawed %d; want once each, thawed", h.Frozen(st2), h.Faults.Calls("Freeze"), h.Faults.Calls("Thaw"))
	}
	if a.Faults.Calls("Freeze") != 1 || a.Faults.Calls("Thaw") != 1 {
		t.Errorf("a froze %d, thawed %d; want once each", a.Faults.Calls("Freeze"), a.Faults.Calls("Thaw"))
	}
}
