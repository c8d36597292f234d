package central

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func mountCap() []*csi.VolumeCapability {
	return []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}
}

func TestIdentity(t *testing.T) {
	e := newSrvEnv()
	id := identityServer{Server: e.s}
	ctx := context.Background()
	info, _ := id.GetPluginInfo(ctx, nil)
	if info.GetName() != "local.poolcsi.io" || info.GetVendorVersion() != "test" {
		t.Errorf("GetPluginInfo = %v", info)
	}
	for _, c := range []struct {
		nodes, hints, want bool
	}{{true, true, true}, {false, true, false}, {true, false, false}} {
		e.nodes.synced, e.hints.synced = c.nodes, c.hints
		p, _ := id.Probe(ctx, nil)
		if p.GetReady().GetValue() != c.want {
			t.Errorf("Probe with nodes synced %v, hints synced %v: ready %v, want %v", c.nodes, c.hints, p.GetReady().GetValue(), c.want)
		}
	}
	caps, _ := e.ctrl().ControllerGetCapabilities(ctx, nil)
	var got []csi.ControllerServiceCapability_RPC_Type
	for _, c := range caps.GetCapabilities() {
		got = append(got, c.GetRpc().GetType())
	}
	for _, no := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME, csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	} {
		if slices.Contains(got, no) {
			t.Errorf("capability %v advertised", no)
		}
	}
	for _, yes := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME, csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	} {
		if !slices.Contains(got, yes) {
			t.Errorf("capability %v missing", yes)
		}
	}
	pc, _ := id.GetPluginCapabilities(ctx, nil)
	var group bool
	for _, c := range pc.GetCapabilities() {
		group = group || c.GetService().GetType() == csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE
	}
	if !group {
		t.Error("the group controller service is not advertised")
	}
	// Register takes all three services on a real server.
	g := grpc.NewServer()
	e.s.Register(g)
	if n := len(g.GetServiceInfo()); n != 3 {
		t.Errorf("Register registered %d services, want 3", n)
	}
}

