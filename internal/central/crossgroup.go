package central

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// A group snapshot whose members sit on several nodes (docs/design/central-controller.md
// §7.1), taken at one instant in two phases, the argument of the shared pools'
// coordinator (internal/freeze/coordinator.go): every node holding members freezes and
// holds them for a bound armed on the node (FreezeGroupHold), and only once every node
// answered frozen does each copy its members under its hold and record its part of
// the group under the group's ID (SnapshotHeld). Every freeze was acknowledged before
// any copy began, so the freezes overlap, and any instant of the overlap is the
// group's. On any failure every node asked lets its hold go (ThawGroup), the parts
// recorded are deleted, and the answer is ABORTED (a node refused) or UNAVAILABLE (a
// node did not answer); the sidecar retries with the same name. The calls' names
// derive from the group ID, the node and its members, so a retried create finds the
// first try's calls.

// DefaultGroupHold is the bound central asks for a group's holds; each node caps it
// (--freeze-max-hold, its volumes' freeze budgets).
const DefaultGroupHold = 60 * time.Second

// abortTimeout bounds the thaws and deletes after a failed group, made after the
// caller's context may have ended: a node thaws at its bound in any case.
const abortTimeout = 20 * time.Second

// groupPart is one node's part of a group across nodes.
type groupPart struct {
	node    string
	members []string // sorted
	held    *nodecall.GroupHeld
	resp    *csi.VolumeGroupSnapshot
	err     error
}

// createAcross takes the group gid of the volumes vids, vids[i] on nodes[i].
func (s groupServer) createAcross(ctx context.Context, gid pool.GroupSnapshotID, name string, vids []pool.VolumeID, nodes []string) (proto.Message, error) {
	log := klog.FromContext(ctx).WithValues("groupSnapshot", gid.String())
	byNode := map[string][]string{}
	all := make([]string, len(vids))
	for i, vid := range vids {
		byNode[nodes[i]] = append(byNode[nodes[i]], vid.String())
		all[i] = vid.String()
	}
	sort.Strings(all)
	parts := make([]*groupPart, 0, len(byNode))
	for n, m := range byNode {
		sort.Strings(m)
		parts = append(parts, &groupPart{node: n, members: m})
	}
	sort.Slice(parts, func(i, j int) bool { return parts[i].node < parts[j].node })
	// Nothing is asked of any node while one is down.
	for _, p := range parts {
		if err := s.live(p.node, fmt.Sprintf("group snapshot %s has volumes there", gid)); err != nil {
			return nil, err
		}
	}
	bound := s.d.GroupHold
	if bound <= 0 {
		bound = DefaultGroupHold
	}

	// Phase 1: every node holds its members.
	s.eachPart(ctx, parts, func(ctx context.Context, p *groupPart) error {
		req, err := nodecall.ToStruct(nodecall.FreezeGroupHold{Group: gid.String(), Name: name, Members: p.members, BoundMillis: bound.Milliseconds()})
		if err != nil {
			return status.Errorf(codes.Internal, "encode the hold: %v", err)
		}
		resp, err := s.d.Calls.Call(ctx, p.node, nodecall.MethodFreezeGroupHold, gid.String(), req)
		if err != nil {
			return err
		}
		st, ok := resp.(*structpb.Struct)
		var held nodecall.GroupHeld
		if !ok || nodecall.FromStruct(st, &held) != nil || held.Nonce == "" {
			return status.Errorf(codes.Internal, "node %s answered the hold of group snapshot %s without a nonce", p.node, gid)
		}
		p.held = &held
		return nil
	})
	if err := s.failed(parts, "hold"); err != nil {
		s.abortAcross(ctx, gid, all, parts, false)
		return nil, err
	}
	// A part recorded by an earlier try beside holds taken now: that try ended
	// before every node had its part, and the abort's delete never reached this
	// one. Its copies are of that try's instant, not of the one these holds make,
	// so they are deleted with the rest, and the retry takes every part anew. (All
	// parts recorded is a create that finished: answered again below.)
	var stale []string
	for _, p := range parts {
		if p.held.Nonce == nodecall.RecordedHold {
			stale = append(stale, p.node)
		}
	}
	if len(stale) > 0 && len(stale) < len(parts) {
		s.abortAcross(ctx, gid, all, parts, true)
		return nil, status.Errorf(codes.Aborted, "group snapshot %s: node(s) %s held a part left by an earlier try that did not finish on every node, of another instant; it was deleted and every hold let go: retry", gid, strings.Join(stale, ", "))
	}
	log.V(2).Info("Every node holds its members of the group snapshot; copying", "nodes", len(parts))

	// Phase 2: only now, each node copies under its hold.
	s.eachPart(ctx, parts, func(ctx context.Context, p *groupPart) error {
		req, err := nodecall.ToStruct(nodecall.SnapshotHeld{Group: gid.String(), Name: name, Members: p.members, All: all, Nonce: p.held.Nonce})
		if err != nil {
			return status.Errorf(codes.Internal, "encode the copy: %v", err)
		}
		resp, err := s.d.Calls.Call(ctx, p.node, nodecall.MethodSnapshotHeld, gid.String(), req)
		if err != nil {
			return err
		}
		g, ok := resp.(*csi.CreateVolumeGroupSnapshotResponse)
		if !ok {
			return status.Errorf(codes.Internal, "node %s answered the copy of group snapshot %s with a %T", p.node, gid, resp)
		}
		if err := checkPart(gid, p, g.GetGroupSnapshot()); err != nil {
			return err
		}
		p.resp = g.GetGroupSnapshot()
		return nil
	})
	if err := s.failed(parts, "copy"); err != nil {
		s.abortAcross(ctx, gid, all, parts, true)
		return nil, err
	}

	out := &csi.VolumeGroupSnapshot{GroupSnapshotId: gid.String(), ReadyToUse: true}
	byVolume := map[string]*csi.Snapshot{}
	nodeNames := make([]string, len(parts))
	for i, p := range parts {
		nodeNames[i] = p.node
		out.ReadyToUse = out.ReadyToUse && p.resp.GetReadyToUse()
		if ct := p.resp.GetCreationTime(); ct != nil && (out.CreationTime == nil || ct.AsTime().Before(out.CreationTime.AsTime())) {
			out.CreationTime = ct
		}
		for _, sn := range p.resp.GetSnapshots() {
			byVolume[sn.GetSourceVolumeId()] = sn
			s.d.Hints.Learn(sn.GetSnapshotId(), p.node)
		}
	}
	for _, vid := range vids {
		out.Snapshots = append(out.Snapshots, byVolume[vid.String()])
	}
	s.d.Hints.LearnGroup(gid.String(), nodeNames)
	log.Info("Created a group snapshot across nodes", "nodes", nodeNames, "members", len(vids))
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: out}, nil
}

