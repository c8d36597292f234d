package central

import (
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// CreateVolume's node (docs/design/central-controller.md §5). The node's own checks
// run again there; this one refuses a hostile request before any call exists and
// chooses where the call goes.
func (s controllerServer) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (_ *csi.CreateVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	name := req.GetName()
	if err := params.CheckVolumeName(name); err != nil {
		return nil, err
	}
	src, err := s.sourceArg(req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}
	poolName, err := s.createParams(req, src)
	if err != nil {
		return nil, err
	}
	if r := req.GetCapacityRange(); r.GetRequiredBytes() < 0 || r.GetLimitBytes() < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "capacity_range must not be negative (required %d, limit %d)", r.GetRequiredBytes(), r.GetLimitBytes())
	}
	// The ID the node will give the volume: the node's own derivation (pool.Pool.NewID
	// of a configured pool), so the call's target is the volume's ID.
	id := pool.NewVolumeID(poolName, name).String()
	requisite, preferred := s.topologyNodes(req.GetAccessibilityRequirements())
	if len(requisite) == 0 && len(preferred) == 0 && !s.d.PlaceWithoutTopology {
		// Not final: csi-provisioner retries, and once something sets the claim's
		// selected-node, its topology is that node.
		return nil, status.Errorf(codes.FailedPrecondition, "the create of %s names no node: a claim of an Immediate class gets none while node.localImmediateBinding is false (csi-provisioner --immediate-topology=false), and then stays Pending until volume.kubernetes.io/selected-node names its node; set node.localImmediateBinding to true to have such claims placed, or use a WaitForFirstConsumer class", name)
	}

	var node string
	if src != nil {
		// The source's hint, where the claim may go, is taken at its word: the node
		// finds the source itself, and only its NOT_FOUND costs the confirming calls.
		if n, ok := s.hint(src.kind, src.id); ok && (len(requisite) == 0 || slices.Contains(requisite, n)) {
			if resp, err := s.create(ctx, n, id, req); status.Code(err) != codes.NotFound {
				return as[*csi.CreateVolumeResponse](resp, err)
			}
		}
		node, err = s.sourceNode(ctx, src, requisite)
	} else {
		node, err = s.placeNew(ctx, id, poolName, req.GetCapacityRange().GetRequiredBytes(), requisite, preferred)
	}
	if err != nil {
		return nil, err
	}
	resp, err := s.create(ctx, node, id, req)
	return as[*csi.CreateVolumeResponse](resp, err)
}

// create is the CreateVolume of the volume id on node. The node is learnt before the
// call, not after: a call still running at the sidecar's deadline (ABORTED) or not yet
// taken (UNAVAILABLE) may yet make the volume there, and the retry must go to the same
// node, whatever the figures say by then.
func (s *Server) create(ctx context.Context, node, id string, req *csi.CreateVolumeRequest) (proto.Message, error) {
	s.d.Hints.Learn(id, node)
	resp, err := s.d.Calls.Call(ctx, node, "CreateVolume", id, req)
	if err != nil {
		return resp, err
	}
	return s.checkCreated(node, id, resp)
}

// checkCreated holds a node's answer to a create to what was asked: the volume's ID is
// the one its name maps to, and it is reachable from that node alone. The answer
// becomes a PersistentVolume (handle and node affinity), and a node may write only its
// own calls' answers: a node that answered with another volume's ID, or with another
// node's topology, would point a claim at data it does not hold (another claim's volume
// on another node). No PV is made of such an answer.
func (s *Server) checkCreated(node, id string, resp proto.Message) (proto.Message, error) {
	cr, ok := resp.(*csi.CreateVolumeResponse)
	if !ok || cr.GetVolume() == nil {
		return nil, status.Errorf(codes.Internal, "node %s answered the create of %s without a volume", node, id)
	}
	v := cr.GetVolume()
	if v.GetVolumeId() != id {
		return nil, status.Errorf(codes.Internal, "node %s answered the create of %s with volume %q", node, id, v.GetVolumeId())
	}
	for _, t := range v.GetAccessibleTopology() {
		if got := t.GetSegments()[s.d.TopologyKey]; got != node {
			return nil, status.Errorf(codes.Internal, "node %s answered the create of %s with the topology of node %q", node, id, got)
		}
	}
	if len(v.GetAccessibleTopology()) == 0 {
		// A local volume is reachable from its node alone, whatever the answer left out.
		v.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{s.d.TopologyKey: node}}}
	}
	return cr, nil
}

// contentSource is a CreateVolume's source, parsed.
type contentSource struct {
	kind idKind // volumeKind or snapshotKind
	id   string
	pool string
}