// TestHostileArguments: a request whose IDs or parameters are malformed or hostile is
// INVALID_ARGUMENT, and no call is made on any node.
func TestHostileArguments(t *testing.T) {
	good := "local.0123456789abcdef0123456789abcdef"
	goodSnap := "local@0123456789abcdef0123456789abcdef"
	for _, c := range []struct {
		name string
		run  func(e *srvEnv) error
	}{
		{"delete traversal", func(e *srvEnv) error {
			_, err := e.ctrl().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: "../../etc"})
			return err
		}},
		{"delete empty", func(e *srvEnv) error {
			_, err := e.ctrl().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{})
			return err
		}},
		{"get NUL", func(e *srvEnv) error {
			_, err := e.ctrl().ControllerGetVolume(context.Background(), &csi.ControllerGetVolumeRequest{VolumeId: "local.\x00"})
			return err
		}},
		{"expand no range", func(e *srvEnv) error {
			_, err := e.ctrl().ControllerExpandVolume(context.Background(), &csi.ControllerExpandVolumeRequest{VolumeId: good})
			return err
		}},
		{"expand negative", func(e *srvEnv) error {
			_, err := e.ctrl().ControllerExpandVolume(context.Background(), &csi.ControllerExpandVolumeRequest{VolumeId: good, CapacityRange: &csi.CapacityRange{RequiredBytes: -1}})
			return err
		}},
		{"modify bad key", func(e *srvEnv) error {
			_, err := e.ctrl().ControllerModifyVolume(context.Background(), &csi.ControllerModifyVolumeRequest{VolumeId: good, MutableParameters: map[string]string{"readIOPS; rm": "1"}})
			return err
		}},
		{"modify hostile", func(e *srvEnv) error {
			_, err := e.ctrl().ControllerModifyVolume(context.Background(), &csi.ControllerModifyVolumeRequest{VolumeId: "local/../x"})
			return err
		}},
		{"validate no caps", func(e *srvEnv) error {
			_, err := e.ctrl().ValidateVolumeCapabilities(context.Background(), &csi.ValidateVolumeCapabilitiesRequest{VolumeId: good})
			return err
		}},
		{"create no name", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{VolumeCapabilities: mountCap()})
			return err
		}},
		{"create NUL name", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "a\x00b", VolumeCapabilities: mountCap()})
			return err
		}},
		{"create unknown pool", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(), Parameters: map[string]string{"pool": "../x"}})
			return err
		}},
		{"create share parameters", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(), Parameters: map[string]string{"pool": "local", "shareType": "nfs", "shareSource": "x:/y"}})
			return err
		}},
		{"create unknown parameter", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(), Parameters: map[string]string{"pool": "local", "mkfsOptions": "-O ^has_journal"}})
			return err
		}},
		{"create no caps", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-1", Parameters: map[string]string{"pool": "local"}})
			return err
		}},
		{"create hostile source", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(),
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "local@../../x"}}}})
			return err
		}},
		{"create clone into another pool", func(e *srvEnv) error {
			_, err := e.ctrl().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(), Parameters: map[string]string{"pool": "fast"},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: good}}}})
			return err
		}},
		{"snapshot hostile source", func(e *srvEnv) error {
			_, err := e.ctrl().CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: "local/.."})
			return err
		}},
		{"snapshot parameter", func(e *srvEnv) error {
			_, err := e.ctrl().CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: good, Parameters: map[string]string{"x": "y"}})
			return err
		}},
		{"delete snapshot hostile", func(e *srvEnv) error {
			_, err := e.ctrl().DeleteSnapshot(context.Background(), &csi.DeleteSnapshotRequest{SnapshotId: "local@/etc/passwd"})
			return err
		}},
		{"list hostile source", func(e *srvEnv) error {
			_, err := e.ctrl().ListSnapshots(context.Background(), &csi.ListSnapshotsRequest{SourceVolumeId: "../x"})
			return err
		}},
		{"list negative", func(e *srvEnv) error {
			_, err := e.ctrl().ListSnapshots(context.Background(), &csi.ListSnapshotsRequest{MaxEntries: -1})
			return err
		}},
		{"group two pools", func(e *srvEnv) error {
			_, err := e.group().CreateVolumeGroupSnapshot(context.Background(), &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{good, "fast.0123456789abcdef0123456789abcdef"}})
			return err
		}},
		{"group named twice", func(e *srvEnv) error {
			_, err := e.group().CreateVolumeGroupSnapshot(context.Background(), &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{good, good}})
			return err
		}},
		{"group hostile member", func(e *srvEnv) error {
			_, err := e.group().DeleteVolumeGroupSnapshot(context.Background(), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "local@g-0123456789abcdef0123456789abcdef", SnapshotIds: []string{goodSnap, "../../x"}})
			return err
		}},
		{"group hostile ID", func(e *srvEnv) error {
			_, err := e.group().GetVolumeGroupSnapshot(context.Background(), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "local@g-/..", SnapshotIds: []string{goodSnap}})
			return err
		}},
		{"capacity unknown pool", func(e *srvEnv) error {
			_, err := e.ctrl().GetCapacity(context.Background(), &csi.GetCapacityRequest{Parameters: map[string]string{"pool": "nope"}})
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			err := c.run(e)
			if codeOf(err) != codes.InvalidArgument {
				t.Errorf("got %v, want INVALID_ARGUMENT", err)
			}
			if calls := e.world.made(); len(calls) > 0 {
				t.Errorf("calls made: %v", calls)
			}
		})
	}
}

