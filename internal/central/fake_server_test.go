package central

import (
	"context"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// The server's tests run over fakes of its three seams: srvNodes (the PoolNodes),
// srvHints (the hints) and srvWorld, a Caller that plays every node's agent over a
// small model of what each node's pools hold.

const testKey = "topology.poolcsi.io/node"

type srvNodes struct {
	mu     sync.Mutex
	down   map[string]bool
	pools  map[string][]nodecall.PoolCapacity
	synced bool
}

func (f *srvNodes) Live(node string) (bool, time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, known := f.pools[node]; !known {
		return false, 0
	}
	if f.down[node] {
		return false, 34 * time.Second
	}
	return true, time.Second
}

// AwaitVerdict: this fake judges every node at once.
func (f *srvNodes) AwaitVerdict(context.Context, string) {}

func (f *srvNodes) Known() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for n := range f.pools {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func (f *srvNodes) Pools(node string) []nodecall.PoolCapacity {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pools[node]
}

func (f *srvNodes) Synced() bool { return f.synced }

type srvHints struct {
	mu               sync.Mutex
	vol, snap, group map[string]string
	learnt           map[string]string
	// groupNodes are the nodes of a group's member PVs; learntGroups those learnt.
	groupNodes, learntGroups map[string][]string
	synced                   bool
}

func newSrvHints() *srvHints {
	return &srvHints{vol: map[string]string{}, snap: map[string]string{}, group: map[string]string{}, learnt: map[string]string{}, groupNodes: map[string][]string{}, learntGroups: map[string][]string{}, synced: true}
}

func (h *srvHints) get(m map[string]string, id string) (string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n, ok := m[id]; ok {
		return n, true
	}
	n, ok := h.learnt[id]
	return n, ok
}

func (h *srvHints) VolumeNode(id string) (string, bool)   { return h.get(h.vol, id) }
func (h *srvHints) SnapshotNode(id string) (string, bool) { return h.get(h.snap, id) }
func (h *srvHints) GroupNode(id string) (string, bool)    { return h.get(h.group, id) }
func (h *srvHints) Synced() bool                          { return h.synced }
func (h *srvHints) GroupNodes(id string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n := h.groupNodes[id]; n != nil {
		return n
	}
	return h.learntGroups[id]
}
func (h *srvHints) LearnGroup(id string, nodes []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.learntGroups[id] = nodes
}
func (h *srvHints) Learn(id, node string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.learnt[id] = node
}

// srvCall is one call the server made.
type srvCall struct {
	node, method, target string
	req                  proto.Message
}

// srvWorld answers calls as the nodes' drivers would, from what each node holds.
type srvWorld struct {
	mu    sync.Mutex
	nodes *srvNodes
	vols  map[string]map[string]bool // node → volume IDs
	snaps map[string]map[string]string
	// snaps: node → snapshot ID → source volume ID
	groups map[string]map[string]bool
	// holds: node → group → nonce of its hold; parts: node → group → its part's snapshots.
	holds map[string]map[string]string
	parts map[string]map[string][]*csi.Snapshot
	calls []srvCall
	// cut, when set, is the most a node lists in one answer without max_entries (a
	// node cuts a listing to fit a PoolCall's response).
	cut int
	// fail, when set, answers a call instead of the model.
	fail func(node, method string) error
	// tamper, when set, changes a node's answer as a hostile node would.
	tamper func(node string, resp proto.Message)
	// pending is where a call is under way, by method and target (PendingCalls).
	pending map[[2]string]string
	// underway is where a call is under way and not yet answered, by method and target.
	underway map[[2]string]string
}

func (w *srvWorld) Underway(method, target string) (string, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, ok := w.underway[[2]string{method, target}]
	return n, ok
}

func (w *srvWorld) Pending(method, target string) (string, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, ok := w.pending[[2]string{method, target}]
	return n, ok
}

func (w *srvWorld) hold(m map[string]map[string]bool, node, id string) {
	if m[node] == nil {
		m[node] = map[string]bool{}
	}
	m[node][id] = true
}

func (w *srvWorld) made() []srvCall {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.calls)
}

func (w *srvWorld) methods() []string {
	var out []string
	for _, c := range w.made() {
		out = append(out, c.node+":"+c.method)
	}
	return out
}

func notFound() error { return status.Error(codes.NotFound, "not here") }

func (w *srvWorld) Call(ctx context.Context, node, method, target string, req proto.Message) (proto.Message, error) {
	resp, err := w.call(ctx, node, method, target, req)
	if err == nil && w.tamper != nil {
		w.tamper(node, resp)
	}
	return resp, err
}

func (w *srvWorld) call(_ context.Context, node, method, target string, req proto.Message) (proto.Message, error) {
	if live, _ := w.nodes.Live(node); !live {
		return nil, status.Errorf(codes.Unavailable, "node %s down", node)
	}
	if _, ok := nodecall.Lookup(method); !ok {
		return nil, status.Errorf(codes.Internal, "method %s is off the allow-list", method)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls = append(w.calls, srvCall{node, method, target, req})
	if w.fail != nil {
		if err := w.fail(node, method); err != nil {
			return nil, err
		}
	}
	switch r := req.(type) {
	case *csi.CreateVolumeRequest:
		if v := r.GetVolumeContentSource().GetVolume(); v != nil && !w.vols[node][v.GetVolumeId()] {
			return nil, notFound()
		}
		if sn := r.GetVolumeContentSource().GetSnapshot(); sn != nil {
			if _, ok := w.snaps[node][sn.GetSnapshotId()]; !ok {
				return nil, notFound()
			}
		}
		id := pool.NewVolumeID(poolParam(r.GetParameters()), r.GetName()).String()
		w.hold(w.vols, node, id)
		return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: id}}, nil
	case *csi.DeleteVolumeRequest:
		delete(w.vols[node], r.GetVolumeId())
		return &csi.DeleteVolumeResponse{}, nil
	case *csi.ControllerGetVolumeRequest:
		if !w.vols[node][r.GetVolumeId()] {
			return nil, notFound()
		}
		return &csi.ControllerGetVolumeResponse{Volume: &csi.Volume{VolumeId: r.GetVolumeId()}}, nil
	case *csi.ControllerExpandVolumeRequest:
		if !w.vols[node][r.GetVolumeId()] {
			return nil, notFound()
		}
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: r.GetCapacityRange().GetRequiredBytes()}, nil
	case *csi.ControllerModifyVolumeRequest:
		if !w.vols[node][r.GetVolumeId()] {
			return nil, notFound()
		}
		return &csi.ControllerModifyVolumeResponse{}, nil
	case *csi.ValidateVolumeCapabilitiesRequest:
		if !w.vols[node][r.GetVolumeId()] {
			return nil, notFound()
		}
		return &csi.ValidateVolumeCapabilitiesResponse{}, nil
	case *csi.CreateSnapshotRequest:
		if !w.vols[node][r.GetSourceVolumeId()] {
			return nil, notFound()
		}
		vid, _ := pool.ParseVolumeID(r.GetSourceVolumeId())
		sid := pool.NewSnapshotID(vid.Pool, r.GetName()).String()
		if w.snaps[node] == nil {
			w.snaps[node] = map[string]string{}
		}
		w.snaps[node][sid] = r.GetSourceVolumeId()
		return &csi.CreateSnapshotResponse{Snapshot: &csi.Snapshot{SnapshotId: sid, SourceVolumeId: r.GetSourceVolumeId(), ReadyToUse: true}}, nil
	case *csi.DeleteSnapshotRequest:
		delete(w.snaps[node], r.GetSnapshotId())
		return &csi.DeleteSnapshotResponse{}, nil
	case *csi.ListSnapshotsRequest:
		return w.list(node, r), nil
	case *csi.CreateVolumeGroupSnapshotRequest:
		for _, v := range r.GetSourceVolumeIds() {
			if !w.vols[node][v] {
				return nil, notFound()
			}
		}
		gid := pool.GroupSnapshotID{SnapshotID: pool.NewSnapshotID("local", r.GetName())}.String()
		w.hold(w.groups, node, gid)
		return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: &csi.VolumeGroupSnapshot{GroupSnapshotId: gid}}, nil
	case *csi.GetVolumeGroupSnapshotRequest:
		if !w.groups[node][r.GetGroupSnapshotId()] {
			return nil, notFound()
		}
		return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: &csi.VolumeGroupSnapshot{GroupSnapshotId: r.GetGroupSnapshotId(),
			Snapshots: w.parts[node][r.GetGroupSnapshotId()], ReadyToUse: true}}, nil
	case *csi.DeleteVolumeGroupSnapshotRequest:
		delete(w.groups[node], r.GetGroupSnapshotId())
		delete(w.parts[node], r.GetGroupSnapshotId())
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
	case *structpb.Struct:
		return w.groupHold(node, method, r)
	}
	return nil, status.Errorf(codes.Unimplemented, "%T", req)
}