// eachPart runs f on every part at once, recording its error.
func (s *Server) eachPart(ctx context.Context, parts []*groupPart, f func(context.Context, *groupPart) error) {
	var wg sync.WaitGroup
	for _, p := range parts {
		wg.Go(func() { p.err = f(ctx, p) })
	}
	wg.Wait()
}

// failed is the answer to a phase in which a node failed: UNAVAILABLE when a node
// did not answer (down, not taken, deleted), else ABORTED with the nodes' refusals.
// The node's own words are kept.
func (s *Server) failed(parts []*groupPart, phase string) error {
	var why []string
	code := codes.Aborted
	for _, p := range parts {
		if p.err == nil {
			continue
		}
		st := status.Convert(p.err)
		if st.Code() == codes.Unavailable || st.Code() == codes.DeadlineExceeded || st.Code() == codes.Canceled {
			code = codes.Unavailable
		}
		why = append(why, fmt.Sprintf("node %s: %s: %s", p.node, st.Code(), st.Message()))
	}
	if len(why) == 0 {
		return nil
	}
	return status.Errorf(code, "group snapshot across nodes: the %s failed (%s); every node's hold was let go and nothing of it kept: retry", phase, strings.Join(why, "; "))
}

// checkPart holds a node's part to what was asked: the group's ID, and one member
// snapshot of each of the node's volumes, of the ID the group and the volume make.
// A part is recorded in a content; a node may not answer with another's snapshots.
func checkPart(gid pool.GroupSnapshotID, p *groupPart, g *csi.VolumeGroupSnapshot) error {
	bad := func(what string) error {
		return status.Errorf(codes.Internal, "node %s answered the copy of group snapshot %s with %s", p.node, gid, what)
	}
	if g.GetGroupSnapshotId() != gid.String() {
		return bad(fmt.Sprintf("group %q", g.GetGroupSnapshotId()))
	}
	if len(g.GetSnapshots()) != len(p.members) {
		return bad(fmt.Sprintf("%d snapshots for %d volumes", len(g.GetSnapshots()), len(p.members)))
	}
	seen := map[string]bool{}
	for _, sn := range g.GetSnapshots() {
		src := sn.GetSourceVolumeId()
		if _, ok := slices.BinarySearch(p.members, src); !ok || seen[src] || sn.GetSnapshotId() != pool.GroupMemberID(gid, src).String() {
			return bad(fmt.Sprintf("snapshot %q of volume %q", sn.GetSnapshotId(), src))
		}
		seen[src] = true
	}
	return nil
}