// TestLocate: the hint chain, asking everyone, and a node that is down.
func TestLocate(t *testing.T) {
	ctx := context.Background()
	expand := func(e *srvEnv, id string) error {
		_, err := e.ctrl().ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
		return err
	}
	del := func(e *srvEnv, id string) error {
		_, err := e.ctrl().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		return err
	}
	for _, c := range []struct {
		name string
		// set up: the volume "v" held where, hinted where, nodes down
		holder, hint string
		down         []string
		call         func(e *srvEnv, id string) error
		want         codes.Code
		wantCalls    []string // node:method, in order (probes of several nodes sorted)
		learnt       string
		msg          string // in the error
	}{
		{name: "hint right", holder: "b", hint: "b", call: expand, want: codes.OK,
			wantCalls: []string{"b:ControllerExpandVolume"}, learnt: "b"},
		{name: "hinted node down", holder: "b", hint: "b", down: []string{"b"}, call: expand, want: codes.Unavailable,
			msg: "poolcsi on node b has not renewed for 34s; volume local.0123456789abcdef0123456789abcdef is there: retry once it is back"},
		{name: "hint wrong", holder: "c", hint: "a", call: expand, want: codes.OK,
			wantCalls: []string{"a:ControllerExpandVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "c:ControllerExpandVolume"}, learnt: "c"},
		{name: "no hint", holder: "b", call: expand, want: codes.OK,
			wantCalls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "b:ControllerExpandVolume"}, learnt: "b"},
		{name: "no hint, holder live, another down", holder: "b", down: []string{"c"}, call: expand, want: codes.OK,
			wantCalls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "b:ControllerExpandVolume"}, learnt: "b"},
		{name: "nowhere, all live", call: expand, want: codes.NotFound,
			wantCalls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume"}},
		{name: "nowhere, one down", down: []string{"c"}, call: expand, want: codes.Unavailable, msg: "volume local.0123456789abcdef0123456789abcdef may be there",
			wantCalls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume"}},
		{name: "delete hinted", holder: "b", hint: "b", call: del, want: codes.OK,
			wantCalls: []string{"b:DeleteVolume"}, learnt: "b"},
		{name: "delete hinted node down", holder: "b", hint: "b", down: []string{"b"}, call: del, want: codes.Unavailable},
		{name: "delete nowhere, all live: OK", call: del, want: codes.OK,
			wantCalls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume"}},
		{name: "delete nowhere, one down: UNAVAILABLE", down: []string{"a"}, call: del, want: codes.Unavailable,
			wantCalls: []string{"b:ControllerGetVolume", "c:ControllerGetVolume"}},
		{name: "delete no hint, found", holder: "c", call: del, want: codes.OK,
			wantCalls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "c:DeleteVolume"}, learnt: "c"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			id := "local.0123456789abcdef0123456789abcdef"
			if c.holder != "" {
				e.world.hold(e.world.vols, c.holder, id)
			}
			if c.hint != "" {
				e.hints.vol[id] = c.hint
			}
			for _, n := range c.down {
				e.nodes.down[n] = true
			}
			err := c.call(e, id)
			if codeOf(err) != c.want {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if c.msg != "" && !strings.Contains(err.Error(), c.msg) {
				t.Errorf("message %q lacks %q", err, c.msg)
			}
			if c.want == codes.Unavailable && !strings.Contains(err.Error(), "node") {
				t.Errorf("UNAVAILABLE does not name the node: %v", err)
			}
			got := sortProbes(e.world.methods())
			if !slices.Equal(got, c.wantCalls) {
				t.Errorf("calls %v, want %v", got, c.wantCalls)
			}
			if c.holder != "" && c.want == codes.OK && strings.HasPrefix(c.name, "delete") && e.world.vols[c.holder][id] {
				t.Error("the volume was not deleted on its node")
			}
			if n, _ := e.hints.learnt[id]; n != c.learnt {
				t.Errorf("learnt %q, want %q", n, c.learnt)
			}
		})
	}
}

// sortProbes sorts each run of read-only probes (made at once, in any order).
func sortProbes(calls []string) []string {
	probe := func(s string) bool {
		return strings.HasSuffix(s, ":ControllerGetVolume") || strings.HasSuffix(s, ":ListSnapshots") || strings.HasSuffix(s, ":GetVolumeGroupSnapshot")
	}
	out := slices.Clone(calls)
	for i := 0; i < len(out); {
		j := i
		for j < len(out) && probe(out[j]) {
			j++
		}
		slices.Sort(out[i:j])
		i = max(j, i+1)
	}
	return out
}

// TestLocateOnlyNodesOfThePool: nodes whose PoolNode does not list the ID's pool are
// neither asked nor waited for.
func TestLocateOnlyNodesOfThePool(t *testing.T) {
	e := newSrvEnv()
	e.nodes.pools["c"] = e.nodes.pools["c"][1:] // c has "fast" only
	e.nodes.down["c"] = true
	_, err := e.ctrl().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: "local.0123456789abcdef0123456789abcdef"})
	if err != nil {
		t.Fatalf("DeleteVolume: %v (c does not hold pool local)", err)
	}
	if got := sortProbes(e.world.methods()); !slices.Equal(got, []string{"a:ControllerGetVolume", "b:ControllerGetVolume"}) {
		t.Errorf("calls %v", got)
	}
}