// groupHold plays a node's part of a group across nodes: holds by group and nonce,
// parts recorded by group.
func (w *srvWorld) groupHold(node, method string, r *structpb.Struct) (proto.Message, error) {
	if w.holds[node] == nil {
		w.holds[node] = map[string]string{}
	}
	if w.parts[node] == nil {
		w.parts[node] = map[string][]*csi.Snapshot{}
	}
	switch method {
	case nodecall.MethodFreezeGroupHold:
		var h nodecall.FreezeGroupHold
		if err := nodecall.FromStruct(r, &h); err != nil {
			return nil, err
		}
		for _, v := range h.Members {
			if !w.vols[node][v] {
				return nil, notFound()
			}
		}
		if w.groups[node][h.Group] {
			return nodecall.ToStruct(nodecall.GroupHeld{Nonce: nodecall.RecordedHold})
		}
		nonce := "nonce-" + node + "-" + strconv.Itoa(len(w.calls))
		w.holds[node][h.Group] = nonce
		return nodecall.ToStruct(nodecall.GroupHeld{Nonce: nonce, HoldMillis: h.BoundMillis})
	case nodecall.MethodSnapshotHeld:
		var h nodecall.SnapshotHeld
		if err := nodecall.FromStruct(r, &h); err != nil {
			return nil, err
		}
		if h.Nonce == nodecall.RecordedHold && w.groups[node][h.Group] {
			return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: &csi.VolumeGroupSnapshot{GroupSnapshotId: h.Group, Snapshots: w.parts[node][h.Group], ReadyToUse: true}}, nil
		}
		if w.holds[node][h.Group] != h.Nonce {
			return nil, status.Error(codes.Aborted, "no such hold")
		}
		delete(w.holds[node], h.Group)
		gid, _ := pool.ParseGroupSnapshotID(h.Group)
		var snaps []*csi.Snapshot
		for _, v := range h.Members {
			snaps = append(snaps, &csi.Snapshot{SnapshotId: pool.GroupMemberID(gid, v).String(), SourceVolumeId: v, GroupSnapshotId: h.Group, ReadyToUse: true})
		}
		w.hold(w.groups, node, h.Group)
		w.parts[node][h.Group] = snaps
		return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: &csi.VolumeGroupSnapshot{GroupSnapshotId: h.Group, Snapshots: snaps, ReadyToUse: true}}, nil
	case nodecall.MethodThawGroup:
		var h nodecall.ThawGroup
		if err := nodecall.FromStruct(r, &h); err != nil {
			return nil, err
		}
		if h.Nonce == "" || w.holds[node][h.Group] == h.Nonce {
			delete(w.holds[node], h.Group)
		}
		return &structpb.Struct{}, nil
	}
	return nil, status.Errorf(codes.Unimplemented, "%s", method)
}

