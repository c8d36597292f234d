package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// csiContentSource is a volume's recorded source as the CO knows it: in the
// volume's own pool, so with that pool's share tag.
func (d controllerServer) csiContentSource(p *pool.Pool, r *pool.ContentSource) *csi.VolumeContentSource {
	switch {
	case r == nil:
		return nil
	case r.Snapshot != "":
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: d.pools.WireID(p, r.Snapshot)}}}
	default:
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: d.pools.WireID(p, r.Volume)}}}
	}
}

// resolveContentSource finds the snapshot or volume a CreateVolume copies:
// NOT_FOUND when it does not exist, INVALID_ARGUMENT when it is malformed.
func (d controllerServer) resolveContentSource(ctx context.Context, src *csi.VolumeContentSource, acc poolset.Access) (*layout.ContentSource, error) {
	if src == nil {
		return nil, nil
	}
	switch {
	case src.GetSnapshot() != nil:
		raw := src.GetSnapshot().GetSnapshotId()
		sid, known, err := parseSnapshotRef("volume_content_source.snapshot.snapshot_id", raw)
		if err != nil {
			return nil, err
		}
		if !known {
			return nil, csierr.Failf(pool.ErrNotFound, "source snapshot %q does not exist (not a poolcsi snapshot ID)", raw)
		}
		p, s, err := d.loadSnapshot(ctx, sid, &acc)
		if err != nil {
			return nil, err
		}
		return &layout.ContentSource{Pool: p, Record: pool.ContentSource{Snapshot: s.ID}, Layout: s.Layout, Access: s.AccessType, FSType: s.FSType, Size: s.SizeBytes, SnapID: sid}, nil
	case src.GetVolume() != nil:
		rq, err := d.resolve(ctx, rpcCloneSource, src.GetVolume().GetVolumeId(), acc, nil)
		if err != nil {
			return nil, err
		}
		vid, p, v := rq.id, rq.pool, rq.vol
		return &layout.ContentSource{Pool: p, Record: pool.ContentSource{Volume: v.ID}, Layout: v.Layout, Access: v.AccessType, FSType: v.FSType, Size: v.CapacityBytes, VolID: vid, Vol: v}, nil
	}
	return nil, status.Error(codes.InvalidArgument, "volume_content_source names neither a snapshot nor a volume")
}

// finishClone fills a volume still in state creating with its source's data and
// marks it ready. An image copy is grown to the volume's size; its filesystem
// grows at the next NodeStageVolume, like any volume expanded while unstaged.
func (d controllerServer) finishClone(ctx context.Context, p *pool.Pool, v *pool.Volume, src *layout.ContentSource) error {
	if !src.IsSnapshot() {
		// Copying a volume: hold it against concurrent grow, stage and delete.
		sv, release, err := d.holdVolume(ctx, holdCloneSource, p, src.VolID)
		if err != nil {
			return err
		}
		defer release()
		src.Vol = sv
	}
	return d.layoutOf(v.Layout).CloneFrom(ctx, p, v, src)
}
