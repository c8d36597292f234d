package central

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// crossEnv is a server over nodes a, b and c with v1 on a and v2, v3 on b, hinted.
type crossEnv struct {
	*srvEnv
	v1, v2, v3 string
	gid        pool.GroupSnapshotID
}

func newCrossEnv() *crossEnv {
	e := &crossEnv{srvEnv: newSrvEnv()}
	e.v1, e.v2, e.v3 = e.vol("a", "pvc-1"), e.vol("b", "pvc-2"), e.vol("b", "pvc-3")
	e.hints.vol[e.v1], e.hints.vol[e.v2], e.hints.vol[e.v3] = "a", "b", "b"
	e.gid = pool.GroupSnapshotID{SnapshotID: pool.NewSnapshotID("local", "g")}
	return e
}

func (e *crossEnv) create() (*csi.CreateVolumeGroupSnapshotResponse, error) {
	return e.group().CreateVolumeGroupSnapshot(context.Background(), &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{e.v2, e.v1, e.v3}})
}

func (e *crossEnv) memberIDs() []string {
	var out []string
	for _, v := range []string{e.v1, e.v2, e.v3} {
		out = append(out, pool.GroupMemberID(e.gid, v).String())
	}
	return out
}

// of is the calls of method, as node:method, sorted.
func (e *crossEnv) of(methods ...string) []string {
	var out []string
	for _, c := range e.world.made() {
		if slices.Contains(methods, c.method) {
			out = append(out, c.node+":"+c.method)
		}
	}
	slices.Sort(out)
	return out
}

// nothingLeft: no node holds anything of the group, nor a part.
func (e *crossEnv) nothingLeft(t *testing.T) {
	t.Helper()
	for _, n := range []string{"a", "b", "c"} {
		if _, ok := e.world.holds[n][e.gid.String()]; ok {
			t.Errorf("node %s still holds the group", n)
		}
		if e.world.groups[n][e.gid.String()] {
			t.Errorf("node %s still has a part", n)
		}
	}
}

// TestGroupAcrossNodes: the two phases, every hold before any copy; the answer merges
// the parts in the request's order; Get and Delete go to every node with a part.
func TestGroupAcrossNodes(t *testing.T) {
	ctx := context.Background()
	e := newCrossEnv()
	resp, err := e.create()
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetGroupSnapshot()
	if g.GetGroupSnapshotId() != e.gid.String() || !g.GetReadyToUse() || len(g.GetSnapshots()) != 3 {
		t.Fatalf("group %v", g)
	}
	for i, v := range []string{e.v2, e.v1, e.v3} {
		if s := g.GetSnapshots()[i]; s.GetSourceVolumeId() != v || s.GetSnapshotId() != pool.GroupMemberID(e.gid, v).String() {
			t.Errorf("snapshot %d: %v, want of %s", i, s, v)
		}
	}
	var phases []string
	for _, c := range e.world.made() {
		if c.target == e.gid.String() {
			phases = append(phases, c.method)
		} else if c.method != "ControllerGetVolume" {
			t.Errorf("call %v", c)
		}
	}
	if !slices.Equal(phases, []string{"FreezeGroupHold", "FreezeGroupHold", "SnapshotHeld", "SnapshotHeld"}) {
		t.Errorf("calls %v: want both holds before any copy", phases)
	}
	if got := e.of(nodecall.MethodFreezeGroupHold); !slices.Equal(got, []string{"a:FreezeGroupHold", "b:FreezeGroupHold"}) {
		t.Errorf("holds %v", got)
	}
	if got := e.hints.learntGroups[e.gid.String()]; !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("learnt group nodes %v", got)
	}

	get, err := e.group().GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()})
	if err != nil || len(get.GetGroupSnapshot().GetSnapshots()) != 3 || !get.GetGroupSnapshot().GetReadyToUse() {
		t.Fatalf("get: %v %v", get, err)
	}
	// A node down: its part may be there.
	e.nodes.down["b"] = true
	_, err = e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()})
	if codeOf(err) != codes.Unavailable {
		t.Fatalf("delete with b down: %v", err)
	}
	e.nodes.down["b"] = false
	for range 2 {
		if _, err := e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()}); err != nil {
			t.Fatal(err)
		}
	}
	e.nothingLeft(t)
	_, err = e.group().GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()})
	if codeOf(err) != codes.NotFound {
		t.Fatalf("get after delete: %v", err)
	}
}

