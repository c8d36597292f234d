package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// A volume group snapshot is several volumes of one pool frozen together,
// copied, then thawed: one crash-consistent instant across, say, a database's
// data and WAL volumes. Its record (group.json, internal/pool/group.go) names
// its members, which are ordinary snapshots that carry the group's ID: each
// restores with CreateVolume like any other, and only the group deletes them.

func (d controllerServer) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: []*csi.GroupControllerServiceCapability{{
		Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{
			Type: csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,
		}},
	}}}, nil
}

// parseGroupRef is parseSnapshotRef for a group snapshot ID: one of another
// form names no group here (known=false) unless it is hostile.
func parseGroupRef(raw string) (id pool.GroupSnapshotID, known bool, err error) {
	if raw == "" {
		return id, false, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	id, perr := pool.ParseGroupSnapshotID(raw)
	if perr == nil {
		return id, true, nil
	}
	if pool.HostileID(raw) {
		return id, false, status.Errorf(codes.InvalidArgument, "group_snapshot_id: %v", perr)
	}
	return id, false, nil
}

func (d controllerServer) csiGroup(p *pool.Pool, g *pool.GroupSnapshot, members []*pool.Snapshot) *csi.VolumeGroupSnapshot {
	out := &csi.VolumeGroupSnapshot{
		GroupSnapshotId: d.pools.WireID(p, g.ID),
		CreationTime:    timestamppb.New(g.CreatedAt),
		ReadyToUse:      g.ReadyToUse,
	}
	for _, s := range members {
		out.Snapshots = append(out.Snapshots, d.csiSnapshot(p, s))
		out.ReadyToUse = out.ReadyToUse && s.ReadyToUse
	}
	return out
}

// groupMembers reads the member snapshots of a finished group; one missing is
// damage (only DeleteVolumeGroupSnapshot removes members, and the record last).
func groupMembers(p *pool.Pool, gid pool.GroupSnapshotID, g *pool.GroupSnapshot) ([]*pool.Snapshot, error) {
	if !g.ReadyToUse {
		return nil, csierr.Failf(pool.ErrNotReady, "group snapshot %s is still being cut", gid)
	}
	out := make([]*pool.Snapshot, 0, len(g.Members))
	for _, m := range g.Members {
		sid := p.Groups().MemberID(gid, m.SourceVolumeID)
		s, err := p.Snapshots().Load(sid)
		if errors.Is(err, pool.ErrNotFound) {
			return nil, csierr.Failf(csierr.ErrState, "group snapshot %s: its member %s (of volume %s) is missing; delete the group", gid, sid, m.SourceVolumeID)
		} else if err != nil {
			return nil, fmt.Errorf("group snapshot %s: %w", gid, err)
		}
		out = append(out, s)
	}
	return out, nil
}

// checkMemberIDs compares the snapshot IDs a call names with the group's
// members, as a set; a mismatch is INVALID_ARGUMENT (CSI).
//
// A part of a group across nodes (GroupSources) is checked against the
// members of the whole group: the call names them all, on every node.
func checkMemberIDs(p *pool.Pool, gid pool.GroupSnapshotID, g *pool.GroupSnapshot, given []string) error {
	if len(given) == 0 {
		return status.Error(codes.InvalidArgument, "snapshot_ids is required")
	}
	want := p.Groups().MemberIDs(gid, g)
	got := make([]string, 0, len(given))
	for _, raw := range given {
		sid, known, err := parseSnapshotRef("snapshot_ids", raw)
		if err != nil {
			return err
		}
		if !known {
			return status.Errorf(codes.InvalidArgument, "snapshot_ids: %q is not a member of group snapshot %s", raw, gid)
		}
		got = append(got, sid.String())
	}
	sort.Strings(want)
	sort.Strings(got)
	if !slices.Equal(want, slices.Compact(got)) || len(got) != len(want) {
		return status.Errorf(codes.InvalidArgument, "snapshot_ids %v do not match the members of group snapshot %s: %v", given, gid, want)
	}
	return nil
}

// checkGroupSnapshotParams is checkSnapshotParams, and lets deletionPolicy
// (Delete or Retain) through, ignored: it is a VolumeGroupSnapshotClass
// field, not a driver parameter, but the Kubernetes storage e2e suite's group
// snapshot class carries it among its parameters too, and a driver that
// refused it would fail every group snapshot that class asks for.
func checkGroupSnapshotParams(params map[string]string) error {
	rest := make(map[string]string, len(params))
	for k, v := range params {
		if k == "deletionPolicy" {
			if v != "Delete" && v != "Retain" {
				return status.Errorf(codes.InvalidArgument, "parameter deletionPolicy %q: want Delete or Retain (poolcsi ignores it: it is the class's field)", v)
			}
			continue
		}
		rest[k] = v
	}
	return checkSnapshotParams(rest)
}

// groupSource is one volume of a group snapshot being cut, locked.
type groupSource struct {
	id   pool.VolumeID
	vol  *pool.Volume
	need int64
}

// CreateVolumeGroupSnapshot snapshots the volumes together. A member that
// cannot be frozen and is written refuses the group before anything is
// reserved (checkOneInstant). Every member is reserved first (capacity,
// records), then every staged filesystem among them is frozen, then each is
// copied, then all are thawed: the freeze window covers all members before the
// first copy starts. A member that fails rolls the whole group back: no member
// and no record is left.
func (d controllerServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (_ *csi.CreateVolumeGroupSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	name := req.GetName()
	if err := params.CheckRequestName("group snapshot", name); err != nil {
		return nil, err
	}
	if err := checkGroupSnapshotParams(req.GetParameters()); err != nil {
		return nil, err
	}
	vids, p, err := d.groupSources(ctx, req.GetSourceVolumeIds(), req.GetSecrets())
	if err != nil {
		return nil, err
	}
	gid := p.Groups().NewID(name)
	for _, pn := range d.pools.Names() {
		if other := d.pools.Pool(pn); other != p {
			if g, err := other.Groups().Load(other.Groups().NewID(name)); err == nil && g.Name == name {
				return nil, csierr.Failf(pool.ErrExists, "group snapshot %q already exists in pool %s", name, pn)
			}
		}
	}
	release, err := d.hold(gid.String(), holdCreateGroup)
	if err != nil {
		return nil, err
	}
	defer release()
	sources := make([]string, len(vids))
	for i, vid := range vids {
		sources[i] = vid.String()
	}
	sort.Strings(sources)
	// A retry of a finished group answers from its records alone: its
	// volumes may be busy, or deleted since.
	if g, err := p.Groups().Load(gid); err == nil && g.Name == name {
		if !slices.Equal(g.Sources(), sources) {
			return nil, csierr.Failf(pool.ErrExists, "group snapshot %q already exists of volumes %s", name, strings.Join(g.Sources(), ", "))
		}
		if g.ReadyToUse {
			members, err := groupMembers(p, gid, g)
			if err != nil {
				return nil, err
			}
			return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: d.csiGroup(p, g, members)}, nil
		}
	}

	srcs, unlock, err := d.lockGroupSources(ctx, p, vids)
	if err != nil {
		return nil, err
	}
	defer unlock()
	// Under the volumes' locks: a stage cannot record a writer between this
	// check and the copies.
	if err := checkOneInstant(name, srcs); err != nil {
		return nil, err
	}
	g, err := p.Groups().Reserve(ctx, name, vids)
	if err != nil {
		return nil, err
	}
	if !g.ReadyToUse {
		if err := d.cutGroup(ctx, p, gid, g, srcs); err != nil {
			// Cleaned up even when the call's own context ended.
			if rerr := removeGroup(context.WithoutCancel(ctx), p, gid, g); rerr != nil {
				klog.FromContext(ctx).Error(rerr, "Rolling back a failed group snapshot failed; the next create or delete of it finishes the removal", "groupSnapshot", gid)
			}
			return nil, err
		}
	}
	members, err := groupMembers(p, gid, g)
	if err != nil {
		return nil, err
	}
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: d.csiGroup(p, g, members)}, nil
}

