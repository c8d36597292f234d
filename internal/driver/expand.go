package driver

import (
	"context"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// growSlack is how far a filesystem may stay below its device before stage
// grows it. resize2fs drops a last block group too small for its own metadata
// (about 2 MiB with 4 KiB blocks) and xfs_growfs a last allocation group under
// 64 blocks, so a smaller gap is what a finished resize leaves, not a pending one.
const growSlack = 4 * pool.MiB

// ControllerExpandVolume grows a volume's image file and records the new size.
// The node catches up later — NodeExpandVolume online, or the next
// NodeStageVolume — because only the node can refresh its loop device and grow
// the filesystem on it.
func (d *Driver) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (_ *csi.ControllerExpandVolumeResponse, err error) {
	defer toStatus(&err)
	if _, err := parseVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	r := req.GetCapacityRange()
	if r == nil || (r.GetRequiredBytes() == 0 && r.GetLimitBytes() == 0) {
		return nil, status.Error(codes.InvalidArgument, "capacity_range with required_bytes or limit_bytes is required")
	}
	vid, p, release, err := d.lockVolumeRef(ctx, req.GetVolumeId(), "ControllerExpandVolume", dataAccess(req.GetSecrets()))
	if err != nil {
		return nil, err
	}
	defer release()
	v, err := loadVolume(p, vid)
	if err != nil {
		return nil, err
	}
	if err := d.checkCapability(v, req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	lay := d.layoutOf(v.Layout)
	limit := r.GetLimitBytes()
	if r.GetRequiredBytes() < 0 || limit < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "capacity_range must not be negative (required %d, limit %d)", r.GetRequiredBytes(), limit)
	}
	if r.GetRequiredBytes() <= v.CapacityBytes {
		// Never shrink: a smaller request is already satisfied — unless a
		// limit says the volume is too large, which only shrinking could fix.
		if limit > 0 && v.CapacityBytes > limit {
			return nil, failf(pool.ErrOutOfRange, "volume %s is %d bytes, above limit_bytes %d; poolcsi never shrinks a volume", vid, v.CapacityBytes, limit)
		}
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: lay.nodeExpansionRequired()}, nil
	}
	return lay.expand(ctx, p, vid, v, r)
}

// growImage grows an image volume's file to the range asked (rounded as
// CreateVolume rounds) and records the new size.
func (d *Driver) growImage(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, r *csi.CapacityRange) (*pool.Volume, error) {
	size, err := pool.Capacity(r.GetRequiredBytes(), r.GetLimitBytes(), minSizeOf(v))
	if err != nil {
		return nil, err
	}
	before := v.CapacityBytes
	v, err = p.Grow(ctx, vid, size, r.GetLimitBytes())
	if err != nil {
		return nil, err
	}
	if v.CapacityBytes != before {
		klog.FromContext(ctx).Info("Expanded volume", "volume", vid, "from", before, "to", v.CapacityBytes)
	}
	return v, nil
}

// minSizeOf is the smallest size CreateVolume would have given v.
func minSizeOf(v *pool.Volume) int64 {
	if v.AccessType == pool.AccessBlock {
		return mount.MinSize("")
	}
	return mount.MinSize(v.FSType)
}

