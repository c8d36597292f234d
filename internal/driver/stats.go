package driver

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// NodeGetVolumeStats reports usage of a staged or published volume; kubelet turns
// it into the kubelet_volume_stats_* metrics. It is on kubelet's hot path (every
// volume, every minute): for ext4 and xfs volumes it costs a few stats, one loop
// device ioctl and a statfs; the others also read volume.json and mountinfo.
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	vid, err := parseVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	_, p, err := d.volumeRef(ctx, req.GetVolumeId(), shareAccess{})
	if err != nil {
		return nil, err
	}
	path, err := d.volumePath(vid, req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	resp, err := d.volumeStats(ctx, p, vid, path)
	if err != nil {
		return nil, err
	}
	// The legacy volume_condition, which kubelet turns into
	// kubelet_volume_stats_health_status_abnormal and a pod event.
	staging := ""
	if req.GetStagingTargetPath() != "" {
		staging, _ = d.requestPath("staging_target_path", req.GetStagingTargetPath())
	}
	issues, err := d.statsCondition(p, vid, staging, path)
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Volume health not computed for the stats", "volume", vid, "err", err)
		return resp, nil
	}
	setLegacyCondition(resp, issues)
	return resp, nil
}

type cachedCondition struct {
	at     time.Time
	issues []health.Issue
}

func (d *Driver) statsCondition(p *pool.Pool, vid pool.VolumeID, staging, path string) ([]health.Issue, error) {
	key := vid.String() + "\x00" + staging + "\x00" + path
	if c, ok := d.conditions.Load(key); ok && time.Since(c.(cachedCondition).at) < d.opts.StatsHealthTTL {
		return c.(cachedCondition).issues, nil
	}
	issues, err := d.nodeIssues(p, vid, staging, path)
	if err != nil {
		return nil, err
	}
	d.conditions.Store(key, cachedCondition{at: time.Now(), issues: issues})
	return issues, nil
}

// volumeStats is the usage of volume vid of pool p at path.
func (d *Driver) volumeStats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	// Fast path, for ext4 and xfs image volumes: the path shows the filesystem of
	// the loop device backed by this volume's image, which proves everything the
	// call needs without reading volume.json or mountinfo.
	image := p.ImagePath(vid)
	if dev, ok, _ := d.loops.Find(image); ok && d.mounts.OnDevice(path, dev) {
		return d.filesystemStats(path)
	}
	v, err := loadVolume(p, vid)
	if err != nil {
		return nil, err
	}
	return d.layoutOf(v.Layout).stats(ctx, p, vid, v, path)
}

// filesystemStats is the usage of the filesystem mounted at path.
func (d *Driver) filesystemStats(path string) (*csi.NodeGetVolumeStatsResponse, error) {
	var st unix.Statfs_t
	if err := d.fs.Statfs(path, &st); err != nil {
		return nil, grpcError(err)
	}
	bs := st.Bsize
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(st.Blocks) * bs, Available: int64(st.Bavail) * bs, Used: int64(st.Blocks-st.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree), Used: int64(st.Files - st.Ffree)},
	}}, nil
}

// stats of an image volume: its filesystem's, or its block device's size.
func (d imageLayout) stats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	image := p.ImagePath(vid)
	dev, attached, _ := d.loops.Find(image)
	if !attached {
		return nil, status.Errorf(codes.NotFound, "volume %s is not attached on this node, so not mounted at %s", vid, path)
	}
	if !d.mounts.OnDevice(path, dev) {
		info, mounted, err := d.mounts.Info(path)
		if err != nil {
			return nil, grpcError(fmt.Errorf("inspect %s: %w", path, err))
		}
		if !mounted || (info.Source != dev && !d.mounts.IsDevice(info.Target, dev)) {
			return nil, status.Errorf(codes.NotFound, "volume %s is not mounted at %s", vid, path)
		}
	}
	if v.AccessType == pool.AccessBlock {
		size, err := d.devs.Size(dev)
		if err != nil {
			return nil, grpcError(fmt.Errorf("size of %s: %w", dev, err))
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
	}
	return d.filesystemStats(path)
}