// groupSources checks a group's volume IDs, every one before any pool is
// touched: well-formed, each named once, all in one pool, whose pool it
// returns.
func (d controllerServer) groupSources(ctx context.Context, raws []string, secrets map[string]string) (vids []pool.VolumeID, p *pool.Pool, err error) {
	if len(raws) == 0 {
		return nil, nil, status.Error(codes.InvalidArgument, "source_volume_ids is required")
	}
	if len(raws) > pool.MaxGroupMembers {
		return nil, nil, status.Errorf(codes.InvalidArgument, "source_volume_ids: %d volumes, a group snapshot takes at most %d", len(raws), pool.MaxGroupMembers)
	}
	vids = make([]pool.VolumeID, len(raws))
	for i, raw := range raws {
		if raw == "" {
			return nil, nil, status.Error(codes.InvalidArgument, "volume_id is required")
		}
		if vids[i], err = pool.ParseVolumeID(raw); err != nil {
			return nil, nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	seen := map[string]bool{}
	for _, vid := range vids {
		if seen[vid.String()] {
			return nil, nil, status.Errorf(codes.InvalidArgument, "source_volume_ids: volume %s is named twice", vid)
		}
		seen[vid.String()] = true
		if vid.Pool != vids[0].Pool || vid.Share != vids[0].Share {
			return nil, nil, status.Errorf(codes.InvalidArgument, "source_volume_ids: volumes %s and %s are in different pools; a group snapshot takes volumes of one pool", vids[0], vid)
		}
	}
	for _, vid := range vids {
		// Each ID's own share tag is checked, not only the first's.
		if p, err = d.pools.Ensure(ctx, poolset.VolumeRef(vid), poolset.Access{Secrets: secrets}); err != nil {
			return nil, nil, err
		}
	}
	return vids, p, nil
}

// lockGroupSources takes the in-process lock and the pool lock of every
// volume, in the order of their IDs: two groups that share volumes cannot
// deadlock, and a single snapshot takes only one of them. It measures each
// volume's data, which must be there.
func (d controllerServer) lockGroupSources(ctx context.Context, p *pool.Pool, vids []pool.VolumeID) (_ []groupSource, unlock func(), err error) {
	sorted := slices.Clone(vids)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].String() < sorted[j].String() })
	var releases []func()
	releaseAll := func() {
		for i := len(releases) - 1; i >= 0; i-- {
			releases[i]()
		}
	}
	defer func() {
		if err != nil {
			releaseAll()
		}
	}()
	srcs := make([]groupSource, 0, len(sorted))
	for _, vid := range sorted {
		v, release, err := d.holdVolume(ctx, holdCreateGroup, p, vid)
		if err != nil {
			return nil, nil, err
		}
		releases = append(releases, release)
		need, err := p.Snapshots().SourceAllocated(vid, v)
		switch {
		case errors.Is(err, pool.ErrNotFound):
			return nil, nil, csierr.Failf(pool.ErrNotFound, "volume %s: its data is missing: %w", vid, err)
		case err != nil:
			return nil, nil, fmt.Errorf("volume %s: measure its data: %w", vid, err)
		}
		srcs = append(srcs, groupSource{id: vid, vol: v, need: need})
	}
	return srcs, releaseAll, nil
}