// TestNotOurPool: an ID of a pool the driver does not have (another one, a share's)
// names nothing: NOT_FOUND, OK for a delete, and no node is asked.
func TestNotOurPool(t *testing.T) {
	ctx := context.Background()
	e := newSrvEnv()
	share := pool.NewShareVolumeID(pool.ShareRef{Type: "nfs", Source: "server:/export"}, "pvc-1").Wire()
	for _, id := range []string{"other.0123456789abcdef0123456789abcdef", share} {
		if _, err := e.ctrl().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("DeleteVolume %s: %v", id, err)
		}
		if _, err := e.ctrl().ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id}); codeOf(err) != codes.NotFound {
			t.Errorf("ControllerGetVolume %s: %v", id, err)
		}
	}
	if _, err := e.ctrl().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "other@0123456789abcdef0123456789abcdef"}); err != nil {
		t.Errorf("DeleteSnapshot: %v", err)
	}
	if _, err := e.ctrl().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "pvc-snapshot-of-another-driver"}); err != nil {
		t.Errorf("DeleteSnapshot of another form: %v", err)
	}
	if _, err := e.ctrl().ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: "vol-of-another-driver"}); codeOf(err) != codes.NotFound {
		t.Errorf("ControllerModifyVolume of another form: %v", err)
	}
	if calls := e.world.made(); len(calls) > 0 {
		t.Errorf("calls made: %v", calls)
	}
}

// TestLocateTwoHolders: the same ID on two nodes is refused, not guessed.
func TestLocateTwoHolders(t *testing.T) {
	e := newSrvEnv()
	id := e.vol("a", "pvc-1")
	e.vol("c", "pvc-1")
	_, err := e.ctrl().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id})
	if codeOf(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "a, c") {
		t.Fatalf("got %v", err)
	}
	if !e.world.vols["a"][id] || !e.world.vols["c"][id] {
		t.Error("a volume was deleted")
	}
}

