package central

import (
	"context"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Server is the local driver's central CSI server: Identity, Controller and
// GroupController. Every call's arguments are checked here before any PoolCall exists
// (a hostile request is INVALID_ARGUMENT and reaches no node), then the call goes to the
// node that holds what it is about (locate.go) or that a new volume is made on
// (create.go); only GetCapacity is answered here (capacity.go).
type Server struct {
	d     Deps
	clock clock.Clock
}

// NewServer returns the server over d.
func NewServer(d Deps) *Server {
	s := &Server{d: d, clock: d.Clock}
	if s.clock == nil {
		s.clock = clock.RealClock{}
	}
	return s
}

// Register registers the three services on g.
func (s *Server) Register(g grpc.ServiceRegistrar) {
	csi.RegisterIdentityServer(g, identityServer{Server: s})
	csi.RegisterControllerServer(g, controllerServer{Server: s})
	csi.RegisterGroupControllerServer(g, groupServer{Server: s})
}

// The services are three types over one Server: the Unimplemented servers each carry
// the same unexported methods, so one type cannot embed all three.
type (
	identityServer struct {
		csi.UnimplementedIdentityServer
		*Server
	}
	controllerServer struct {
		csi.UnimplementedControllerServer
		*Server
	}
	groupServer struct {
		csi.UnimplementedGroupControllerServer
		*Server
	}
)

func (s identityServer) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.d.Name, VendorVersion: s.d.Version}, nil
}

// GetPluginCapabilities is what the node driver advertises with its controller
// (internal/driver/identity.go): topology, the controller and group services, and
// expansion online and offline (the node grows the file system).
func (s identityServer) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	svc := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
	}
	exp := func(t csi.PluginCapability_VolumeExpansion_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: t}}}
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{
		svc(csi.PluginCapability_Service_CONTROLLER_SERVICE),
		svc(csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE),
		svc(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
		exp(csi.PluginCapability_VolumeExpansion_ONLINE),
		exp(csi.PluginCapability_VolumeExpansion_OFFLINE),
	}}, nil
}

// Probe is ready once the node view and the hints have their first full list: before
// that a call would find no node live and no hint, and answer UNAVAILABLE or ask every
// node for nothing.
func (s identityServer) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(s.d.Nodes.Synced() && s.d.Hints.Synced())}, nil
}

// Probe is the Identity service's Probe, for the built-in /healthz (--healthz-address).
func (s *Server) Probe(ctx context.Context, req *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return identityServer{Server: s}.Probe(ctx, req)
}

// controllerCaps (docs/design/central-controller.md §5): the node driver's for a local
// pool less PUBLISH_* (nothing to attach), LIST_VOLUMES and the volume-health ones
// (health stays on the node, in NodeGetVolumeStats).
var controllerCaps = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csi.ControllerServiceCapability_RPC_GET_VOLUME,
	csi.ControllerServiceCapability_RPC_GET_CAPACITY,
	csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
}

func (s controllerServer) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	out := make([]*csi.ControllerServiceCapability, len(controllerCaps))
	for i, c := range controllerCaps {
		out[i] = &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}}}
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: out}, nil
}

func (s groupServer) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: []*csi.GroupControllerServiceCapability{{
		Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{
			Type: csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,
		}},
	}}}, nil
}

// --- argument checks, as the node makes them (internal/driver/request.go) ---

