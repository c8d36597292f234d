package driver

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// snapshotCaps are the controller capabilities of snapshots and clones.
var snapshotCaps = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
}

// parseSnapshotRef validates a snapshot ID from the wire. A well-formed ID is
// returned with known=true. An ID of another form cannot name a poolcsi snapshot:
// the CSI spec wants it treated as not found (known=false), unless it is hostile
// (path characters, control characters, over-long), which is INVALID_ARGUMENT.
func parseSnapshotRef(field, raw string) (id pool.SnapshotID, known bool, err error) {
	if raw == "" {
		return id, false, status.Errorf(codes.InvalidArgument, "%s is required", field)
	}
	id, perr := pool.ParseSnapshotID(raw)
	if perr == nil {
		return id, true, nil
	}
	if pool.HostileID(raw) {
		return id, false, status.Errorf(codes.InvalidArgument, "%s: %v", field, perr)
	}
	return id, false, nil
}

// csiSnapshot is a snapshot as the CO knows it: its ID and its source's (in
// the same pool) with the pool's share tag, and a member's group's.
func (d controllerServer) csiSnapshot(p *pool.Pool, s *pool.Snapshot) *csi.Snapshot {
	out := &csi.Snapshot{
		SnapshotId:     d.pools.WireID(p, s.ID),
		SourceVolumeId: d.pools.WireID(p, s.SourceVolumeID),
		SizeBytes:      s.SizeBytes,
		CreationTime:   timestamppb.New(s.CreatedAt),
		ReadyToUse:     s.ReadyToUse,
	}
	if s.GroupSnapshotID != "" {
		out.GroupSnapshotId = d.pools.WireID(p, s.GroupSnapshotID)
	}
	return out
}

// checkSnapshotParams accepts only the csi.storage.k8s.io/* keys the snapshotter
// adds: poolcsi has no VolumeSnapshotClass parameters, and a typo must not pass.
func checkSnapshotParams(in map[string]string) error {
	for k := range in {
		if !strings.HasPrefix(k, params.K8sPrefix) {
			return status.Errorf(codes.InvalidArgument, "unknown snapshot parameter %q (poolcsi takes none)", k)
		}
	}
	return nil
}

// CreateSnapshot copies a volume's data into <pool>/snapshots/<key>/: a reflink
// where the pool's filesystem has them, a sparse copy otherwise. The snapshot is
// as consistent as a crash at that instant (crash-consistent); an image volume's
// filesystem is frozen around the copy on whichever node has it staged
// (internal/freeze), which makes it a clean filesystem image.
func (d controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (_ *csi.CreateSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	name := req.GetName()
	if err := params.CheckRequestName("snapshot", name); err != nil {
		return nil, err
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "source_volume_id is required")
	}
	if err := checkSnapshotParams(req.GetParameters()); err != nil {
		return nil, err
	}
	src, err := d.resolve(ctx, rpcCreateSnapshotSource, req.GetSourceVolumeId(), poolset.Access{Secrets: req.GetSecrets()}, nil)
	if err != nil {
		return nil, err
	}
	vid, p := src.id, src.pool
	sid := p.Snapshots().NewID(name)
	for _, pn := range d.pools.Names() {
		if other := d.pools.Pool(pn); other != p {
			if other.Snapshots().Exists(other.Snapshots().NewID(name)) {
				return nil, csierr.Failf(pool.ErrExists, "snapshot %q already exists in pool %s", name, pn)
			}
		}
	}
	release, err := d.hold(sid.String(), holdCreateSnapshot)
	if err != nil {
		return nil, err
	}
	defer release()
	// A retry of a finished snapshot answers from snapshot.json alone: its
	// source may be busy, or deleted since.
	if s, err := p.Snapshots().Load(sid); err == nil && s.Name == name {
		if s.SourceVolumeID != vid.String() {
			return nil, csierr.Failf(pool.ErrExists, "snapshot %q already exists of volume %s", name, s.SourceVolumeID)
		}
		if s.GroupSnapshotID != "" {
			return nil, csierr.Failf(pool.ErrExists, "snapshot %q already exists, a member of group snapshot %s", name, s.GroupSnapshotID)
		}
		if s.ReadyToUse {
			return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(p, s)}, nil
		}
	}

	v, releaseSrc, err := d.holdVolume(ctx, holdCreateSnapshot, p, vid)
	if err != nil {
		return nil, err
	}
	defer releaseSrc()
	need, err := p.Snapshots().SourceAllocated(vid, v)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return nil, csierr.Failf(pool.ErrNotFound, "volume %s: its data is missing: %w", vid, err)
	case err != nil:
		// An I/O error or a pool gone is not a missing volume: its own code.
		return nil, fmt.Errorf("volume %s: measure its data: %w", vid, err)
	}
	s, err := p.Snapshots().Reserve(ctx, name, v, need)
	if err != nil {
		return nil, err
	}
	if !s.ReadyToUse {
		if err := d.copySnapshot(ctx, p, vid, v, sid, s); err != nil {
			return nil, err
		}
	}
	return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(p, s)}, nil
}

// copySnapshot fills a reserved snapshot with the source's data and marks it
// ready; an image volume's filesystem is frozen around its copy on whichever
// node has it staged (internal/freeze).
func (d controllerServer) copySnapshot(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, sid pool.SnapshotID, s *pool.Snapshot) error {
	quiesce := func() (func() error, error) { return d.quiesceCopy(ctx, p, vid, v) }
	if err := p.Snapshots().Fill(ctx, s, v, quiesce); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Created snapshot", "snapshot", sid, "name", s.Name, "source", vid, "size", s.SizeBytes, "allocated", s.AllocatedBytes, "copy", s.CopyMethod)
	return nil
}

