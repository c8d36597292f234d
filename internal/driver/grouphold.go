package driver

import (
	"context"
	"slices"
	"sort"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// A group snapshot whose members sit on several nodes (docs/design/central-controller.md
// §7.1) is this node's part of two phases central runs: FreezeGroupHold freezes and
// holds this node's members (internal/freeze, grouphold.go), SnapshotHeld copies them
// under that hold and records this node's part of the group under the group's ID,
// ThawGroup lets a hold go. They are served on the node's socket as the GroupHold
// service (nodecall.GroupHoldService), for the agent, which replays central's
// PoolCalls there. Every argument is checked again here: the group ID must be the
// one its name makes in the members' pool, a local pool this node serves, and the
// node acts only on volumes it finds in it itself.

// maxGroupHoldBound is the longest hold central may ask for; the node caps it
// further (--freeze-max-hold, each volume's budget).
const maxGroupHoldBound = 10 * time.Minute

// groupHoldServer is the GroupHold service.
type groupHoldServer interface {
	FreezeGroupHold(context.Context, *structpb.Struct) (*structpb.Struct, error)
	SnapshotHeld(context.Context, *structpb.Struct) (*csi.CreateVolumeGroupSnapshotResponse, error)
	ThawGroup(context.Context, *structpb.Struct) (*structpb.Struct, error)
}

// groupHoldDesc is the GroupHold service's description, written out: its messages
// are Structs, so it has no generated code.
var groupHoldDesc = grpc.ServiceDesc{
	ServiceName: nodecall.GroupHoldService,
	HandlerType: (*groupHoldServer)(nil),
	Methods: []grpc.MethodDesc{
		{MethodName: nodecall.MethodFreezeGroupHold, Handler: groupHoldHandler(nodecall.MethodFreezeGroupHold, groupHoldServer.FreezeGroupHold)},
		{MethodName: nodecall.MethodSnapshotHeld, Handler: groupHoldHandler(nodecall.MethodSnapshotHeld, groupHoldServer.SnapshotHeld)},
		{MethodName: nodecall.MethodThawGroup, Handler: groupHoldHandler(nodecall.MethodThawGroup, groupHoldServer.ThawGroup)},
	},
	Metadata: "poolcsi/grouphold",
}

func groupHoldHandler[Resp any](name string, f func(groupHoldServer, context.Context, *structpb.Struct) (Resp, error)) func(any, context.Context, func(any) error, grpc.UnaryServerInterceptor) (any, error) {
	return func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
		in := new(structpb.Struct)
		if err := dec(in); err != nil {
			return nil, err
		}
		h := func(ctx context.Context, req any) (any, error) {
			return f(srv.(groupHoldServer), ctx, req.(*structpb.Struct))
		}
		if ic == nil {
			return h(ctx, in)
		}
		return ic(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: nodecall.GroupHoldFullMethod(name)}, h)
	}
}

var _ groupHoldServer = controllerServer{}

// decodeHold reads a GroupHold request.
func decodeHold(in *structpb.Struct, v any) error {
	if err := nodecall.FromStruct(in, v); err != nil {
		return status.Errorf(codes.InvalidArgument, "not a group hold request: %v", err)
	}
	return nil
}

// groupPart checks a group call's group ID, name and this node's members: the
// members as CreateVolumeGroupSnapshot checks its sources, in a local pool, and the
// group ID the one the name makes there.
func (d controllerServer) groupPart(ctx context.Context, group, name string, members []string) (pool.GroupSnapshotID, []pool.VolumeID, *pool.Pool, error) {
	var gid pool.GroupSnapshotID
	if err := params.CheckRequestName("group snapshot", name); err != nil {
		return gid, nil, nil, err
	}
	vids, p, err := d.groupSources(ctx, members, nil)
	if err != nil {
		return gid, nil, nil, err
	}
	if p.Shared() {
		return gid, nil, nil, status.Errorf(codes.InvalidArgument, "pool %s is shared: a group hold across nodes is for local pools", p.Name())
	}
	if gid = p.Groups().NewID(name); gid.String() != group {
		return gid, nil, nil, status.Errorf(codes.InvalidArgument, "group %q is not the ID of group snapshot %q in pool %s (%s)", group, name, p.Name(), gid)
	}
	return gid, vids, p, nil
}