// NodeExpandVolume brings a staged volume to the size its image file has: the
// loop device first, then the filesystem, online. It accepts the staging path
// or any publish path of the volume, as kubelet may pass either.
func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (_ *csi.NodeExpandVolumeResponse, err error) {
	defer toStatus(&err)
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	// The volume is staged here, so its share (if it has one) is served: no mount.
	vid, p, release, err := d.lockVolumeRef(ctx, req.GetVolumeId(), "NodeExpandVolume", shareAccess{})
	if err != nil {
		return nil, err
	}
	defer release()
	v, err := loadVolume(p, vid)
	if err != nil {
		return nil, err
	}
	path, err := d.volumePath(vid, req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	if err := d.checkCapability(v, req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	return d.layoutOf(v.Layout).expandNode(ctx, nodeVolume{id: vid, pool: p, vol: v}, req, path)
}

// refreshLoop makes the loop device as large as the image file and returns that
// size. The file is the truth (ControllerExpandVolume grows it before it records
// the size); a file smaller than its record was damaged, and is not hidden.
func (d *Driver) refreshLoop(ctx context.Context, p *pool.Pool, vid pool.VolumeID, dev string, v *pool.Volume) (int64, error) {
	imageSize, err := p.ImageSize(vid)
	if err != nil {
		return 0, err
	}
	if imageSize < v.CapacityBytes {
		return 0, failf(errState, "volume %s: image %s is %d bytes but %d are recorded; the image was truncated", v.ID, p.ImagePath(vid), imageSize, v.CapacityBytes)
	}
	size, err := d.devs.Size(dev)
	if err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if size >= imageSize {
		return size, nil
	}
	if err := d.loops.Refresh(dev); err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if size, err = d.devs.Size(dev); err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	klog.FromContext(ctx).V(2).Info("Refreshed loop device size", "volume", v.ID, "device", dev, "size", size)
	return size, nil
}

// stageGrowth is what NodeStageVolume still owes a volume expanded while it was
// not staged, found before mounting.
type stageGrowth struct{ afterMount bool }

// growBeforeMount runs during NodeStageVolume between attach and mount: it
// refreshes the loop device and, when the filesystem is smaller than its
// device, grows an ext4 filesystem offline at once (e2fsck + resize2fs, which
// needs no CAP_SYS_RESOURCE) or notes that xfs/btrfs must grow once mounted.
// A read-only stage grows nothing: it must not write the volume.
func (d *Driver) growBeforeMount(ctx context.Context, nv nodeVolume, dev string, readOnly bool) (stageGrowth, error) {
	size, err := d.refreshLoop(ctx, nv.pool, nv.id, dev, nv.vol)
	if err != nil || readOnly {
		return stageGrowth{}, err
	}
	fsType, fsSize, err := d.devs.FilesystemSize(dev)
	if err != nil {
		return stageGrowth{}, fmt.Errorf("volume %s: %w", nv.id, err)
	}
	if size-fsSize < growSlack {
		return stageGrowth{}, nil
	}
	klog.FromContext(ctx).Info("Volume was expanded while not staged; growing its filesystem", "volume", nv.id, "fsType", fsType, "from", fsSize, "to", size)
	if fsType != "ext4" {
		return stageGrowth{afterMount: true}, nil
	}
	if err := d.devs.ResizeFS(ctx, dev, ""); err != nil {
		return stageGrowth{}, fmt.Errorf("grow filesystem of volume %s offline: %w", nv.id, err)
	}
	return stageGrowth{}, nil
}

// growAfterMount finishes what growBeforeMount left for a mounted filesystem.
// A failure does not fail the stage: the volume is usable at its old size, and
// kubelet follows an offline expansion with NodeExpandVolume, which retries.
func (d *Driver) growAfterMount(ctx context.Context, g stageGrowth, nv nodeVolume, dev, staging string) {
	if !g.afterMount {
		return
	}
	if err := d.devs.ResizeFS(ctx, dev, staging); err != nil {
		klog.FromContext(ctx).Error(err, "Growing the filesystem after staging failed; NodeExpandVolume will retry", "volume", nv.id, "path", staging)
	}
}

// expandNode brings a staged image volume to the size its image file has: the
// loop device first, then the filesystem, online.
func (d imageLayout) expandNode(ctx context.Context, nv nodeVolume, req *csi.NodeExpandVolumeRequest, path string) (*csi.NodeExpandVolumeResponse, error) {
	v := nv.vol
	image := nv.pool.ImagePath(nv.id)
	dev, attached, err := d.loops.Find(image)
	if err != nil {
		return nil, fmt.Errorf("find loop device of %s: %w", image, err)
	}
	if !attached {
		return nil, failf(errNotAtPath, "volume %s is not staged on this node", nv.id)
	}
	if r := req.GetCapacityRange(); d.opts.ExpandOnNode && isLocal(nv.pool) && r.GetRequiredBytes() > v.CapacityBytes {
		// Local pools deployed with one cluster-wide resizer: the resizer cannot
		// reach this node's pool, so it skips ControllerExpandVolume (not
		// advertised) and the file grows here, where the pool is.
		if v, err = d.growImage(ctx, nv.pool, nv.id, v, r); err != nil {
			return nil, err
		}
	}
	info, mounted, err := d.mounts.Info(path)
	if err != nil {
		return nil, fmt.Errorf("inspect %s: %w", path, err)
	}
	holds := mounted && (info.Source == dev || d.mounts.IsDevice(info.Target, dev))
	if !holds && v.AccessType == pool.AccessBlock {
		// A block volume's staging path has nothing mounted on it.
		holds = slices.ContainsFunc(v.Staged, func(s pool.StageRecord) bool { return s.Node == d.opts.NodeID && s.Path == path })
	}
	if !holds {
		return nil, failf(errNotAtPath, "volume %s is not mounted at %s", nv.id, path)
	}

	size, err := d.refreshLoop(ctx, nv.pool, nv.id, dev, v)
	if err != nil {
		return nil, err
	}
	if req := req.GetCapacityRange().GetRequiredBytes(); req > size {
		return nil, failf(errState, "volume %s is %d bytes, %d were asked: ControllerExpandVolume has not grown it yet", nv.id, size, req)
	}
	if v.AccessType == pool.AccessFilesystem {
		if info.ReadOnly {
			path, info = d.writableMount(nv, req.GetStagingTargetPath(), dev, path, info)
		}
		if info.ReadOnly {
			// Growing writes the filesystem, and a read-only stage must not be
			// written. Answering the new size would make kubelet mark the claim
			// resized while the filesystem keeps its old size: answer an error
			// kubelet retries (and shows as an event) instead; the next
			// read-write stage grows the filesystem.
			return nil, failf(errState,
				"volume %s is mounted read-only at %s: its filesystem cannot grow to %d bytes until the volume is staged read-write, which grows it", nv.id, path, size)
		}
		need, err := d.devs.NeedResize(dev, path)
		if err != nil {
			return nil, fmt.Errorf("volume %s: %w", nv.id, err)
		}
		if need {
			if err := d.devs.ResizeFS(ctx, dev, path); err != nil {
				return nil, fmt.Errorf("grow filesystem of volume %s: %w", nv.id, err)
			}
		}
	}
	klog.FromContext(ctx).Info("Expanded volume on node", "volume", nv.id, "path", path, "device", dev, "size", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// writableMount finds a read-write mount of the volume's filesystem to grow
// through when the path kubelet named is read-only: a pod's publish path may be
// a read-only bind of a read-write staging mount, which kubelet names, or this
// node's stage record does. It returns path and info unchanged when there is
// none.
func (d imageLayout) writableMount(nv nodeVolume, staging, dev, path string, info mount.MountInfo) (string, mount.MountInfo) {
	candidates := []string{staging}
	for _, s := range nv.vol.Staged {
		if s.Node == d.opts.NodeID {
			candidates = append(candidates, s.Path)
		}
	}
	for _, c := range candidates {
		if c == "" {
			continue
		}
		sp, err := d.requestPath("staging_target_path", c)
		if err != nil || sp == path {
			continue
		}
		if si, ok, err := d.mounts.Info(sp); err == nil && ok && !si.ReadOnly && (si.Source == dev || d.mounts.OnDevice(sp, dev)) {
			return sp, si
		}
	}
	return path, info
}