// DeleteSnapshot is idempotent: an unknown or already deleted snapshot is success.
// Volumes made from a snapshot are independent copies, so nothing refuses it,
// except that a member of a group snapshot that still exists is deleted only
// with its group: INVALID_ARGUMENT, as CSI says (the snapshotter never asks).
func (d controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (_ *csi.DeleteSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	sid, known, err := parseSnapshotRef("snapshot_id", req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	if !known {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	p, err := d.pools.Ensure(ctx, poolset.SnapshotRef(sid), poolset.Access{Secrets: req.GetSecrets()})
	if errors.Is(err, csierr.ErrNoPool) {
		return &csi.DeleteSnapshotResponse{}, nil // no such pool, or a share without one
	} else if err != nil {
		return nil, err
	}
	release, err := d.hold(sid.String(), holdDeleteSnapshot)
	if err != nil {
		return nil, err
	}
	defer release()
	if s, err := p.Snapshots().Load(sid); err == nil {
		group, err := liveGroupOf(p, s)
		if err != nil {
			return nil, fmt.Errorf("snapshot %s: its group snapshot: %w", sid, err)
		}
		if group != "" {
			return nil, csierr.Failf(csierr.ErrInvalid, "snapshot %s is a member of group snapshot %s; delete the group (DeleteVolumeGroupSnapshot), which deletes its members", sid, group)
		}
	}
	if err := p.Snapshots().Delete(ctx, sid); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Deleted snapshot", "snapshot", sid)
	return &csi.DeleteSnapshotResponse{}, nil
}

// loadSnapshot reads a ready snapshot, or NOT_FOUND; acc, where not nil,
// lets the call mount the snapshot's share (poolset.Ensure).
func (d controllerServer) loadSnapshot(ctx context.Context, sid pool.SnapshotID, acc *poolset.Access) (*pool.Pool, *pool.Snapshot, error) {
	var p *pool.Pool
	var err error
	if acc != nil {
		p, err = d.pools.Ensure(ctx, poolset.SnapshotRef(sid), *acc)
	} else {
		p, err = d.pools.Lookup(ctx, poolset.SnapshotRef(sid))
	}
	if err != nil {
		return nil, nil, err
	}
	s, err := p.Snapshots().Load(sid)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return nil, nil, csierr.Failf(pool.ErrNotFound, "snapshot %s does not exist", sid)
	case err != nil:
		return nil, nil, fmt.Errorf("snapshot %s: %w", sid, err)
	case !s.ReadyToUse:
		return nil, nil, csierr.Failf(pool.ErrNotReady, "snapshot %s is still being cut", sid)
	}
	return p, s, nil
}

func (d controllerServer) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (_ *csi.GetSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	sid, known, err := parseSnapshotRef("snapshot_id", req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	if !known {
		return nil, csierr.Failf(pool.ErrNotFound, "snapshot %q does not exist (not a poolcsi snapshot ID)", req.GetSnapshotId())
	}
	p, s, err := d.loadSnapshot(ctx, sid, nil)
	if err != nil {
		return nil, err
	}
	return &csi.GetSnapshotResponse{Snapshot: d.csiSnapshot(p, s)}, nil
}

// ListSnapshots pages by snapshot ID, like ListVolumes: the token is the ID of the
// first snapshot of the next page.
func (d controllerServer) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (_ *csi.ListSnapshotsResponse, err error) {
	defer csierr.ToStatus(&err)
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max_entries must not be negative")
	}
	var start pool.SnapshotID
	if token := req.GetStartingToken(); token != "" {
		id, err := pool.ParseSnapshotID(token)
		if err != nil {
			return nil, status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token)
		}
		start = id
	}
	if raw := req.GetSnapshotId(); raw != "" {
		sid, known, err := parseSnapshotRef("snapshot_id", raw)
		if err != nil || !known {
			return &csi.ListSnapshotsResponse{}, err
		}
		p, s, err := d.loadSnapshot(ctx, sid, nil)
		if err != nil || (req.GetSourceVolumeId() != "" && s.SourceVolumeID != volumeIdentity(req.GetSourceVolumeId())) {
			return &csi.ListSnapshotsResponse{}, nil
		}
		return &csi.ListSnapshotsResponse{Entries: []*csi.ListSnapshotsResponse_Entry{{Snapshot: d.csiSnapshot(p, s)}}}, nil
	}
	source := req.GetSourceVolumeId()
	if source != "" && pool.HostileID(source) {
		return nil, status.Errorf(codes.InvalidArgument, "source_volume_id %q is not a poolcsi volume ID", source)
	}
	source = volumeIdentity(source)
	// Paged like ListVolumes, reading only the page's snapshot.json files.
	all, next, err := walkPools(d.core, start.Pool, start.Key, int(req.GetMaxEntries()), func(p *pool.Pool, from string, limit int) ([]*pool.Snapshot, string, error) {
		page, next, err := p.Snapshots().ListPage(from, limit, func(e pool.SnapshotEntry) bool {
			if e.Err != nil {
				klog.FromContext(ctx).Error(e.Err, "Snapshot metadata unreadable", "snapshot", e.ID)
				return false
			}
			return e.Snapshot.ReadyToUse && (source == "" || e.Snapshot.SourceVolumeID == source)
		})
		out := make([]*pool.Snapshot, len(page))
		for i, e := range page {
			out[i] = e.Snapshot
		}
		if next != "" {
			next = p.Snapshots().IDOf(next).String()
		}
		return out, next, err
	}, func(s *pool.Snapshot) string { return s.ID })
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, s := range all {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: d.csiSnapshot(d.pools.Pool(s.Pool), s)})
	}
	return resp, nil
}