func TestSnapshotsAndGroups(t *testing.T) {
	ctx := context.Background()
	t.Run("create snapshot goes to the source's node", func(t *testing.T) {
		e := newSrvEnv()
		vid := e.vol("b", "pvc-1")
		e.hints.vol[vid] = "b"
		resp, err := e.ctrl().CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: vid})
		if err != nil {
			t.Fatal(err)
		}
		sid := resp.GetSnapshot().GetSnapshotId()
		if e.world.made()[0].target != sid {
			t.Errorf("target %q, want the snapshot's ID %q", e.world.made()[0].target, sid)
		}
		if n := e.hints.learnt[sid]; n != "b" {
			t.Errorf("snapshot learnt on %q", n)
		}
		// GetSnapshot then goes there at once.
		g, err := e.ctrl().GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: sid})
		if err != nil || g.GetSnapshot().GetSnapshotId() != sid {
			t.Fatalf("GetSnapshot: %v %v", g, err)
		}
		if got := e.world.methods(); !slices.Equal(got, []string{"b:CreateSnapshot", "b:ListSnapshots"}) {
			t.Errorf("calls %v", got)
		}
	})
	t.Run("delete snapshot: no hint, found by asking", func(t *testing.T) {
		e := newSrvEnv()
		sid := e.snap("c", "snap-1", "local.0123456789abcdef0123456789abcdef")
		if _, err := e.ctrl().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: sid}); err != nil {
			t.Fatal(err)
		}
		if _, ok := e.world.snaps["c"][sid]; ok {
			t.Error("not deleted")
		}
		if got := sortProbes(e.world.methods()); !slices.Equal(got, []string{"a:ListSnapshots", "b:ListSnapshots", "c:ListSnapshots", "c:DeleteSnapshot"}) {
			t.Errorf("calls %v", got)
		}
	})
	t.Run("delete snapshot nowhere, one down", func(t *testing.T) {
		e := newSrvEnv()
		e.nodes.down["b"] = true
		_, err := e.ctrl().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "local@0123456789abcdef0123456789abcdef"})
		if codeOf(err) != codes.Unavailable {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("get snapshot nowhere", func(t *testing.T) {
		e := newSrvEnv()
		_, err := e.ctrl().GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: "local@0123456789abcdef0123456789abcdef"})
		if codeOf(err) != codes.NotFound {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("list by snapshot ID, hint wrong: the holder's answer, no second call", func(t *testing.T) {
		e := newSrvEnv()
		sid := e.snap("c", "snap-1", "local.0123456789abcdef0123456789abcdef")
		e.hints.snap[sid] = "a"
		resp, err := e.ctrl().ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: sid})
		if err != nil || len(resp.GetEntries()) != 1 || resp.GetEntries()[0].GetSnapshot().GetSnapshotId() != sid {
			t.Fatalf("got %v %v", resp, err)
		}
		if got := sortProbes(e.world.methods()); !slices.Equal(got, []string{"a:ListSnapshots", "b:ListSnapshots", "c:ListSnapshots"}) {
			t.Errorf("calls %v", got)
		}
		if e.hints.learnt[sid] != "c" {
			t.Errorf("learnt %q", e.hints.learnt[sid])
		}
	})
	t.Run("delete group, no hint, other members: the node's own answer", func(t *testing.T) {
		e := newSrvEnv()
		gid := "local@g-0123456789abcdef0123456789abcdef"
		e.world.hold(e.world.groups, "b", gid)
		e.world.fail = func(node, method string) error {
			if node == "b" && (method == "GetVolumeGroupSnapshot" || method == "DeleteVolumeGroupSnapshot") {
				return statusErr(codes.InvalidArgument)
			}
			return nil
		}
		_, err := e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: gid, SnapshotIds: []string{"local@0123456789abcdef0123456789abcdef"}})
		if codeOf(err) != codes.InvalidArgument {
			t.Fatalf("got %v", err)
		}
		if got := sortProbes(e.world.methods()); !slices.Equal(got, []string{"a:GetVolumeGroupSnapshot", "b:GetVolumeGroupSnapshot", "c:GetVolumeGroupSnapshot", "b:DeleteVolumeGroupSnapshot"}) {
			t.Errorf("calls %v", got)
		}
	})
	t.Run("list by snapshot ID nowhere is empty", func(t *testing.T) {
		e := newSrvEnv()
		resp, err := e.ctrl().ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: "local@0123456789abcdef0123456789abcdef"})
		if err != nil || len(resp.GetEntries()) != 0 {
			t.Fatalf("got %v %v", resp, err)
		}
	})
	t.Run("group on one node", func(t *testing.T) {
		e := newSrvEnv()
		v1, v2 := e.vol("c", "pvc-1"), e.vol("c", "pvc-2")
		e.hints.vol[v1] = "c" // v2 found by asking
		resp, err := e.group().CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{v1, v2}})
		if err != nil {
			t.Fatal(err)
		}
		gid := resp.GetGroupSnapshot().GetGroupSnapshotId()
		calls := e.world.made()
		if last := calls[len(calls)-1]; last.node != "c" || last.method != "CreateVolumeGroupSnapshot" || last.target != gid {
			t.Errorf("last call %v", last)
		}
		if _, err := e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: gid, SnapshotIds: []string{"local@0123456789abcdef0123456789abcdef"}}); err != nil {
			t.Fatal(err)
		}
		if e.world.groups["c"][gid] {
			t.Error("group not deleted (the learnt hint was not used)")
		}
	})
	t.Run("group hinted on one node: one call", func(t *testing.T) {
		e := newSrvEnv()
		v1, v2 := e.vol("c", "pvc-1"), e.vol("c", "pvc-2")
		e.hints.vol[v1], e.hints.vol[v2] = "c", "c"
		if _, err := e.group().CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{v1, v2}}); err != nil {
			t.Fatal(err)
		}
		if got := e.world.methods(); !slices.Equal(got, []string{"c:CreateVolumeGroupSnapshot"}) {
			t.Errorf("calls %v", got)
		}
	})
	t.Run("group hinted wrong", func(t *testing.T) {
		e := newSrvEnv()
		v1, v2 := e.vol("c", "pvc-1"), e.vol("c", "pvc-2")
		e.hints.vol[v1], e.hints.vol[v2] = "a", "a"
		if _, err := e.group().CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{v1, v2}}); err != nil {
			t.Fatal(err)
		}
		calls := e.world.made()
		if first, last := calls[0], calls[len(calls)-1]; first.node != "a" || last.node != "c" || last.method != "CreateVolumeGroupSnapshot" {
			t.Errorf("calls %v", calls)
		}
	})
	t.Run("get group nowhere", func(t *testing.T) {
		e := newSrvEnv()
		_, err := e.group().GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "local@g-0123456789abcdef0123456789abcdef", SnapshotIds: []string{"local@0123456789abcdef0123456789abcdef"}})
		if codeOf(err) != codes.NotFound {
			t.Fatalf("got %v", err)
		}
	})
}