// volumeArg parses a volume ID. ok is false for an ID that names no volume of the local
// driver without being malformed: a pool it does not have (a share's, another
// driver's); when foreignIsNotFound, also an ID of another form that is not hostile.
func (s *Server) volumeArg(raw string, foreignIsNotFound bool) (id pool.VolumeID, ok bool, err error) {
	if raw == "" {
		return id, false, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	id, perr := pool.ParseVolumeID(raw)
	switch {
	case perr == nil:
		return id, s.ownPool(id.Pool), nil
	case foreignIsNotFound && !pool.HostileID(raw):
		return id, false, nil
	}
	return id, false, status.Errorf(codes.InvalidArgument, "volume_id: %v", perr)
}

// snapshotArg is parseSnapshotRef of the node driver: an ID of another form is not
// found, unless it is hostile; field names the field in the message.
func (s *Server) snapshotArg(field, raw string) (id pool.SnapshotID, ok bool, err error) {
	if raw == "" {
		return id, false, status.Errorf(codes.InvalidArgument, "%s is required", field)
	}
	id, perr := pool.ParseSnapshotID(raw)
	switch {
	case perr == nil:
		return id, s.ownPool(id.Pool), nil
	case pool.HostileID(raw):
		return id, false, status.Errorf(codes.InvalidArgument, "%s: %v", field, perr)
	}
	return id, false, nil
}

// groupArg is snapshotArg for a group snapshot ID.
func (s *Server) groupArg(raw string) (id pool.GroupSnapshotID, ok bool, err error) {
	if raw == "" {
		return id, false, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	id, perr := pool.ParseGroupSnapshotID(raw)
	switch {
	case perr == nil:
		return id, s.ownPool(id.Pool), nil
	case pool.HostileID(raw):
		return id, false, status.Errorf(codes.InvalidArgument, "group_snapshot_id: %v", perr)
	}
	return id, false, nil
}

// ownPool tells whether name is one of the local driver's pools. An ID of a share
// pool never is: the local driver has no shares.
func (s *Server) ownPool(name string) bool {
	for _, p := range s.d.Params.Pools {
		if p == name {
			return true
		}
	}
	return false
}

// checkSnapshotParams is the node's: only the csi.storage.k8s.io/* keys the snapshotter
// adds, and for a group, deletionPolicy (internal/driver/group.go says why).
func checkSnapshotParams(in map[string]string, group bool) error {
	for k, v := range in {
		switch {
		case strings.HasPrefix(k, params.K8sPrefix):
		case group && k == "deletionPolicy" && (v == "Delete" || v == "Retain"):
		default:
			return status.Errorf(codes.InvalidArgument, "unknown snapshot parameter %q (poolcsi takes none)", k)
		}
	}
	return nil
}

// --- volumes ---

func (s controllerServer) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (_ *csi.DeleteVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	id, ok, err := s.volumeArg(req.GetVolumeId(), false)
	if err != nil {
		return nil, err
	}
	if !ok {
		return &csi.DeleteVolumeResponse{}, nil // no pool of this driver: nothing of it exists
	}
	resp, err := s.locate(ctx, lookup{kind: volumeKind, id: id.String(), pool: id.Pool, trustHint: true, madeBy: "CreateVolume",
		call:   s.callOn("DeleteVolume", id.String(), req),
		absent: func() (proto.Message, error) { return &csi.DeleteVolumeResponse{}, nil },
	})
	return as[*csi.DeleteVolumeResponse](resp, err)
}

func (s controllerServer) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (_ *csi.ControllerGetVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	id, ok, err := s.volumeArg(req.GetVolumeId(), false)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist (pool %s is not one of this driver's)", id, id.Pool)
	}
	resp, err := s.locate(ctx, s.volumeLookup(id, "ControllerGetVolume", req))
	return as[*csi.ControllerGetVolumeResponse](resp, err)
}

func (s controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (_ *csi.ValidateVolumeCapabilitiesResponse, err error) {
	defer csierr.ToStatus(&err)
	id, ok, err := s.volumeArg(req.GetVolumeId(), false)
	if err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist (pool %s is not one of this driver's)", id, id.Pool)
	}
	resp, err := s.locate(ctx, s.volumeLookup(id, "ValidateVolumeCapabilities", req))
	return as[*csi.ValidateVolumeCapabilitiesResponse](resp, err)
}

func (s controllerServer) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (_ *csi.ControllerExpandVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	id, ok, err := s.volumeArg(req.GetVolumeId(), false)
	if err != nil {
		return nil, err
	}
	r := req.GetCapacityRange()
	if r == nil || (r.GetRequiredBytes() == 0 && r.GetLimitBytes() == 0) {
		return nil, status.Error(codes.InvalidArgument, "capacity_range with required_bytes or limit_bytes is required")
	}
	if r.GetRequiredBytes() < 0 || r.GetLimitBytes() < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "capacity_range must not be negative (required %d, limit %d)", r.GetRequiredBytes(), r.GetLimitBytes())
	}
	if c := req.GetVolumeCapability(); c != nil {
		if _, err := params.ParseCaps([]*csi.VolumeCapability{c}, ""); err != nil {
			return nil, err
		}
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist (pool %s is not one of this driver's)", id, id.Pool)
	}
	l := s.volumeLookup(id, "ControllerExpandVolume", req)
	l.madeBy = "CreateVolume"
	resp, err := s.locate(ctx, l)
	return as[*csi.ControllerExpandVolumeResponse](resp, err)
}

func (s controllerServer) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (_ *csi.ControllerModifyVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	id, ok, err := s.volumeArg(req.GetVolumeId(), true)
	if err != nil {
		return nil, err
	}
	if _, err := params.ParseMutable(req.GetMutableParameters()); err != nil {
		return nil, err
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q does not exist (not a volume of this driver)", req.GetVolumeId())
	}
	l := s.volumeLookup(id, "ControllerModifyVolume", req)
	l.madeBy = "CreateVolume"
	resp, err := s.locate(ctx, l)
	return as[*csi.ControllerModifyVolumeResponse](resp, err)
}

// volumeLookup is the lookup of a call about an existing volume: sent to its node, and
// NOT_FOUND there makes every node be asked.
func (s *Server) volumeLookup(id pool.VolumeID, method string, req proto.Message) lookup {
	return lookup{kind: volumeKind, id: id.String(), pool: id.Pool,
		call: s.callOn(method, id.String(), req),
		absent: func() (proto.Message, error) {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist on any node", id)
		},
	}
}

// --- snapshots ---

func (s controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (_ *csi.CreateSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	if err := params.CheckRequestName("snapshot", req.GetName()); err != nil {
		return nil, err
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "source_volume_id is required")
	}
	if err := checkSnapshotParams(req.GetParameters(), false); err != nil {
		return nil, err
	}
	vid, ok, err := s.volumeArg(req.GetSourceVolumeId(), false)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "source volume %s does not exist (pool %s is not one of this driver's)", vid, vid.Pool)
	}
	sid := pool.NewSnapshotID(vid.Pool, req.GetName()).String()
	l := lookup{kind: volumeKind, id: vid.String(), pool: vid.Pool,
		call: s.callOn("CreateSnapshot", sid, req),
		absent: func() (proto.Message, error) {
			return nil, status.Errorf(codes.NotFound, "source volume %s does not exist on any node", vid)
		},
		also: []string{sid},
	}
	resp, err := s.locate(ctx, l)
	if err == nil {
		// As for a create (checkCreated): the answer becomes a VolumeSnapshotContent, and
		// a restore goes where its handle says.
		cs, ok := resp.(*csi.CreateSnapshotResponse)
		switch {
		case !ok || cs.GetSnapshot() == nil:
			return nil, status.Errorf(codes.Internal, "the create of snapshot %s was answered without a snapshot", sid)
		case cs.GetSnapshot().GetSnapshotId() != sid || cs.GetSnapshot().GetSourceVolumeId() != vid.String():
			return nil, status.Errorf(codes.Internal, "the create of snapshot %s of %s was answered with snapshot %q of %q", sid, vid,
				cs.GetSnapshot().GetSnapshotId(), cs.GetSnapshot().GetSourceVolumeId())
		}
	}
	return as[*csi.CreateSnapshotResponse](resp, err)
}