// sourceArg parses a content source as the node does: a malformed ID is
// INVALID_ARGUMENT, a snapshot ID of another form (not hostile) or a pool that is not
// the driver's is NOT_FOUND.
func (s *Server) sourceArg(src *csi.VolumeContentSource) (*contentSource, error) {
	switch {
	case src == nil:
		return nil, nil
	case src.GetSnapshot() != nil:
		raw := src.GetSnapshot().GetSnapshotId()
		sid, ok, err := s.snapshotArg("volume_content_source.snapshot.snapshot_id", raw)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, status.Errorf(codes.NotFound, "source snapshot %q does not exist (not a snapshot of this driver)", raw)
		}
		return &contentSource{kind: snapshotKind, id: sid.String(), pool: sid.Pool}, nil
	case src.GetVolume() != nil:
		vid, ok, err := s.volumeArg(src.GetVolume().GetVolumeId(), false)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, status.Errorf(codes.NotFound, "source volume %s does not exist (pool %s is not one of this driver's)", vid, vid.Pool)
		}
		return &contentSource{kind: volumeKind, id: vid.String(), pool: vid.Pool}, nil
	}
	return nil, status.Error(codes.InvalidArgument, "volume_content_source names neither a snapshot nor a volume")
}

// createParams checks the parameters, mutable parameters and capabilities, and returns
// the pool of the new volume. A copy stays in its source's pool (params.WithSource),
// whose layout only its node knows: the layout and the mutable parameters' fit to it are
// checked there.
func (s *Server) createParams(req *csi.CreateVolumeRequest, src *contentSource) (string, error) {
	if src == nil {
		v, err := params.ParseVolume(req, nil, s.d.Params)
		if err != nil {
			return "", err
		}
		return v.Params.Pool, nil
	}
	in := map[string]string{params.ParamPool: src.pool}
	for k, v := range req.GetParameters() {
		in[k] = v
	}
	cp, err := params.ParseCreate(in, s.d.Params)
	if err != nil {
		return "", err
	}
	if cp.Pool != src.pool {
		return "", status.Errorf(codes.InvalidArgument, "parameter pool=%s: the source %s is in pool %s, and a copy stays in its source's pool", cp.Pool, src.id, src.pool)
	}
	if _, err := params.ParseMutable(req.GetMutableParameters()); err != nil {
		return "", err
	}
	if _, err := params.ParseCaps(req.GetVolumeCapabilities(), params.DefaultFSType); err != nil {
		return "", err
	}
	return cp.Pool, nil
}

// topologyNodes are the nodes the requisite and preferred topologies name by the
// node key, each once, in their order. A segment without the key names no node.
func (s *Server) topologyNodes(tr *csi.TopologyRequirement) (requisite, preferred []string) {
	add := func(list []string, ts []*csi.Topology) []string {
		for _, t := range ts {
			if n := t.GetSegments()[s.d.TopologyKey]; n != "" && !slices.Contains(list, n) {
				list = append(list, n)
			}
		}
		return list
	}
	return add(nil, tr.GetRequisite()), add(nil, tr.GetPreferred())
}

// sourceNode is the node of a clone's or a restore's source, which must be in the
// request's requisite (where it has one): a local copy is made next to its source.
func (s *Server) sourceNode(ctx context.Context, src *contentSource, requisite []string) (string, error) {
	l := lookup{kind: src.kind, id: src.id, pool: src.pool, probeHit: true,
		absent: func() (proto.Message, error) {
			return nil, status.Errorf(codes.NotFound, "source %s %s does not exist on any node", src.kind, src.id)
		},
	}
	if src.kind == snapshotKind {
		l.call = s.callOn("ListSnapshots", src.id, &csi.ListSnapshotsRequest{SnapshotId: src.id})
		l.notHere = emptyList
	} else {
		l.call = s.callOn("ControllerGetVolume", src.id, &csi.ControllerGetVolumeRequest{VolumeId: src.id})
	}
	var node string
	located := l.call
	l.call = func(ctx context.Context, n string) (proto.Message, error) {
		resp, err := located(ctx, n)
		if err == nil && !l.isNotHere(resp, err) {
			node = n
		}
		return resp, err
	}
	if _, err := s.locate(ctx, l); err != nil {
		return "", err
	}
	if len(requisite) > 0 && !slices.Contains(requisite, node) {
		return "", status.Errorf(codes.ResourceExhausted, "the source is on node %s; a local clone is made next to its source (this claim's topology allows %s)", node, strings.Join(requisite, ", "))
	}
	return node, nil
}