// TestGroupAcrossNodesFailures: any failure lets every hold go, removes every part,
// and answers ABORTED for a refusal, UNAVAILABLE for a node that did not answer.
func TestGroupAcrossNodesFailures(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fail    func(node, method string) error
		tamper  func(node string, resp proto.Message)
		want    codes.Code
		copying bool // the copies were asked for
	}{
		{name: "a node refuses the hold", want: codes.Aborted, fail: func(node, method string) error {
			if node == "b" && method == nodecall.MethodFreezeGroupHold {
				return statusErr(codes.FailedPrecondition)
			}
			return nil
		}},
		{name: "a node does not take the hold", want: codes.Unavailable, fail: func(node, method string) error {
			if node == "b" && method == nodecall.MethodFreezeGroupHold {
				return statusErr(codes.Unavailable)
			}
			return nil
		}},
		{name: "a node's hold ended before its copy", want: codes.Aborted, copying: true, fail: func(node, method string) error {
			if node == "b" && method == nodecall.MethodSnapshotHeld {
				return statusErr(codes.Aborted)
			}
			return nil
		}},
		{name: "a node answers another's snapshot", want: codes.Aborted, copying: true, tamper: func(node string, resp proto.Message) {
			if g, ok := resp.(*csi.CreateVolumeGroupSnapshotResponse); ok && node == "b" {
				g.GetGroupSnapshot().GetSnapshots()[0].SnapshotId = "local@0123456789abcdef0123456789abcdef"
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newCrossEnv()
			e.world.fail, e.world.tamper = tc.fail, tc.tamper
			_, err := e.create()
			if codeOf(err) != tc.want || !strings.Contains(err.Error(), "node b") {
				t.Fatalf("got %v, want %s naming node b", err, tc.want)
			}
			if got := e.of(nodecall.MethodThawGroup); !slices.Equal(got, []string{"a:ThawGroup", "b:ThawGroup"}) {
				t.Errorf("thaws %v, want every node asked", got)
			}
			copies := e.of(nodecall.MethodSnapshotHeld)
			if !tc.copying && len(copies) != 0 {
				t.Errorf("copies %v after a failed hold", copies)
			}
			if tc.copying && !slices.Equal(e.of("DeleteVolumeGroupSnapshot"), []string{"a:DeleteVolumeGroupSnapshot", "b:DeleteVolumeGroupSnapshot"}) {
				t.Errorf("deletes %v, want every part's", e.of("DeleteVolumeGroupSnapshot"))
			}
			e.nothingLeft(t)
		})
	}
	t.Run("a node down: nothing asked", func(t *testing.T) {
		e := newCrossEnv()
		e.nodes.down["b"] = true
		_, err := e.create()
		if codeOf(err) != codes.Unavailable {
			t.Fatalf("got %v", err)
		}
		if got := e.of(nodecall.MethodFreezeGroupHold, nodecall.MethodThawGroup); len(got) != 0 {
			t.Errorf("calls %v", got)
		}
	})
}

// TestGroupAcrossNodesRetry: a retried create asks each node with the same request,
// so its calls have the first try's names and the retry finds them.
func TestGroupAcrossNodesRetry(t *testing.T) {
	e := newCrossEnv()
	names := func() map[string]bool {
		out := map[string]bool{}
		for _, c := range e.world.made() {
			if c.method == nodecall.MethodFreezeGroupHold {
				out[nameOfReq(t, c.node, c.method, c.req)] = true
			}
		}
		return out
	}
	e.world.fail = func(node, method string) error {
		if node == "b" && method == nodecall.MethodFreezeGroupHold {
			return statusErr(codes.Unavailable)
		}
		return nil
	}
	if _, err := e.create(); codeOf(err) != codes.Unavailable {
		t.Fatalf("first try: %v", err)
	}
	first := names()
	e.world.fail = nil
	if _, err := e.create(); err != nil {
		t.Fatal(err)
	}
	if second := names(); len(first) != 2 || len(second) != 2 {
		t.Errorf("hold calls' names: first try %v, both tries %v: want the same two", first, second)
	}
}

func nameOfReq(t *testing.T, node, method string, req proto.Message) string {
	t.Helper()
	m, _ := nodecall.Lookup(method)
	name, err := m.ObjectName(node, req)
	if err != nil {
		t.Fatal(err)
	}
	return name
}