// list is the node driver's ListSnapshots over the model: by (pool, key), from the
// token inclusive, at most max_entries, the next page's first ID as the token.
func (w *srvWorld) list(node string, r *csi.ListSnapshotsRequest) *csi.ListSnapshotsResponse {
	var ids []pool.SnapshotID
	for sid, src := range w.snaps[node] {
		if r.GetSnapshotId() != "" && sid != r.GetSnapshotId() {
			continue
		}
		if r.GetSourceVolumeId() != "" && src != r.GetSourceVolumeId() {
			continue
		}
		id, _ := pool.ParseSnapshotID(sid)
		ids = append(ids, id)
	}
	slices.SortFunc(ids, compareSnapshotIDs)
	out := &csi.ListSnapshotsResponse{}
	if t := r.GetStartingToken(); t != "" {
		start, _ := pool.ParseSnapshotID(t)
		ids = slices.DeleteFunc(ids, func(id pool.SnapshotID) bool { return compareSnapshotIDs(id, start) < 0 })
	}
	m := int(r.GetMaxEntries())
	if m == 0 {
		m = w.cut
	}
	if m > 0 && len(ids) > m {
		out.NextToken = ids[m].String()
		ids = ids[:m]
	}
	for _, id := range ids {
		out.Entries = append(out.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: &csi.Snapshot{SnapshotId: id.String(), SourceVolumeId: w.snaps[node][id.String()]}})
	}
	return out
}