func (s controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (_ *csi.DeleteSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	sid, ok, err := s.snapshotArg("snapshot_id", req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	if !ok {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	resp, err := s.locate(ctx, lookup{kind: snapshotKind, id: sid.String(), pool: sid.Pool, trustHint: true, madeBy: "CreateSnapshot",
		call:   s.callOn("DeleteSnapshot", sid.String(), req),
		absent: func() (proto.Message, error) { return &csi.DeleteSnapshotResponse{}, nil },
	})
	return as[*csi.DeleteSnapshotResponse](resp, err)
}

// GetSnapshot has no PoolCall of its own: it is ListSnapshots{snapshot_id} on the
// snapshot's node, which answers a snapshot that is not there with no entry.
func (s controllerServer) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (_ *csi.GetSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	sid, ok, err := s.snapshotArg("snapshot_id", req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "snapshot %q does not exist (not a snapshot of this driver)", req.GetSnapshotId())
	}
	resp, err := s.locate(ctx, s.snapshotLookup(sid, &csi.ListSnapshotsRequest{SnapshotId: sid.String()}))
	if err != nil {
		return nil, err
	}
	entries := resp.(*csi.ListSnapshotsResponse).GetEntries()
	if len(entries) == 0 {
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist on any node", sid)
	}
	return &csi.GetSnapshotResponse{Snapshot: entries[0].GetSnapshot()}, nil
}

// snapshotLookup is ListSnapshots{snapshot_id} on the snapshot's node: an empty answer
// is the node's "not here".
func (s *Server) snapshotLookup(sid pool.SnapshotID, req *csi.ListSnapshotsRequest) lookup {
	return lookup{kind: snapshotKind, id: sid.String(), pool: sid.Pool,
		call:     s.callOn("ListSnapshots", sid.String(), req),
		notHere:  emptyList,
		absent:   func() (proto.Message, error) { return &csi.ListSnapshotsResponse{}, nil },
		probeHit: true,
	}
}

func emptyList(resp proto.Message, err error) bool {
	l, ok := resp.(*csi.ListSnapshotsResponse)
	return err == nil && ok && len(l.GetEntries()) == 0
}

func (s controllerServer) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (_ *csi.ListSnapshotsResponse, err error) {
	defer csierr.ToStatus(&err)
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max_entries must not be negative")
	}
	if token := req.GetStartingToken(); token != "" {
		if _, err := pool.ParseSnapshotID(token); err != nil {
			return nil, status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token)
		}
	}
	if raw := req.GetSnapshotId(); raw != "" {
		sid, ok, err := s.snapshotArg("snapshot_id", raw)
		if err != nil || !ok {
			return &csi.ListSnapshotsResponse{}, err
		}
		resp, err := s.locate(ctx, s.snapshotLookup(sid, req))
		return as[*csi.ListSnapshotsResponse](resp, err)
	}
	if src := req.GetSourceVolumeId(); src != "" {
		if pool.HostileID(src) {
			return nil, status.Errorf(codes.InvalidArgument, "source_volume_id %q is not a poolcsi volume ID", src)
		}
		vid, err := pool.ParseVolumeID(src)
		if err != nil || !s.ownPool(vid.Pool) {
			return &csi.ListSnapshotsResponse{}, nil // no snapshot of this driver has that source
		}
		// A volume's snapshots are in its pool, on its node; a source whose PV is gone
		// has no hint, and every node is asked.
		if node, ok := s.d.Hints.VolumeNode(vid.String()); ok {
			if err := s.live(node, "the snapshots of "+vid.String()+" are there"); err != nil {
				return nil, err
			}
			resp, err := s.d.Calls.Call(ctx, node, "ListSnapshots", vid.String(), req)
			return as[*csi.ListSnapshotsResponse](resp, err)
		}
	}
	return s.listEverywhere(ctx, req)
}