// TestListSnapshotsEverywhere: a listing without a filter merges every node's,
// ordered and paged as one node's, and walks all of them page by page.
func TestListSnapshotsEverywhere(t *testing.T) {
	ctx := context.Background()
	e := newSrvEnv()
	var want []string
	for i, n := range []string{"a", "b", "c", "a", "b", "a", "c"} {
		want = append(want, e.snap(n, "s"+string(rune('0'+i)), "local.0123456789abcdef0123456789abcdef"))
	}
	// A snapshot in pool "fast" sorts after all of "local"... no: before ("fast" < "local").
	fid := "fast@00000000000000000000000000000000"
	e.world.snaps["b"][fid] = "fast.0123456789abcdef0123456789abcdef"
	want = append(want, fid)
	slices.SortFunc(want, func(a, b string) int { return strings.Compare(sortKey(a), sortKey(b)) })
	for _, c := range []struct{ max, cut int32 }{{0, 0}, {1, 0}, {2, 0}, {3, 0}, {100, 0}, {0, 1}, {0, 2}, {3, 1}} {
		max := c.max
		e.world.cut = int(c.cut)
		var got []string
		token := ""
		for pages := 0; ; pages++ {
			if pages > 20 {
				t.Fatalf("max %d: no end to the pages", max)
			}
			resp, err := e.ctrl().ListSnapshots(ctx, &csi.ListSnapshotsRequest{MaxEntries: max, StartingToken: token})
			if err != nil {
				t.Fatal(err)
			}
			if max > 0 && len(resp.GetEntries()) > int(max) {
				t.Fatalf("max %d: page of %d", max, len(resp.GetEntries()))
			}
			for _, en := range resp.GetEntries() {
				got = append(got, en.GetSnapshot().GetSnapshotId())
			}
			if token = resp.GetNextToken(); token == "" {
				break
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("max %d, nodes cut at %d: listed %v, want %v", max, c.cut, got, want)
		}
	}
	e.nodes.down["c"] = true
	if _, err := e.ctrl().ListSnapshots(ctx, &csi.ListSnapshotsRequest{}); codeOf(err) != codes.Unavailable {
		t.Errorf("a node down: got %v, want UNAVAILABLE", err)
	}
	if _, err := e.ctrl().ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: "nope"}); codeOf(err) != codes.Aborted {
		t.Errorf("foreign token: got %v, want ABORTED", err)
	}
}