// abortAcross lets every node's hold go (the ones that answered, by nonce; the others,
// whose answer never came, any hold of the group: their call may still run), and after
// a copy deletes every part that may have been recorded. Not bound to the caller's
// context, which may have ended: a node thaws at its bound anyway.
func (s *Server) abortAcross(ctx context.Context, gid pool.GroupSnapshotID, all []string, parts []*groupPart, copied bool) {
	log := klog.FromContext(ctx)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), abortTimeout)
	defer cancel()
	members := make([]string, len(all))
	for i, v := range all {
		members[i] = pool.GroupMemberID(gid, v).String()
	}
	var wg sync.WaitGroup
	for _, p := range parts {
		wg.Go(func() {
			thaw := nodecall.ThawGroup{Group: gid.String()}
			if p.held != nil {
				thaw.Nonce = p.held.Nonce
			}
			req, _ := nodecall.ToStruct(thaw)
			if _, err := s.d.Calls.Call(ctx, p.node, nodecall.MethodThawGroup, gid.String(), req); err != nil {
				log.Error(err, "Letting a group snapshot's hold go failed; the node thaws at its bound", "groupSnapshot", gid, "node", p.node)
			}
			if !copied {
				return
			}
			del := &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: gid.String(), SnapshotIds: members}
			if _, err := s.d.Calls.Call(ctx, p.node, "DeleteVolumeGroupSnapshot", gid.String(), del); err != nil {
				log.Error(err, "Deleting a part of a failed group snapshot failed; the retry or the delete of the group removes it", "groupSnapshot", gid, "node", p.node)
			}
		})
	}
	wg.Wait()
}

// holdersError is askNodes' answer for a group held on several nodes: parts of one
// group across nodes.
type holdersError struct{ nodes []string }

func (e *holdersError) Error() string {
	return "held on nodes " + strings.Join(e.nodes, ", ")
}

// groupNodes are the nodes holding parts of a group across nodes, if the hints
// say so (the nodes of its content's member PVs, or learnt at its create): none or
// one node is the one-node path.
func (s *Server) groupNodes(gid string) []string {
	nodes := s.d.Hints.GroupNodes(gid)
	if len(nodes) < 2 {
		return nil
	}
	return nodes
}

// underwayAcross is ABORTED while a create of the group, or one of its phases, is
// under way.
func (s *Server) underwayAcross(gid string) error {
	p, ok := s.d.Calls.(PendingCalls)
	if !ok {
		return nil
	}
	for _, m := range []string{"CreateVolumeGroupSnapshot", nodecall.MethodFreezeGroupHold, nodecall.MethodSnapshotHeld} {
		if node, ok := p.Underway(m, gid); ok {
			return status.Errorf(codes.Aborted, "group snapshot %s: a %s of it is under way on node %s; retry once it is answered", gid, m, node)
		}
	}
	return nil
}

// onParts runs a group call on every node holding a part, at once: every node must
// be live (a part may be there), and each answer is kept.
func (s *Server) onParts(ctx context.Context, gid string, nodes []string, method string, req proto.Message) ([]proto.Message, []error, error) {
	if err := s.underwayAcross(gid); err != nil {
		return nil, nil, err
	}
	for _, n := range nodes {
		if err := s.live(n, "a part of group snapshot "+gid+" may be there"); err != nil {
			return nil, nil, err
		}
	}
	resps := make([]proto.Message, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() { resps[i], errs[i] = s.d.Calls.Call(ctx, n, method, gid, req) })
	}
	wg.Wait()
	return resps, errs, nil
}

// deleteParts deletes every node's part; done when every node answered (a part gone
// is success there).
func (s *Server) deleteParts(ctx context.Context, gid string, nodes []string, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	_, errs, err := s.onParts(ctx, gid, nodes, "DeleteVolumeGroupSnapshot", req)
	if err != nil {
		return nil, err
	}
	if err := firstError(errs); err != nil {
		return nil, err
	}
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}