// placeNew chooses the node of a new empty volume. One requisite node (a
// WaitForFirstConsumer claim: --strict-topology makes the selected node the whole
// requisite) is that node. Otherwise (Immediate) the volume may already exist, made by
// an earlier attempt on a node the retry would not choose again (its call swept since):
// the hint, then every requisite node holding the pool is asked first, and one of them
// down makes the answer UNAVAILABLE. Else the first requisite node, in
// preferred order, whose live PoolNode shows the pool Ok with room for required.
func (s *Server) placeNew(ctx context.Context, id, poolName string, required int64, requisite, preferred []string) (string, error) {
	if len(requisite) == 1 {
		return requisite[0], nil
	}
	if err := s.notMixed(ctx, requisite); err != nil {
		return "", err
	}
	candidates := s.holders(poolName, "")
	if len(requisite) > 0 {
		candidates = slices.DeleteFunc(candidates, func(n string) bool { return !slices.Contains(requisite, n) })
	}
	if len(candidates) == 0 {
		return "", status.Errorf(codes.ResourceExhausted, "no node of this claim's topology (%s) has pool %s", strings.Join(requisite, ", "), poolName)
	}
	// The duplicate guard: a volume of this ID anywhere fixes the node, and so does a
	// CreateVolume call for it still under way or not yet taken (a new leader has
	// learnt nothing, and a volume not made yet answers no probe).
	n, ok := s.d.Hints.VolumeNode(id)
	if !ok {
		if p, isPending := s.d.Calls.(PendingCalls); isPending {
			n, ok = p.Pending("CreateVolume", id)
		}
	}
	if ok {
		if slices.Contains(candidates, n) || len(requisite) == 0 {
			return n, nil
		}
		return "", status.Errorf(codes.ResourceExhausted, "volume %s was made or is being made on node %s, outside this claim's topology (%s)", id, n, strings.Join(requisite, ", "))
	}
	// Every candidate is asked, and one that is down makes the create UNAVAILABLE: it
	// may hold the volume an earlier attempt made there.
	holder, _, err := s.askNodes(ctx, lookup{kind: volumeKind, id: id, pool: poolName}, candidates)
	if err != nil {
		return "", err
	}
	if holder != "" {
		return holder, nil
	}
	// In preferred order, then the rest of the requisite in its order.
	order := slices.Clone(preferred)
	for _, n := range candidates {
		if !slices.Contains(order, n) {
			order = append(order, n)
		}
	}
	for _, n := range order {
		if !slices.Contains(candidates, n) {
			continue
		}
		if live, _ := s.d.Nodes.Live(n); !live {
			continue
		}
		if pc, ok := poolOf(s.d.Nodes.Pools(n), poolName); ok && pc.Condition == nodecall.PoolOk && pc.AvailableBytes >= required {
			return n, nil
		}
	}
	return "", status.Errorf(codes.ResourceExhausted, "no live node of this claim's topology has %d bytes free in pool %s", required, poolName)
}

// notMixed refuses to place an Immediate claim (no selected node) while a node of its
// topology still runs the per-node layout's provisioner (docs/design/central-controller.md
// §8, item 3). csi-provisioner's requisite for such a claim is every Node labelled with
// the driver's topology key, which the driver's registration there sets (or the class's
// allowedTopologies). A node in it with a PoolNode has rolled: its pod runs the agent,
// and no per-node provisioner. One without may not have: its per-node provisioner races
// for Immediate claims (--node-deployment-immediate-binding) and would make the same
// claim's volume there while this one makes it on a rolled node. Rollout tells such a
// node apart from one whose new pod runs but whose agent never wrote a PoolNode (or
// that runs no poolcsi pod at all): only the first holds the claim back, the second is
// only no candidate (it has no PoolNode), so a node whose agent does not start does
// not hold every Immediate claim back for ever. Without a Rollout, or when it cannot
// tell, the node is taken to run one: two provisioners must never both create a
// volume for one claim, while waiting costs only Immediate claims.
//
// UNAVAILABLE is not final for csi-provisioner: it retries the claim, which the node's
// own provisioner takes meanwhile (its selected-node makes the requisite that node
// alone, answered by the Caller), or which this one places once that node's pod is
// replaced. A PoolNode that is stale (a rolled node that is down) does not count: no
// per-node provisioner runs there, and the probes below cover the volume it may hold.
// One look-up per node without a PoolNode, up to the first that holds the claim back.
func (s *Server) notMixed(ctx context.Context, requisite []string) error {
	known := s.d.Nodes.Known()
	var unrolled []string
	for _, n := range requisite {
		if !slices.Contains(known, n) {
			unrolled = append(unrolled, n)
		}
	}
	if len(unrolled) == 0 {
		return nil
	}
	const remedy = "the central controller places no Immediate claim while a per-node provisioner may take it too. " +
		"Finish the node DaemonSet's roll (kubectl rollout status daemonset); a node that is gone for good: delete its Node object " +
		"(or leave it out of the class's allowedTopologies); a pod left Terminating on a node that is down for good: delete that pod"
	if s.d.Rollout == nil {
		return status.Errorf(codes.Unavailable, "nodes %s of this claim's topology have no PoolNode, so they may still run the per-node provisioner, which takes Immediate claims: %s", strings.Join(unrolled, ", "), remedy)
	}
	for _, n := range unrolled {
		pod, err := s.d.Rollout.PerNodeProvisioner(ctx, n)
		if err != nil {
			return status.Errorf(codes.Unavailable, "node %s of this claim's topology has no PoolNode, and whether it still runs the per-node provisioner is unknown (%v): %s", n, err, remedy)
		}
		if pod != "" {
			return status.Errorf(codes.Unavailable, "node %s of this claim's topology still runs the per-node provisioner (pod %s), which takes Immediate claims; its pod has not been replaced by the central layout's yet: %s", n, pod, remedy)
		}
	}
	return nil
}

