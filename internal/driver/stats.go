package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// NodeGetVolumeStats reports usage of a staged or published volume; kubelet turns
// it into the kubelet_volume_stats_* metrics. It is on kubelet's hot path (every
// volume, every minute), so it reads mountinfo and calls statfs, and nothing more.
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	vid, err := parseVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	_, p, err := d.volumeRef(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	v, err := loadVolume(p, vid)
	if err != nil {
		return nil, err
	}
	path, err := volumePath(vid, req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	if v.Layout == pool.LayoutDir {
		return d.dirStats(ctx, p, vid, v, path)
	}
	info, mounted, err := d.mounter.Info(path)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "inspect %s: %v", path, err)
	}
	dev, attached, _ := d.loops.Find(p.ImagePath(vid))
	if !mounted || !attached || !(info.Source == dev || d.sameDevice(info, dev)) {
		return nil, status.Errorf(codes.NotFound, "volume %s is not mounted at %s", vid, path)
	}
	if v.AccessType == pool.AccessBlock {
		size, err := mount.DeviceSize(dev)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "size of %s: %v", dev, err)
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return nil, status.Errorf(codes.Internal, "statfs %s: %v", path, err)
	}
	bs := st.Bsize
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(st.Blocks) * bs, Available: int64(st.Bavail) * bs, Used: int64(st.Blocks-st.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree), Used: int64(st.Files - st.Ffree)},
	}}, nil
}