// getParts merges every node's part: NOT_FOUND only when no node has one; ready
// when every node has its part and each is ready.
func (s *Server) getParts(ctx context.Context, gid string, nodes []string, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	resps, errs, err := s.onParts(ctx, gid, nodes, "GetVolumeGroupSnapshot", req)
	if err != nil {
		return nil, err
	}
	out := &csi.VolumeGroupSnapshot{GroupSnapshotId: gid, ReadyToUse: true}
	found := 0
	for i, resp := range resps {
		if status.Code(errs[i]) == codes.NotFound {
			out.ReadyToUse = false
			continue
		}
		if errs[i] != nil {
			return nil, errs[i]
		}
		g, ok := resp.(*csi.GetVolumeGroupSnapshotResponse)
		if !ok || g.GetGroupSnapshot().GetGroupSnapshotId() != gid {
			return nil, status.Errorf(codes.Internal, "node %s answered the get of group snapshot %s with another group", nodes[i], gid)
		}
		found++
		part := g.GetGroupSnapshot()
		out.ReadyToUse = out.ReadyToUse && part.GetReadyToUse()
		if ct := part.GetCreationTime(); ct != nil && (out.CreationTime == nil || ct.AsTime().Before(out.CreationTime.AsTime())) {
			out.CreationTime = ct
		}
		out.Snapshots = append(out.Snapshots, part.GetSnapshots()...)
	}
	if found == 0 {
		return nil, status.Errorf(codes.NotFound, "group snapshot %s does not exist on any of nodes %s", gid, strings.Join(nodes, ", "))
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: out}, nil
}

// firstError is the first error, an UNAVAILABLE before any other.
func firstError(errs []error) error {
	var first error
	for _, err := range errs {
		if err == nil {
			continue
		}
		if status.Code(err) == codes.Unavailable {
			return err
		}
		if first == nil {
			first = err
		}
	}
	return first
}

// asHolders is the nodes of a holdersError.
func asHolders(err error) ([]string, bool) {
	var h *holdersError
	if errors.As(err, &h) {
		return h.nodes, true
	}
	return nil, false
}

// partsBeyondHint tells, for a delete whose group is hinted on one node, whether that
// node holds only a part of a group across nodes (the other members' PVs gone, and
// the create's nodes not learnt by this process): its Get lists fewer snapshots than
// the call names. Then every node holding the pool is asked, and the holders are
// returned (nil: the one-node path, the hint trusted as before). A delete must not say
// OK while another node keeps a part. A group of one member is never a part.
func (s *Server) partsBeyondHint(ctx context.Context, gid pool.GroupSnapshotID, ids []string) ([]string, error) {
	node, ok := s.hint(groupKind, gid.String())
	if !ok || len(distinct(ids)) < 2 {
		return nil, nil
	}
	if err := s.live(node, "group snapshot "+gid.String()+" is there"); err != nil {
		return nil, err
	}
	resp, err := s.d.Calls.Call(ctx, node, "GetVolumeGroupSnapshot", gid.String(), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: gid.String(), SnapshotIds: ids})
	g, isGet := resp.(*csi.GetVolumeGroupSnapshotResponse)
	if err != nil || !isGet || !isPart(g, ids) {
		return nil, nil // the node's own answer comes with the delete
	}
	return s.partHolders(ctx, gid, ids)
}

// isPart tells whether a node's Get of a group is only its part of a group across
// nodes: fewer snapshots than the call names.
func isPart(g *csi.GetVolumeGroupSnapshotResponse, ids []string) bool {
	return len(g.GetGroupSnapshot().GetSnapshots()) < len(distinct(ids))
}

// partHolders asks every node holding gid's pool for the group: the nodes holding a
// part of it (none or one: the one-node path), or the lookup's error.
func (s *Server) partHolders(ctx context.Context, gid pool.GroupSnapshotID, ids []string) ([]string, error) {
	holder, _, err := s.askNodes(ctx, lookup{kind: groupKind, id: gid.String(), pool: gid.Pool, members: ids}, s.holders(gid.Pool, ""))
	if nodes, ok := asHolders(err); ok {
		return nodes, nil
	}
	if err != nil || holder == "" {
		return nil, err
	}
	return []string{holder}, nil
}

func distinct(ids []string) []string { return slices.Compact(slices.Sorted(slices.Values(ids))) }