// FreezeGroupHold freezes and holds this node's members of a group.
func (d controllerServer) FreezeGroupHold(ctx context.Context, in *structpb.Struct) (_ *structpb.Struct, err error) {
	defer csierr.ToStatus(&err)
	var r nodecall.FreezeGroupHold
	if err := decodeHold(in, &r); err != nil {
		return nil, err
	}
	bound := time.Duration(r.BoundMillis) * time.Millisecond
	if r.BoundMillis <= 0 || bound > maxGroupHoldBound {
		return nil, status.Errorf(codes.InvalidArgument, "boundMillis %d: a group hold lasts more than 0 and at most %s", r.BoundMillis, maxGroupHoldBound)
	}
	gid, vids, p, err := d.groupPart(ctx, r.Group, r.Name, r.Members)
	if err != nil {
		return nil, err
	}
	// This node's part recorded already (a retried create): nothing is frozen again,
	// the copy answers the part.
	sources := make([]string, len(vids))
	members := make([]freeze.GroupMember, len(vids))
	for i, vid := range vids {
		sources[i] = vid.String()
		members[i] = freeze.GroupMember{Pool: p, ID: vid}
	}
	sort.Strings(sources)
	if g, err := p.Groups().Load(gid); err == nil && g.ReadyToUse && g.Name == r.Name && slices.Equal(g.Sources(), sources) {
		return nodecall.ToStruct(nodecall.GroupHeld{Nonce: nodecall.RecordedHold})
	}
	h, err := d.freezes.HoldGroup(ctx, gid.String(), members, bound)
	if err != nil {
		return nil, err
	}
	return nodecall.ToStruct(nodecall.GroupHeld{Nonce: h.Nonce, HoldMillis: h.Bound.Milliseconds()})
}

// ThawGroup lets a group's hold go; a hold already gone is success.
func (d controllerServer) ThawGroup(ctx context.Context, in *structpb.Struct) (_ *structpb.Struct, err error) {
	defer csierr.ToStatus(&err)
	var r nodecall.ThawGroup
	if err := decodeHold(in, &r); err != nil {
		return nil, err
	}
	gid, err := pool.ParseGroupSnapshotID(r.Group)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "group: %v", err)
	}
	d.freezes.ThawGroup(ctx, gid.String(), r.Nonce)
	return &structpb.Struct{}, nil
}

// SnapshotHeld copies this node's members under the group's hold, records this
// node's part of the group, lets the hold go and answers the part. A part recorded
// already is answered again; a hold not in force is ABORTED, and what was copied
// under it is removed.
func (d controllerServer) SnapshotHeld(ctx context.Context, in *structpb.Struct) (_ *csi.CreateVolumeGroupSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	var r nodecall.SnapshotHeld
	if err := decodeHold(in, &r); err != nil {
		return nil, err
	}
	gid, vids, p, err := d.groupPart(ctx, r.Group, r.Name, r.Members)
	if err != nil {
		return nil, err
	}
	all, err := groupAll(p, r.All, vids)
	if err != nil {
		return nil, err
	}
	release, err := d.hold(gid.String(), holdCreateGroup)
	if err != nil {
		return nil, err
	}
	defer release()
	// The hold goes whatever happens below: a copy is made under it once.
	defer d.freezes.ThawGroup(context.WithoutCancel(ctx), gid.String(), r.Nonce)
	sources := make([]string, len(vids))
	for i, vid := range vids {
		sources[i] = vid.String()
	}
	sort.Strings(sources)
	g, lerr := p.Groups().Load(gid)
	mine := lerr == nil && g.Name == r.Name && slices.Equal(g.Sources(), sources) && slices.Equal(g.GroupSources, all)
	if mine && g.ReadyToUse {
		members, err := groupMembers(p, gid, g)
		if err != nil {
			return nil, err
		}
		return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: d.csiGroup(p, g, members)}, nil
	}
	rollback := func() {
		if g == nil || !mine {
			return
		}
		if rerr := removeGroup(context.WithoutCancel(ctx), p, gid, g); rerr != nil {
			klog.FromContext(ctx).Error(rerr, "Removing a group part copied outside its hold failed; the next create or delete of it finishes the removal", "groupSnapshot", gid)
		}
	}
	if err := d.freezes.GroupHeld(gid.String(), r.Nonce, sources); err != nil {
		rollback()
		return nil, err
	}
	srcs, unlock, err := d.lockHeldSources(ctx, p, vids)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if g, err = p.Groups().ReservePart(ctx, r.Name, vids, all); err != nil {
		return nil, err
	}
	mine = true
	if err := d.cutHeld(ctx, p, gid, g, srcs, r.Nonce, sources); err != nil {
		rollback()
		return nil, err
	}
	members, err := groupMembers(p, gid, g)
	if err != nil {
		return nil, err
	}
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: d.csiGroup(p, g, members)}, nil
}

