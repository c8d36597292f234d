package layout

import (
	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// NodeVolume is what every node call resolves first: the volume, its pool and its
// parsed capability.
type NodeVolume struct {
	ID   pool.VolumeID
	Pool *pool.Pool
	Vol  *pool.Volume
	Caps params.Caps
}

// isVolumeMount tells whether a mount comes from the loop device backed by
// image; UNAVAILABLE when the loop devices cannot be looked up.
func (d *Deps) IsVolumeMount(info mount.MountInfo, image string) (bool, error) {
	dev, ok, err := d.AttachedDevice(image)
	return ok && dev == info.Source, err
}

// ContentSource is a resolved volume_content_source: a ready snapshot or a ready
// volume, and what a volume made from it must match.
type ContentSource struct {
	Pool   *pool.Pool
	Record pool.ContentSource
	Layout pool.Layout
	Access pool.AccessType
	FSType string
	Size   int64 // the smallest volume it fits in
	// snapshot or volume, whichever it is
	SnapID pool.SnapshotID
	VolID  pool.VolumeID
	Vol    *pool.Volume
}

func (c *ContentSource) IsSnapshot() bool { return c.Record.Snapshot != "" }

// GrowSlack is how far a filesystem may stay below its device before stage
// grows it. resize2fs drops a last block group too small for its own metadata
// (about 2 MiB with 4 KiB blocks) and xfs_growfs a last allocation group under
// 64 blocks, so a smaller gap is what a finished resize leaves, not a pending one.
const GrowSlack = 4 * pool.MiB

// MinSizeOf is the smallest size CreateVolume would have given v.
func MinSizeOf(v *pool.Volume) int64 {
	if v.AccessType == pool.AccessBlock {
		return mount.MinSize("")
	}
	return mount.MinSize(v.FSType)
}

// stageGrowth is what NodeStageVolume still owes a volume expanded while it was
// not staged, found before mounting.
type stageGrowth struct{ afterMount bool }

// writers are the nodes holding an image volume staged read-write.
func Writers(v *pool.Volume, node string) []string {
	var out []string
	for _, s := range v.Staged {
		if !s.ReadOnly && (node == "" || s.Node == node) {
			out = append(out, s.Node)
		}
	}
	return out
}

// Check refuses a copy the source cannot give: another pool, another
// layout, access type or filesystem (INVALID_ARGUMENT).
func (c *ContentSource) Check(p *pool.Pool, layout pool.Layout, lay Layout, caps params.Caps) error {
	what := "volume " + c.Record.Volume
	if c.IsSnapshot() {
		what = "snapshot " + c.Record.Snapshot
	}
	switch {
	case p != c.Pool:
		return status.Errorf(codes.InvalidArgument, "%s is in pool %s; a copy is made in its source's pool, not %s", what, c.Pool.Name(), p.Name())
	case layout != c.Layout:
		return status.Errorf(codes.InvalidArgument, "%s has layout %s, the request asks for layout %s", what, c.Layout, layout)
	case caps.Access != c.Access:
		return status.Errorf(codes.InvalidArgument, "%s has %s access, the request asks for %s", what, c.Access, caps.Access)
	case !lay.SameFS(caps, c.FSType):
		return status.Errorf(codes.InvalidArgument, "%s holds %s, the request asks for %s", what, c.FSType, caps.FSType)
	}
	return nil
}

// SourceSize is the size of a copy: what was asked, or the source's size when
// nothing was; smaller than the source is OUT_OF_RANGE (poolcsi never shrinks).
func (c *ContentSource) SourceSize(r *csi.CapacityRange, minimum int64) (int64, error) {
	required := r.GetRequiredBytes()
	if required == 0 && r.GetLimitBytes() == 0 {
		required = c.Size
	}
	if required != 0 && required < c.Size {
		return 0, csierr.Failf(pool.ErrOutOfRange, "required_bytes %d is below the source's size %d; a copy cannot be smaller than its source", required, c.Size)
	}
	size, err := pool.Capacity(required, r.GetLimitBytes(), max(minimum, c.Size))
	if err != nil {
		return 0, err
	}
	return size, nil
}
