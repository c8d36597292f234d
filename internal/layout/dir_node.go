package layout

import (
	"context"
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// stage bind-mounts the volume's data directory at the staging path.
func (d dirLayout) Stage(ctx context.Context, nv NodeVolume, staging string, vc *csi.VolumeCapability) error {
	// Bound through a descriptor opened without following links: a link put
	// in place of the data directory never exposes anything outside the pool.
	h, err := nv.Pool.OpenData(nv.ID)
	if errors.Is(err, pool.ErrNotFound) {
		return csierr.Failf(pool.ErrNotFound, "volume %s: data directory %s is missing", nv.ID, nv.Pool.DataPath(nv.ID))
	} else if err != nil {
		return err
	}
	defer h.Close()
	readOnly := params.ReadOnlyMode(vc.GetAccessMode().GetMode())
	if err := d.Mounts.Bind(ctx, h.Path(), staging, readOnly, mount.BindOptions(vc.GetMount().GetMountFlags())); err != nil {
		if errors.Is(err, mount.ErrMountConflict) {
			return csierr.Failf(csierr.ErrPathTaken, "staging path %s: %w", staging, err)
		}
		return fmt.Errorf("stage volume %s at %s: %w", nv.ID, staging, err)
	}
	klog.FromContext(ctx).Info("Staged dir volume", "volume", nv.ID, "path", staging, "readOnly", readOnly)
	return nil
}

// publish bind-mounts the staged directory at the target.
func (d dirLayout) Publish(ctx context.Context, nv NodeVolume, staging, target string, readOnly bool, vc *csi.VolumeCapability) error {
	data := nv.Pool.DataPath(nv.ID)
	if _, mounted, err := d.Mounts.Info(staging); err != nil {
		return fmt.Errorf("inspect %s: %w", staging, err)
	} else if !mounted || !d.Mounts.SameDir(staging, data) {
		return csierr.Failf(csierr.ErrNotStaged, "volume %s is not staged at %s; call NodeStageVolume first", nv.ID, staging)
	}
	if vc.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		if other, err := d.Mounts.MountedElsewhere(data, staging, target); err != nil {
			return fmt.Errorf("list mounts of volume %s: %w", nv.ID, err)
		} else if other != "" {
			return csierr.Failf(csierr.ErrInUse, "volume %s has access mode SINGLE_NODE_SINGLE_WRITER and is already published at %s", nv.ID, other)
		}
	}
	if err := d.Mounts.Bind(ctx, staging, target, readOnly, mount.BindOptions(vc.GetMount().GetMountFlags())); err != nil {
		if errors.Is(err, mount.ErrMountConflict) {
			return csierr.Failf(csierr.ErrPathTaken, "target path %s: %w", target, err)
		}
		return fmt.Errorf("publish volume %s at %s: %w", nv.ID, target, err)
	}
	klog.FromContext(ctx).Info("Published dir volume", "volume", nv.ID, "target", target, "readOnly", readOnly)
	return nil
}

// stats reports a dir volume's usage against its limit. With an enforced
// quota the numbers are the quota's; without one they are the pool filesystem's,
// which is what a writer in the pod will really run into.
func (d dirLayout) Stats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	if _, mounted, err := d.Mounts.Info(path); err != nil {
		return nil, fmt.Errorf("inspect %s: %w", path, err)
	} else if !mounted || !d.Mounts.SameDir(path, p.DataPath(vid)) {
		return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not mounted at %s", vid, path)
	}
	var st unix.Statfs_t
	if err := d.FS.Statfs(path, &st); err != nil {
		return nil, err
	}
	bs := st.Bsize
	fsUsage := &csi.VolumeUsage{Unit: csi.VolumeUsage_BYTES, Total: int64(st.Blocks) * bs, Available: int64(st.Bavail) * bs, Used: int64(st.Blocks-st.Bfree) * bs}
	inodes := &csi.VolumeUsage{Unit: csi.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree), Used: int64(st.Files - st.Ffree)}
	if v.Quota == nil || !v.Quota.Enforced {
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{fsUsage, inodes}}, nil
	}
	b, err := d.QuotaFor(ctx, p)
	if err != nil {
		return nil, err
	}
	u, err := b.Usage(ctx, p.DataPath(vid), v.Quota.ID)
	if err != nil {
		return nil, fmt.Errorf("quota usage of volume %s: %w", vid, err)
	}
	limit := u.LimitBytes
	if limit <= 0 {
		limit = v.CapacityBytes
	}
	// The filesystem may run out before the quota does.
	avail := max(min(limit-u.UsedBytes, fsUsage.Available), 0)
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: limit, Used: u.UsedBytes, Available: avail},
	}}, nil
}

// expandNode: a directory has no size of its own to grow; the quota limit,
// raised by the controller, is all there is.
func (dirLayout) ExpandNode(_ context.Context, nv NodeVolume, _ *csi.NodeExpandVolumeRequest, _ string) (*csi.NodeExpandVolumeResponse, error) {
	return &csi.NodeExpandVolumeResponse{CapacityBytes: nv.Vol.CapacityBytes}, nil
}