// groupAll checks the whole group's volumes: at most MaxGroupMembers, each once, of
// p, holding this node's members; sorted.
func groupAll(p *pool.Pool, raws []string, mine []pool.VolumeID) ([]string, error) {
	if len(raws) > pool.MaxGroupMembers {
		return nil, status.Errorf(codes.InvalidArgument, "all: %d volumes, a group snapshot takes at most %d", len(raws), pool.MaxGroupMembers)
	}
	all := make([]string, 0, len(raws))
	for _, raw := range raws {
		vid, err := pool.ParseVolumeID(raw)
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "all: %v", err)
		}
		if vid.Pool != p.Name() || vid.Share != "" {
			return nil, status.Errorf(codes.InvalidArgument, "all: volume %s is not in pool %s", vid, p.Name())
		}
		all = append(all, vid.String())
	}
	sort.Strings(all)
	if len(slices.Compact(slices.Clone(all))) != len(all) {
		return nil, status.Error(codes.InvalidArgument, "all: a volume is named twice")
	}
	for _, vid := range mine {
		if _, ok := slices.BinarySearch(all, vid.String()); !ok {
			return nil, status.Errorf(codes.InvalidArgument, "all: this node's volume %s is not among the group's", vid)
		}
	}
	return all, nil
}

// lockHeldSources is lockGroupSources under a group's hold, which holds the
// volumes' in-process locks already: it takes their cross-process locks and
// measures each volume's data.
func (d controllerServer) lockHeldSources(ctx context.Context, p *pool.Pool, vids []pool.VolumeID) (_ []groupSource, unlock func(), err error) {
	sorted := slices.Clone(vids)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].String() < sorted[j].String() })
	var unlocks []func()
	unlockAll := func() {
		for i := len(unlocks) - 1; i >= 0; i-- {
			unlocks[i]()
		}
	}
	defer func() {
		if err != nil {
			unlockAll()
		}
	}()
	srcs := make([]groupSource, 0, len(sorted))
	for _, vid := range sorted {
		u, err := p.LockVolume(ctx, vid)
		if err != nil {
			return nil, nil, err
		}
		unlocks = append(unlocks, u)
		v, err := loadVolume(p, vid)
		if err != nil {
			return nil, nil, err
		}
		need, err := p.Snapshots().SourceAllocated(vid, v)
		if err != nil {
			return nil, nil, err
		}
		srcs = append(srcs, groupSource{id: vid, vol: v, need: need})
	}
	return srcs, unlockAll, nil
}

// cutHeld is cutGroup under a hold: the members are frozen already; the hold must
// still be in force once the last copy ended, or the copies may not be of the
// group's instant.
func (d controllerServer) cutHeld(ctx context.Context, p *pool.Pool, gid pool.GroupSnapshotID, g *pool.GroupSnapshot, srcs []groupSource, nonce string, sources []string) error {
	if err := removeMembers(ctx, p, gid, g); err != nil {
		return err
	}
	for _, src := range srcs {
		s, err := p.Groups().ReserveMember(ctx, gid, g, src.vol, src.need)
		if err != nil {
			return err
		}
		if err := d.fill(ctx, p, s, src.vol); err != nil {
			return err
		}
	}
	if err := d.freezes.GroupHeld(gid.String(), nonce, sources); err != nil {
		return err
	}
	if err := p.Groups().MarkReady(gid, g); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Created this node's part of a group snapshot across nodes", "groupSnapshot", gid, "name", g.Name, "members", len(srcs), "of", len(g.GroupSources))
	return nil
}