func poolParam(p map[string]string) string {
	if p[params.ParamPool] != "" {
		return p[params.ParamPool]
	}
	return "local"
}

// srvEnv is a server over two or three nodes, every one with pools "local" and "fast".
type srvEnv struct {
	s     *Server
	nodes *srvNodes
	hints *srvHints
	world *srvWorld
}

func okPool(name string, avail int64) nodecall.PoolCapacity {
	return nodecall.PoolCapacity{Name: name, AvailableBytes: avail, MaximumVolumeSize: avail, MinimumVolumeSize: pool.MiB, Condition: nodecall.PoolOk}
}

func newSrvEnv(nodes ...string) *srvEnv {
	if len(nodes) == 0 {
		nodes = []string{"a", "b", "c"}
	}
	n := &srvNodes{down: map[string]bool{}, pools: map[string][]nodecall.PoolCapacity{}, synced: true}
	for _, node := range nodes {
		n.pools[node] = []nodecall.PoolCapacity{okPool("local", 10<<30), okPool("fast", 1<<30)}
	}
	w := &srvWorld{nodes: n, vols: map[string]map[string]bool{}, snaps: map[string]map[string]string{}, groups: map[string]map[string]bool{}, holds: map[string]map[string]string{}, parts: map[string]map[string][]*csi.Snapshot{}, pending: map[[2]string]string{}, underway: map[[2]string]string{}}
	h := newSrvHints()
	s := NewServer(Deps{Name: "local.poolcsi.io", Version: "test", TopologyKey: testKey,
		Params: params.Config{Pools: []string{"fast", "local"}}, Calls: w, Nodes: n, Hints: h, PlaceWithoutTopology: true})
	return &srvEnv{s: s, nodes: n, hints: h, world: w}
}

func (e *srvEnv) ctrl() controllerServer { return controllerServer{Server: e.s} }
func (e *srvEnv) group() groupServer     { return groupServer{Server: e.s} }

// vol puts a volume named name in pool local on node, and returns its ID.
func (e *srvEnv) vol(node, name string) string {
	id := pool.NewVolumeID("local", name).String()
	e.world.hold(e.world.vols, node, id)
	return id
}

// snap puts a snapshot named name of volume src on node, and returns its ID.
func (e *srvEnv) snap(node, name, src string) string {
	id := pool.NewSnapshotID("local", name).String()
	if e.world.snaps[node] == nil {
		e.world.snaps[node] = map[string]string{}
	}
	e.world.snaps[node][id] = src
	return id
}

func codeOf(err error) codes.Code { return status.Code(err) }

func statusErr(c codes.Code) error { return status.Error(c, c.String()) }