// checkOneInstant refuses a group with a member that is written while the
// members are copied one after another: one that cannot be frozen (freezable)
// and is staged read-write anywhere. Its copy would be of another instant than
// the others', and a database restored from the group (data and WAL of
// different moments) would be silently corrupt; CSI asks a group that cannot
// be write-order consistent to be refused. A member staged only read-only, or
// not at all, has no writer poolcsi hands it to.
func checkOneInstant(name string, srcs []groupSource) error {
	var written []string
	for _, src := range srcs {
		if freeze.Freezable(src.vol) {
			continue
		}
		var nodes []string
		for _, st := range src.vol.Staged {
			if !st.ReadOnly {
				nodes = append(nodes, st.Node)
			}
		}
		if len(nodes) == 0 {
			continue
		}
		why := "a block volume, which holds no filesystem poolcsi can freeze"
		if src.vol.Layout == pool.LayoutDir {
			why = "a dir volume, a directory of the pool, which cannot be frozen"
		}
		sort.Strings(nodes)
		on := "node"
		if len(nodes) > 1 {
			on = "nodes"
		}
		written = append(written, fmt.Sprintf("volume %s is %s, and is staged read-write on %s %s", src.id, why, on, strings.Join(nodes, ", ")))
	}
	if len(written) == 0 {
		return nil
	}
	return csierr.Failf(csierr.ErrInUse, "group snapshot %q would not be one instant (its members are copied one after another): %s; stop its writers (unstage it, e.g. scale its workload down) and retry, or snapshot it on its own with CreateSnapshot",
		name, strings.Join(written, "; "))
}

// cutGroup reserves, freezes, copies and thaws. A record a crash left
// unfinished may have members of another instant: they are removed first.
func (d controllerServer) cutGroup(ctx context.Context, p *pool.Pool, gid pool.GroupSnapshotID, g *pool.GroupSnapshot, srcs []groupSource) error {
	if err := removeMembers(ctx, p, gid, g); err != nil {
		return fmt.Errorf("group snapshot %s: remove a member an interrupted attempt left: %w", gid, err)
	}
	snaps := make([]*pool.Snapshot, len(srcs))
	for i, src := range srcs {
		s, err := p.Groups().ReserveMember(ctx, gid, g, src.vol, src.need)
		if err != nil {
			return fmt.Errorf("group snapshot %s: volume %s: %w", gid, src.id, err)
		}
		snaps[i] = s
	}
	if err := d.copyFrozen(ctx, p, srcs, snaps); err != nil {
		return fmt.Errorf("group snapshot %s: %w", gid, err)
	}
	if err := p.Groups().MarkReady(gid, g); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Created group snapshot", "groupSnapshot", gid, "name", g.Name, "members", len(snaps))
	return nil
}