// sortKey orders IDs by (pool, key), as the node lists.
func sortKey(id string) string {
	p, k, _ := strings.Cut(id, "@")
	return p + "\x00" + k
}

// TestListSnapshotsBySource: the source's node when it is hinted, else everyone.
func TestListSnapshotsBySource(t *testing.T) {
	ctx := context.Background()
	e := newSrvEnv()
	vid := e.vol("b", "pvc-1")
	sid := e.snap("b", "s1", vid)
	e.snap("a", "s2", "local.ffffffffffffffffffffffffffffffff")
	for _, hinted := range []bool{true, false} {
		e.world.calls = nil
		delete(e.hints.vol, vid)
		if hinted {
			e.hints.vol[vid] = "b"
		}
		resp, err := e.ctrl().ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: vid})
		if err != nil || len(resp.GetEntries()) != 1 || resp.GetEntries()[0].GetSnapshot().GetSnapshotId() != sid {
			t.Fatalf("hinted %v: %v %v", hinted, resp, err)
		}
		if n := len(e.world.made()); hinted && n != 1 {
			t.Errorf("hinted: %d calls", n)
		}
	}
}

// TestCreateUnderway: a call whose "not found" would be final (a delete answers OK, an
// expand or modify NOT_FOUND) about an ID whose create is still under way on a node
// answers ABORTED and makes no call: the volume or snapshot not made yet answers no
// probe, and a delete that said OK would leave it behind once the create finished.
func TestCreateUnderway(t *testing.T) {
	ctx := context.Background()
	vid := pool.NewVolumeID("local", "pvc-1").String()
	sid := pool.NewSnapshotID("local", "snap-1").String()
	gid := pool.GroupSnapshotID{SnapshotID: pool.NewSnapshotID("local", "group-1")}.String()
	for _, c := range []struct {
		name   string
		create string // the method that makes the ID, and the ID
		id     string
		hint   bool
		call   func(e *srvEnv) error
	}{
		{name: "delete volume", create: "CreateVolume", id: vid, call: func(e *srvEnv) error {
			_, err := e.ctrl().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vid})
			return err
		}},
		{name: "delete volume, hinted", create: "CreateVolume", id: vid, hint: true, call: func(e *srvEnv) error {
			_, err := e.ctrl().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vid})
			return err
		}},
		{name: "expand", create: "CreateVolume", id: vid, call: func(e *srvEnv) error {
			_, err := e.ctrl().ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vid, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
			return err
		}},
		{name: "modify", create: "CreateVolume", id: vid, call: func(e *srvEnv) error {
			_, err := e.ctrl().ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: vid})
			return err
		}},
		{name: "delete snapshot", create: "CreateSnapshot", id: sid, call: func(e *srvEnv) error {
			_, err := e.ctrl().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: sid})
			return err
		}},
		{name: "delete group snapshot", create: "CreateVolumeGroupSnapshot", id: gid, call: func(e *srvEnv) error {
			_, err := e.group().DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: gid, SnapshotIds: []string{sid}})
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			e.world.underway[[2]string{c.create, c.id}] = "b"
			if c.hint {
				e.hints.vol[c.id] = "b"
			}
			err := c.call(e)
			if codeOf(err) != codes.Aborted {
				t.Fatalf("got %v, want ABORTED while the create is under way", err)
			}
			if !strings.Contains(err.Error(), "under way on node b") {
				t.Errorf("message %q does not name the node of the create", err)
			}
			if got := e.world.made(); len(got) != 0 {
				t.Errorf("calls made: %v", got)
			}
			// Once the create is answered, the call goes ahead.
			delete(e.world.underway, [2]string{c.create, c.id})
			if err := c.call(e); codeOf(err) == codes.Aborted {
				t.Errorf("after the create: %v", err)
			}
		})
	}
}