func poolOf(pools []nodecall.PoolCapacity, name string) (nodecall.PoolCapacity, bool) {
	for _, p := range pools {
		if p.Name == name {
			return p, true
		}
	}
	return nodecall.PoolCapacity{}, false
}

// createGroup checks a group snapshot's arguments, locates its volumes and sends it to
// their node: a local pool exists once per node, and a group takes volumes of one pool.
// Volumes on several nodes are taken in two phases across them (createAcross).
func (s groupServer) createGroup(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (proto.Message, error) {
	name := req.GetName()
	if err := params.CheckRequestName("group snapshot", name); err != nil {
		return nil, err
	}
	if err := checkSnapshotParams(req.GetParameters(), true); err != nil {
		return nil, err
	}
	raws := req.GetSourceVolumeIds()
	if len(raws) == 0 {
		return nil, status.Error(codes.InvalidArgument, "source_volume_ids is required")
	}
	if len(raws) > pool.MaxGroupMembers {
		return nil, status.Errorf(codes.InvalidArgument, "source_volume_ids: %d volumes, a group snapshot takes at most %d", len(raws), pool.MaxGroupMembers)
	}
	vids := make([]pool.VolumeID, len(raws))
	seen := map[string]bool{}
	for i, raw := range raws {
		vid, ok, err := s.volumeArg(raw, false)
		if err != nil {
			return nil, err
		}
		if seen[vid.String()] {
			return nil, status.Errorf(codes.InvalidArgument, "source_volume_ids: volume %s is named twice", vid)
		}
		seen[vid.String()] = true
		if vid.Pool != vids[0].Pool && i > 0 {
			return nil, status.Errorf(codes.InvalidArgument, "source_volume_ids: volumes %s and %s are in different pools; a group snapshot takes volumes of one pool", vids[0], vid)
		}
		if !ok {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist (pool %s is not one of this driver's)", vid, vid.Pool)
		}
		vids[i] = vid
	}
	gid := pool.GroupSnapshotID{SnapshotID: pool.NewSnapshotID(vids[0].Pool, name)}.String()
	// Members hinted on one node are taken at their word: the node finds them itself, and
	// only its NOT_FOUND (or hints that disagree) costs the confirming calls.
	if n, ok := s.sameHint(vids); ok {
		if resp, err := s.groupOn(ctx, n, gid, req); status.Code(err) != codes.NotFound {
			return resp, err
		}
	}
	nodes := make([]string, len(vids))
	for i, vid := range vids {
		src := &contentSource{kind: volumeKind, id: vid.String(), pool: vid.Pool}
		n, err := s.sourceNode(ctx, src, nil)
		if err != nil {
			return nil, err
		}
		nodes[i] = n
	}
	for i := range nodes {
		if nodes[i] != nodes[0] {
			// Members on several nodes: two phases across them (crossgroup.go).
			gsid, _ := pool.ParseGroupSnapshotID(gid)
			return s.createAcross(ctx, gsid, name, vids, nodes)
		}
	}
	return s.groupOn(ctx, nodes[0], gid, req)
}

// sameHint is the node every volume is hinted on, if they all are, on one node.
func (s *Server) sameHint(vids []pool.VolumeID) (string, bool) {
	node := ""
	for _, vid := range vids {
		n, ok := s.d.Hints.VolumeNode(vid.String())
		if !ok || (node != "" && n != node) {
			return "", false
		}
		node = n
	}
	return node, node != ""
}

// groupOn is the CreateVolumeGroupSnapshot on node; the group and its members are learnt
// there.
func (s *Server) groupOn(ctx context.Context, node, gid string, req *csi.CreateVolumeGroupSnapshotRequest) (proto.Message, error) {
	resp, err := s.d.Calls.Call(ctx, node, "CreateVolumeGroupSnapshot", gid, req)
	if err == nil {
		s.d.Hints.Learn(gid, node)
		if g, ok := resp.(*csi.CreateVolumeGroupSnapshotResponse); ok {
			for _, sn := range g.GetGroupSnapshot().GetSnapshots() {
				s.d.Hints.Learn(sn.GetSnapshotId(), node)
			}
		}
	}
	return resp, err
}