// copyFrozen freezes every source on whichever node has it staged
// (freeze.Freezer.QuiesceAll: the single snapshot's freeze, here or through the node's freeze
// inbox), copies each, and thaws them all, also when a copy fails. A node
// that thawed before the last copy ended fails the group (ABORTED, retried):
// its member would not be of the same instant.
func (d controllerServer) copyFrozen(ctx context.Context, p *pool.Pool, srcs []groupSource, snaps []*pool.Snapshot) (err error) {
	members := make([]freeze.Member, len(srcs))
	for i, src := range srcs {
		members[i] = freeze.Member{Pool: p, ID: src.id, Vol: src.vol}
	}
	thaw, err := d.freezes.QuiesceAll(ctx, members)
	if err != nil {
		return err
	}
	defer func() {
		if terr := thaw(); terr != nil && err == nil {
			err = terr
		}
	}()
	for i, src := range srcs {
		if err := d.fill(ctx, p, snaps[i], src.vol); err != nil {
			return fmt.Errorf("volume %s: %w", src.id, err)
		}
	}
	return nil
}

// removeGroup removes the members and then the record, so that a retry after
// a crash still finds the record and finishes.
func removeGroup(ctx context.Context, p *pool.Pool, gid pool.GroupSnapshotID, g *pool.GroupSnapshot) error {
	if err := removeMembers(ctx, p, gid, g); err != nil {
		return err
	}
	return p.Groups().Delete(ctx, gid)
}

// removeMembers deletes the group's member snapshots that exist.
func removeMembers(ctx context.Context, p *pool.Pool, gid pool.GroupSnapshotID, g *pool.GroupSnapshot) error {
	for _, m := range g.Members {
		sid := p.Groups().MemberID(gid, m.SourceVolumeID)
		if !p.Snapshots().Exists(sid) {
			continue
		}
		if err := p.Snapshots().Delete(ctx, sid); err != nil {
			return err
		}
	}
	return nil
}

// DeleteVolumeGroupSnapshot removes a group and its members; an unknown or
// already deleted group is success. The snapshot IDs the call names must be
// the group's members.
func (d controllerServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (_ *csi.DeleteVolumeGroupSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	gid, known, err := parseGroupRef(req.GetGroupSnapshotId())
	if err != nil {
		return nil, err
	}
	if !known {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
	}
	p, err := d.pools.Ensure(ctx, poolset.SnapshotRef(gid.SnapshotID), poolset.Access{Secrets: req.GetSecrets()})
	if errors.Is(err, csierr.ErrNoPool) {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
	} else if err != nil {
		return nil, err
	}
	release, err := d.hold(gid.String(), holdDeleteGroup)
	if err != nil {
		return nil, err
	}
	defer release()
	g, err := p.Groups().Load(gid)
	if errors.Is(err, pool.ErrNotFound) {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
	} else if err != nil {
		return nil, err
	}
	if err := checkMemberIDs(p, gid, g, req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	if err := removeGroup(ctx, p, gid, g); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Deleted group snapshot", "groupSnapshot", gid, "members", len(g.Members))
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}

func (d controllerServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (_ *csi.GetVolumeGroupSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	gid, known, err := parseGroupRef(req.GetGroupSnapshotId())
	if err != nil {
		return nil, err
	}
	if !known {
		return nil, csierr.Failf(pool.ErrNotFound, "group snapshot %q does not exist (not a poolcsi group snapshot ID)", req.GetGroupSnapshotId())
	}
	p, err := d.pools.Lookup(ctx, poolset.SnapshotRef(gid.SnapshotID))
	if err != nil {
		return nil, err
	}
	g, err := p.Groups().Load(gid)
	if errors.Is(err, pool.ErrNotFound) {
		return nil, csierr.Failf(pool.ErrNotFound, "group snapshot %s does not exist", gid)
	} else if err != nil {
		return nil, err
	}
	if err := checkMemberIDs(p, gid, g, req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	members, err := groupMembers(p, gid, g)
	if err != nil {
		return nil, err
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: d.csiGroup(p, g, members)}, nil
}

// liveGroupOf tells the group snapshot that still holds s, if any: a member
// is deleted only with its group (CSI: DeleteSnapshot of a snapshot that has
// a group_snapshot_id). A member whose group record is gone is left over by
// an interrupted group delete, and deletes like any snapshot.
func liveGroupOf(p *pool.Pool, s *pool.Snapshot) (string, error) {
	if s.GroupSnapshotID == "" {
		return "", nil
	}
	gid, err := pool.ParseGroupSnapshotID(s.GroupSnapshotID)
	if err != nil {
		return "", err
	}
	if _, err := p.Groups().Load(gid); errors.Is(err, pool.ErrNotFound) {
		return "", nil
	} else if err != nil {
		return "", err
	}
	return gid.String(), nil
}
