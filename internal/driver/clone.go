package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// contentSource is a resolved volume_content_source: a ready snapshot or a ready
// volume, and what a volume made from it must match.
type contentSource struct {
	pool   *pool.Pool
	record pool.ContentSource
	layout pool.Layout
	access pool.AccessType
	fsType string
	size   int64 // the smallest volume it fits in
	// snapshot or volume, whichever it is
	snapID pool.SnapshotID
	volID  pool.VolumeID
	vol    *pool.Volume
}

func (c *contentSource) isSnapshot() bool { return c.record.Snapshot != "" }

// csiContentSource is a volume's recorded source as the CO knows it: in the
// volume's own pool, so with that pool's share tag.
func (d *Driver) csiContentSource(p *pool.Pool, r *pool.ContentSource) *csi.VolumeContentSource {
	switch {
	case r == nil:
		return nil
	case r.Snapshot != "":
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: d.wireSnapshotID(p, r.Snapshot)}}}
	default:
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: d.wireVolumeID(p, r.Volume)}}}
	}
}

// resolveContentSource finds the snapshot or volume a CreateVolume copies:
// NOT_FOUND when it does not exist, INVALID_ARGUMENT when it is malformed.
func (d *Driver) resolveContentSource(ctx context.Context, src *csi.VolumeContentSource, acc shareAccess) (*contentSource, error) {
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
		p, s, err := d.loadSnapshot(ctx, sid, acc)
		if err != nil {
			return nil, err
		}
		return &contentSource{pool: p, record: pool.ContentSource{Snapshot: s.ID}, layout: s.Layout, access: s.AccessType, fsType: s.FSType, size: s.SizeBytes, snapID: sid}, nil
	case src.GetVolume() != nil:
		rq, err := d.resolve(ctx, rpcCloneSource, src.GetVolume().GetVolumeId(), acc, nil)
		if err != nil {
			return nil, err
		}
		vid, p, v := rq.id, rq.pool, rq.vol
		return &contentSource{pool: p, record: pool.ContentSource{Volume: v.ID}, layout: v.Layout, access: v.AccessType, fsType: v.FSType, size: v.CapacityBytes, volID: vid, vol: v}, nil
	}
	return nil, status.Error(codes.InvalidArgument, "volume_content_source names neither a snapshot nor a volume")
}

// sourceParams defaults the pool and layout of a volume made from src to src's:
// a copy stays in its source's pool, and a StorageClass need not repeat them.
func sourceParams(scParams map[string]string, src *contentSource) map[string]string {
	if src == nil {
		return scParams
	}
	out := map[string]string{ParamPool: src.pool.Name(), ParamLayout: string(src.layout)}
	if r := src.pool.Config().Share; r != nil {
		// A copy stays on its source's share: named by the share, as a
		// StorageClass names it, unless the parameters name it themselves.
		delete(out, ParamPool)
		if !params.NamesShare(scParams) {
			out[ParamShareType], out[ParamShareSource] = r.Type, r.Source
		}
	}
	for k, v := range scParams {
		out[k] = v
	}
	return out
}

// check refuses a copy the source cannot give: another pool, another
// layout, access type or filesystem (INVALID_ARGUMENT).
func (c *contentSource) check(p *pool.Pool, layout pool.Layout, lay layout, caps params.Caps) error {
	what := "volume " + c.record.Volume
	if c.isSnapshot() {
		what = "snapshot " + c.record.Snapshot
	}
	switch {
	case p != c.pool:
		return status.Errorf(codes.InvalidArgument, "%s is in pool %s; a copy is made in its source's pool, not %s", what, c.pool.Name(), p.Name())
	case layout != c.layout:
		return status.Errorf(codes.InvalidArgument, "%s has layout %s, the request asks for layout %s", what, c.layout, layout)
	case caps.Access != c.access:
		return status.Errorf(codes.InvalidArgument, "%s has %s access, the request asks for %s", what, c.access, caps.Access)
	case !lay.sameFS(caps, c.fsType):
		return status.Errorf(codes.InvalidArgument, "%s holds %s, the request asks for %s", what, c.fsType, caps.FSType)
	}
	return nil
}

// sourceSize is the size of a copy: what was asked, or the source's size when
// nothing was; smaller than the source is OUT_OF_RANGE (poolcsi never shrinks).
func (c *contentSource) sourceSize(r *csi.CapacityRange, minimum int64) (int64, error) {
	required := r.GetRequiredBytes()
	if required == 0 && r.GetLimitBytes() == 0 {
		required = c.size
	}
	if required != 0 && required < c.size {
		return 0, csierr.Failf(pool.ErrOutOfRange, "required_bytes %d is below the source's size %d; a copy cannot be smaller than its source", required, c.size)
	}
	size, err := pool.Capacity(required, r.GetLimitBytes(), max(minimum, c.size))
	if err != nil {
		return 0, err
	}
	return size, nil
}

func sameSource(a, b *pool.ContentSource) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// finishClone fills a volume still in state creating with its source's data and
// marks it ready. An image copy is grown to the volume's size; its filesystem
// grows at the next NodeStageVolume, like any volume expanded while unstaged.
func (d *Driver) finishClone(ctx context.Context, p *pool.Pool, v *pool.Volume, src *contentSource) error {
	if !src.isSnapshot() {
		// Copying a volume: hold it against concurrent grow, stage and delete.
		sv, release, err := d.holdVolume(ctx, holdCloneSource, p, src.volID)
		if err != nil {
			return err
		}
		defer release()
		src.vol = sv
	}
	return d.layoutOf(v.Layout).cloneFrom(ctx, p, v, src)
}