// TestGroupAcrossNodesNoHint: without hints, the nodes asked both hold a part: a
// delete deletes both, a get merges both.
func TestGroupAcrossNodesNoHint(t *testing.T) {
	ctx := context.Background()
	e := newCrossEnv()
	if _, err := e.create(); err != nil {
		t.Fatal(err)
	}
	delete(e.hints.learntGroups, e.gid.String())
	get, err := e.group().GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()})
	if err != nil || len(get.GetGroupSnapshot().GetSnapshots()) != 3 {
		t.Fatalf("get: %v %v", get, err)
	}
	// Two parts found while a third node does not answer: it may hold another.
	e.nodes.down["c"] = true
	_, err = e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()})
	if codeOf(err) != codes.Unavailable {
		t.Fatalf("delete with c down: %v", err)
	}
	e.nodes.down["c"] = false
	if _, err := e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()}); err != nil {
		t.Fatal(err)
	}
	e.nothingLeft(t)
	// The content's member PVs name the nodes.
	e.hints.groupNodes[e.gid.String()] = []string{"a", "b"}
	if _, err := e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()}); err != nil {
		t.Fatal(err)
	}
}

// TestGroupAcrossNodesDeleteWhileUnderway: a delete while a phase of the group's
// create is under way on a node is ABORTED before any call: its part answers no
// probe yet.
func TestGroupAcrossNodesDeleteWhileUnderway(t *testing.T) {
	e := newCrossEnv()
	e.world.underway[[2]string{nodecall.MethodSnapshotHeld, e.gid.String()}] = "b"
	_, err := e.group().DeleteVolumeGroupSnapshot(context.Background(), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()})
	if codeOf(err) != codes.Aborted || !strings.Contains(err.Error(), "SnapshotHeld") {
		t.Fatalf("got %v", err)
	}
	if got := e.world.made(); len(got) != 0 {
		t.Errorf("calls %v", got)
	}
}

// TestGroupAcrossNodesDeleteOneHint: a group across nodes hinted on one node only
// (the other members' PVs gone, the create's nodes not learnt: a new leader): that
// node's Get shows a part; a Get merges every node's, a Delete deletes every one.
func TestGroupAcrossNodesDeleteOneHint(t *testing.T) {
	ctx := context.Background()
	e := newCrossEnv()
	if _, err := e.create(); err != nil {
		t.Fatal(err)
	}
	delete(e.hints.learntGroups, e.gid.String())
	e.hints.group[e.gid.String()] = "a"
	get, err := e.group().GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()})
	if err != nil || len(get.GetGroupSnapshot().GetSnapshots()) != 3 {
		t.Fatalf("get: %v %v, want the three members of both parts", get, err)
	}
	if _, err := e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: e.gid.String(), SnapshotIds: e.memberIDs()}); err != nil {
		t.Fatal(err)
	}
	e.nothingLeft(t)
}

// TestGroupAcrossNodesStalePart: a part an earlier, aborted try left recorded on one
// node (its delete never reached it) is of another instant than the holds a retry
// takes on the other nodes: the retry deletes it, lets every hold go and answers
// ABORTED, and the next try takes every part anew, under its own holds. A create
// that finished on every node is answered again without a freeze.
func TestGroupAcrossNodesStalePart(t *testing.T) {
	e := newCrossEnv()
	// What the aborted try left on a: its part, ready.
	e.world.hold(e.world.groups, "a", e.gid.String())
	e.world.parts["a"] = map[string][]*csi.Snapshot{e.gid.String(): {{SnapshotId: pool.GroupMemberID(e.gid, e.v1).String(), SourceVolumeId: e.v1, GroupSnapshotId: e.gid.String(), ReadyToUse: true}}}
	_, err := e.create()
	if codeOf(err) != codes.Aborted || !strings.Contains(err.Error(), "earlier try") {
		t.Fatalf("create beside a stale part: %v, want ABORTED naming it", err)
	}
	if got := e.of(nodecall.MethodSnapshotHeld); len(got) != 0 {
		t.Errorf("copies asked beside a stale part: %v", got)
	}
	e.nothingLeft(t)
	resp, err := e.create()
	if err != nil {
		t.Fatalf("retry: %v", err)
	}
	if got := e.of(nodecall.MethodSnapshotHeld); !slices.Equal(got, []string{"a:" + nodecall.MethodSnapshotHeld, "b:" + nodecall.MethodSnapshotHeld}) {
		t.Errorf("retry's copies: %v, want one on each node", got)
	}
	if len(resp.GetGroupSnapshot().GetSnapshots()) != 3 {
		t.Errorf("retry's group: %v", resp.GetGroupSnapshot())
	}
	// Finished everywhere: answered again, nothing frozen anew.
	again, err := e.create()
	if err != nil || len(again.GetGroupSnapshot().GetSnapshots()) != 3 {
		t.Fatalf("a create that finished, again: %v, %v", again, err)
	}
	for n, h := range e.world.holds {
		if len(h) != 0 {
			t.Errorf("node %s holds %v after the answer", n, h)
		}
	}
}
