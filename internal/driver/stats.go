package driver

import (
	"context"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/csilegacy"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// NodeGetVolumeStats reports usage of a staged or published volume; kubelet turns
// it into the kubelet_volume_stats_* metrics. It is on kubelet's hot path (every
// volume, every minute): for ext4 and xfs volumes it costs a few stats, one loop
// device ioctl and a statfs; the others also read volume.json and mountinfo.
func (d nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (_ *csi.NodeGetVolumeStatsResponse, err error) {
	defer csierr.ToStatus(&err)
	if pool.IsEphemeralHandle(req.GetVolumeId()) {
		if req.GetVolumePath() == "" {
			return nil, status.Error(codes.InvalidArgument, "volume_path is required")
		}
		// kubelet's own ID of an inline volume: found by its record, never
		// parsed as a poolcsi ID.
		p, vid, err := d.inline.Ref(req.GetVolumeId())
		if err != nil {
			return nil, err
		}
		return d.statsOf(ctx, p, vid, req)
	}
	rq, err := d.resolve(ctx, rpcNodeGetVolumeStats, req.GetVolumeId(), poolset.Access{}, func() error {
		if req.GetVolumePath() == "" {
			return status.Error(codes.InvalidArgument, "volume_path is required")
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return d.statsOf(ctx, rq.pool, rq.id, req)
}

// statsOf is NodeGetVolumeStats of the volume vid of p, however the request named it.
func (d nodeServer) statsOf(ctx context.Context, p *pool.Pool, vid pool.VolumeID, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
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
		staging, _ = d.RequestPath("staging_target_path", req.GetStagingTargetPath())
	}
	issues, err := d.statsCondition(p, vid, staging, path)
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Volume health not computed for the stats", "volume", vid, "err", err)
		return resp, nil
	}
	csilegacy.SetCondition(resp, issues)
	return resp, nil
}

// conditionCache holds the node-side health NodeGetVolumeStats reuses for
// Options.StatsHealthTTL. Every pod brings a new publish path, so a key that
// outlived its mount would stay forever: a volume's entries go with its
// unpublish and unstage, and a size cap bounds what those miss (kubelet
// asking about paths it never unpublishes through this process).
type conditionCache struct {
	mu sync.Mutex
	m  map[conditionKey]cachedCondition
}

type conditionKey struct{ volume, staging, path string }

type cachedCondition struct {
	at     time.Time
	issues []health.Issue
}

// maxCachedConditions is far above the paths a node serves at once (a loop
// device per volume, a few pods each), so the cap only catches leaks.
const maxCachedConditions = 4096

func (c *conditionCache) get(k conditionKey, ttl time.Duration) ([]health.Issue, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[k]
	if !ok || time.Since(e.at) >= ttl {
		return nil, false
	}
	return e.issues, true
}

func (c *conditionCache) put(k conditionKey, issues []health.Issue, ttl time.Duration) {
	if ttl <= 0 {
		return // never reused, so never kept
	}
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[conditionKey]cachedCondition{}
	}
	if _, ok := c.m[k]; !ok && len(c.m) >= maxCachedConditions {
		for old, e := range c.m {
			if now.Sub(e.at) >= ttl {
				delete(c.m, old)
			}
		}
		if len(c.m) >= maxCachedConditions {
			clear(c.m) // all fresh: recomputing them costs a check each, once
		}
	}
	c.m[k] = cachedCondition{at: now, issues: issues}
}

// forget drops every entry of a volume: its paths after an unpublish or
// unstage are gone or belong to the next pod, which must not see old health.
func (c *conditionCache) forget(volume string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k := range c.m {
		if k.volume == volume {
			delete(c.m, k)
		}
	}
}

func (c *conditionCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}

func (d nodeServer) statsCondition(p *pool.Pool, vid pool.VolumeID, staging, path string) ([]health.Issue, error) {
	key := conditionKey{volume: vid.String(), staging: staging, path: path}
	if issues, ok := d.conditions.get(key, d.opts.StatsHealthTTL); ok {
		return issues, nil
	}
	issues, err := d.nodeIssues(p, vid, staging, path)
	if err != nil {
		return nil, err
	}
	d.conditions.put(key, issues, d.opts.StatsHealthTTL)
	return issues, nil
}

// volumeStats is the usage of volume vid of pool p at path.
func (d nodeServer) volumeStats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	// Fast path, for ext4 and xfs image volumes: the path shows the filesystem of
	// the loop device backed by this volume's image, which proves everything the
	// call needs without reading volume.json or mountinfo.
	image := p.ImagePath(vid)
	if dev, ok, _ := d.Loops.Find(image); ok && d.Mounts.OnDevice(path, dev) {
		return d.FilesystemStats(path)
	}
	v, err := loadVolume(p, vid)
	if err != nil {
		return nil, err
	}
	return d.layoutOf(v.Layout).Stats(ctx, p, vid, v, path)
}