// --- group snapshots ---

func (s groupServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (_ *csi.CreateVolumeGroupSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	resp, err := s.createGroup(ctx, req)
	return as[*csi.CreateVolumeGroupSnapshotResponse](resp, err)
}

func (s groupServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (_ *csi.DeleteVolumeGroupSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	gid, ok, err := s.groupArg(req.GetGroupSnapshotId())
	if err != nil {
		return nil, err
	}
	// A group of no pool of this driver is gone whatever members the call names, as
	// the node driver answers it (it compares them only with a group it holds).
	if !ok {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
	}
	if err := checkSnapshotIDs(req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	// A phase of a group across nodes under way: its parts answer no probe yet, and a
	// delete would say OK and leave them (crossgroup.go).
	if err := s.underwayAcross(gid.String()); err != nil {
		return nil, err
	}
	// A group across nodes: every node's part.
	if nodes := s.groupNodes(gid.String()); nodes != nil {
		return s.deleteParts(ctx, gid.String(), nodes, req)
	}
	if nodes, err := s.partsBeyondHint(ctx, gid, req.GetSnapshotIds()); err != nil {
		return nil, err
	} else if nodes != nil {
		return s.deleteParts(ctx, gid.String(), nodes, req)
	}
	resp, err := s.locate(ctx, lookup{kind: groupKind, id: gid.String(), pool: gid.Pool, trustHint: true, members: req.GetSnapshotIds(), madeBy: "CreateVolumeGroupSnapshot",
		call:   s.callOn("DeleteVolumeGroupSnapshot", gid.String(), req),
		absent: func() (proto.Message, error) { return &csi.DeleteVolumeGroupSnapshotResponse{}, nil },
	})
	if nodes, ok := asHolders(err); ok {
		return s.deleteParts(ctx, gid.String(), nodes, req)
	}
	return as[*csi.DeleteVolumeGroupSnapshotResponse](resp, err)
}

func (s groupServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (_ *csi.GetVolumeGroupSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	gid, ok, err := s.groupArg(req.GetGroupSnapshotId())
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "group snapshot %q does not exist (not a group snapshot of this driver)", req.GetGroupSnapshotId())
	}
	if err := checkSnapshotIDs(req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	if nodes := s.groupNodes(gid.String()); nodes != nil {
		return s.getParts(ctx, gid.String(), nodes, req)
	}
	resp, err := s.locate(ctx, lookup{kind: groupKind, id: gid.String(), pool: gid.Pool, members: req.GetSnapshotIds(),
		call: s.callOn("GetVolumeGroupSnapshot", gid.String(), req),
		absent: func() (proto.Message, error) {
			return nil, status.Errorf(codes.NotFound, "group snapshot %s does not exist on any node", gid)
		},
	})
	if nodes, ok := asHolders(err); ok {
		return s.getParts(ctx, gid.String(), nodes, req)
	}
	// One node's part of a group across nodes (fewer snapshots than named): every
	// node holding the pool is asked, and the parts merged.
	if g, ok := resp.(*csi.GetVolumeGroupSnapshotResponse); err == nil && ok && isPart(g, req.GetSnapshotIds()) {
		if nodes, perr := s.partHolders(ctx, gid, req.GetSnapshotIds()); perr == nil && len(nodes) > 1 {
			return s.getParts(ctx, gid.String(), nodes, req)
		}
	}
	return as[*csi.GetVolumeGroupSnapshotResponse](resp, err)
}

// checkSnapshotIDs checks the member IDs a group call names: required, each a snapshot
// ID or at least nothing hostile (the node compares them with the group's members).
func checkSnapshotIDs(ids []string) error {
	if len(ids) == 0 {
		return status.Error(codes.InvalidArgument, "snapshot_ids is required")
	}
	if len(ids) > pool.MaxGroupMembers {
		return status.Errorf(codes.InvalidArgument, "snapshot_ids: %d snapshots, a group snapshot has at most %d", len(ids), pool.MaxGroupMembers)
	}
	for _, raw := range ids {
		if _, err := pool.ParseSnapshotID(raw); err != nil && (raw == "" || pool.HostileID(raw)) {
			return status.Errorf(codes.InvalidArgument, "snapshot_ids: %v", err)
		}
	}
	return nil
}

// as converts a node's answer to the method's response type.
func as[T proto.Message](resp proto.Message, err error) (T, error) {
	var zero T
	if err != nil {
		return zero, err
	}
	out, ok := resp.(T)
	if !ok {
		return zero, status.Errorf(codes.Internal, "the node answered a %T where a %T was due", resp, zero)
	}
	return out, nil
}
