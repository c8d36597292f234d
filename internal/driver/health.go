package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// Volume health is served twice from one computation: the CSI 1.13
// VolumeHealth RPCs here, and the v1.12 volume_condition fields that kubelet
// and the health monitor still read (internal/csilegacy). Every answer is computed from
// the pool and the node as they are now, so a repaired volume reports healthy
// on the next call; only NodeGetVolumeStats reuses a node-side answer, for
// Options.StatsHealthTTL (stats.go).

func csiHealth(id string, issues []health.Issue) *csi.VolumeHealth {
	out := &csi.VolumeHealth{VolumeId: id}
	seen := map[string]bool{}
	for _, i := range issues {
		key := i.Status.String() + "/" + i.Reason
		if seen[key] { // the spec forbids two entries with one (status, reason)
			continue
		}
		seen[key] = true
		out.HealthStatuses = append(out.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csiHealthStatus(i.Status), Reason: i.Reason, Message: i.Message,
		})
	}
	return out
}

func csiHealthStatus(s health.Status) csi.VolumeHealthErrorType {
	switch s {
	case health.Degraded:
		return csi.VolumeHealthErrorType_DEGRADED
	case health.Inaccessible:
		return csi.VolumeHealthErrorType_INACCESSIBLE
	case health.DataLoss:
		return csi.VolumeHealthErrorType_DATA_LOSS
	}
	return csi.VolumeHealthErrorType_UNKNOWN_VOLUME_HEALTH_TYPE
}

// loadEntry reads a volume for a health check: a damaged volume.json is an
// answer (MetadataUnreadable), not an error; only a volume that does not exist
// at all is NOT_FOUND.
func loadEntry(p *pool.Pool, vid pool.VolumeID) (pool.Entry, error) {
	v, err := p.Load(vid)
	switch {
	case err == nil && v.State != pool.StateReady:
		return pool.Entry{}, csierr.Failf(pool.ErrNotReady, "volume %s is still being created", vid)
	case err == nil:
		return pool.Entry{ID: vid, Volume: v}, nil
	case errors.Is(err, pool.ErrNotFound):
		if p.VolumeExists(vid) {
			return pool.Entry{ID: vid, Err: err}, nil // directory without metadata
		}
		return pool.Entry{}, csierr.Failf(pool.ErrNotFound, "volume %s does not exist in pool %s", vid, p.Name())
	default:
		return pool.Entry{ID: vid, Err: err}, nil
	}
}

func (d controllerServer) ControllerGetVolumeHealth(ctx context.Context, req *csi.ControllerGetVolumeHealthRequest) (_ *csi.ControllerGetVolumeHealthResponse, err error) {
	defer csierr.ToStatus(&err)
	rq, err := d.resolve(ctx, rpcControllerGetVolumeHealth, req.GetVolumeId(), poolset.Access{}, nil)
	if err != nil {
		return nil, err
	}
	vid, p := rq.id, rq.pool
	issues, err := d.controllerIssues(p, vid)
	if err != nil {
		return nil, err
	}
	return &csi.ControllerGetVolumeHealthResponse{VolumeHealth: csiHealth(vid.String(), issues)}, nil
}

// controllerIssues is the controller-side health of one volume, for the
// VolumeHealth RPCs and the legacy volume_condition alike.
func (d controllerServer) controllerIssues(p *pool.Pool, vid pool.VolumeID) ([]health.Issue, error) {
	e, err := loadEntry(p, vid)
	if err != nil {
		return nil, err
	}
	r := health.CheckVolume(p, e, health.StatPool(p), d.opts.Health)
	if r.Gone {
		return nil, csierr.Failf(pool.ErrNotFound, "volume %s was deleted", vid)
	}
	return r.Issues, nil
}

// ControllerListVolumeHealth lists the volumes with an adverse condition, damaged
// metadata included, paged by volume ID like ListVolumes.
func (d controllerServer) ControllerListVolumeHealth(ctx context.Context, req *csi.ControllerListVolumeHealthRequest) (_ *csi.ControllerListVolumeHealthResponse, err error) {
	defer csierr.ToStatus(&err)
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max_entries must not be negative")
	}
	spaces := map[*pool.Pool]health.PoolSpace{} // one statfs per pool
	found := map[pool.VolumeID][]health.Issue{}
	vols, next, err := d.pageVolumes(req.GetStartingToken(), int(req.GetMaxEntries()), func(p *pool.Pool, e pool.Entry) bool {
		if e.Err == nil && e.Volume.State != pool.StateReady {
			return false
		}
		space, ok := spaces[p]
		if !ok {
			space = health.StatPool(p)
			spaces[p] = space
		}
		issues := health.CheckVolume(p, e, space, d.opts.Health).Issues
		found[e.ID] = issues
		return len(issues) > 0
	})
	if err != nil {
		return nil, err
	}
	resp := &csi.ControllerListVolumeHealthResponse{NextToken: next}
	for _, l := range vols {
		resp.Entries = append(resp.Entries, csiHealth(d.pools.WireID(l.pool, l.entry.ID.String()), found[l.entry.ID]))
	}
	return resp, nil
}

// NodeGetVolumeHealth checks the volume on this node. Unlike NodeGetVolumeStats
// it answers for a volume whose mount has vanished: that is an INACCESSIBLE
// condition the CO should show, not a missing volume.
func (d nodeServer) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (_ *csi.NodeGetVolumeHealthResponse, err error) {
	defer csierr.ToStatus(&err)
	rq, err := d.resolve(ctx, rpcNodeGetVolumeHealth, req.GetVolumeId(), poolset.Access{}, nil)
	if err != nil {
		return nil, err
	}
	vid, p := rq.id, rq.pool
	var paths [2]string
	for i, f := range []struct{ name, v string }{{"staging_target_path", req.GetStagingTargetPath()}, {"volume_publish_path", req.GetVolumePublishPath()}} {
		if f.v == "" {
			continue
		}
		if paths[i], err = d.RequestPath(f.name, f.v); err != nil {
			return nil, err
		}
	}
	issues, err := d.nodeIssues(p, vid, paths[0], paths[1])
	if err != nil {
		return nil, err
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: csiHealth(vid.String(), issues)}, nil
}

// nodeIssues is the node-side health of one volume at the paths given (either
// may be empty), for NodeGetVolumeHealth and the legacy volume_condition of
// NodeGetVolumeStats alike.
func (d nodeServer) nodeIssues(p *pool.Pool, vid pool.VolumeID, staging, publish string) ([]health.Issue, error) {
	if is := d.leases.FencedIssue(p); is != nil {
		// Said without touching the pool: a node fences itself when the
		// pool stops answering.
		return []health.Issue{*is}, nil
	}
	e, err := loadEntry(p, vid)
	if err != nil {
		return nil, err
	}
	nv := health.NodeVolume{ID: vid.String(), Image: p.ImagePath(vid), StagingPath: staging, PublishPath: publish}
	// The volume's own checks (metadata, image present and as long as recorded), as the
	// controller runs them: kubelet reads health only from NodeGetVolumeStats, so a
	// truncated image must show here too. No pool space is passed: pool fullness is
	// the controller's and the storage health's to report.
	issues := health.CheckVolume(p, e, health.PoolSpace{}, d.opts.Health).Issues
	if e.Err == nil {
		nv.Block = e.Volume.AccessType == pool.AccessBlock
		nv.FSType = e.Volume.FSType
	}
	dev, ok, err := d.AttachedDevice(nv.Image)
	if err != nil {
		return nil, err // not "detached": unknown
	}
	if ok {
		nv.Device = dev
	}
	for _, is := range health.CheckNode(nodeHost{d.Mounts, d.Loops, d.FS}, nv, d.opts.Health) {
		if !slices.ContainsFunc(issues, func(o health.Issue) bool { return o.Reason == is.Reason }) {
			issues = append(issues, is)
		}
	}
	return issues, nil
}

// nodeHost is the driver's host as the node-side health checks read it: the
// same kernel, or the same fake, as every other node call.
type nodeHost struct {
	layout.MountTable
	layout.LoopDevices
	layout.Filesystems
}

var _ health.Node = nodeHost{}

// checkPoolReady is health.CheckPoolReady; tests make it hang.
var checkPoolReady = health.CheckPoolReady

// poolCheckTimeout bounds how long NodeGetStorageHealth waits for one pool's
// check: a pool's filesystem that hangs must not hold up the report of the
// others, nor of the fence.
var poolCheckTimeout = 5 * time.Second

// poolChecks are the pool checks of NodeGetStorageHealth under way, at most
// one per pool: a check of a hung pool never returns, and calls after the
// first wait for that one rather than start another.
type poolChecks struct {
	mu      sync.Mutex
	running map[*pool.Pool]*poolCheck
}

// poolCheck is one check of a pool; space and err are set before done closes.
type poolCheck struct {
	done  chan struct{}
	space health.PoolSpace
	err   error
}

// start returns p's check under way, or starts one.
func (c *poolChecks) start(p *pool.Pool) *poolCheck {
	c.mu.Lock()
	defer c.mu.Unlock()
	if pc, ok := c.running[p]; ok {
		return pc
	}
	if c.running == nil {
		c.running = map[*pool.Pool]*poolCheck{}
	}
	pc := &poolCheck{done: make(chan struct{})}
	c.running[p] = pc
	go func() {
		pc.space, pc.err = checkPoolReady(p)
		c.mu.Lock()
		delete(c.running, p)
		c.mu.Unlock()
		close(pc.done)
	}()
	return pc
}

// NodeGetStorageHealth reports the pools as seen from this node: one entry per
// (status, reason), naming every pool it concerns. The fence is reported
// first and without touching the pools (a node fences itself when a pool
// stops answering), a fenced pool is not checked, and each other pool's
// check is given poolCheckTimeout: one that does not answer by then is
// reported so.
func (d nodeServer) NodeGetStorageHealth(ctx context.Context, req *csi.NodeGetStorageHealthRequest) (_ *csi.NodeGetStorageHealthResponse, err error) {
	defer csierr.ToStatus(&err)
	resp := &csi.NodeGetStorageHealthResponse{}
	fenced, failedClosed := d.leases.FencedPools()
	if len(failedClosed) > 0 {
		resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
			Status: csi.StorageHealthErrorType_STORAGE_UNREACHABLE, Reason: health.ReasonFenceFailedClosed, Message: strings.Join(failedClosed, "; "),
		})
	}
	if len(fenced) > 0 {
		resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
			Status: csi.StorageHealthErrorType_STORAGE_UNREACHABLE, Reason: health.ReasonNodeFenced, Message: strings.Join(fenced, "; "),
		})
	}
	type check struct {
		p  *pool.Pool
		pc *poolCheck
	}
	var checks []check
	for _, pn := range d.pools.Names() {
		p := d.pools.Pool(pn)
		if p == nil || d.leases.FencedIssue(p) != nil {
			continue // reported above
		}
		checks = append(checks, check{p, d.poolChecks.start(p)})
	}
	wait, cancel := context.WithTimeout(ctx, poolCheckTimeout)
	defer cancel()
	var unreachable, nearlyFull []string
	for _, c := range checks {
		select {
		case <-c.pc.done:
		case <-wait.Done():
			unreachable = append(unreachable, fmt.Sprintf("pool %s does not answer: its check (of %s) has not returned within %s; is its filesystem hung?", c.p.Name(), c.p.Path(), poolCheckTimeout))
			continue
		}
		if c.pc.err != nil {
			unreachable = append(unreachable, c.pc.err.Error())
			continue
		}
		if c.pc.space.UsedFraction() >= d.opts.Health.PoolFullThreshold {
			nearlyFull = append(nearlyFull, health.PoolFullMessage(c.pc.space, d.opts.Health))
		}
	}
	if len(unreachable) > 0 {
		resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
			Status: csi.StorageHealthErrorType_STORAGE_UNREACHABLE, Reason: health.ReasonPoolUnavailable, Message: strings.Join(unreachable, "; "),
		})
	}
	if len(nearlyFull) > 0 {
		resp.BackendHealth = append(resp.BackendHealth, &csi.NodeGetStorageHealthResponse_StorageBackendHealth{
			Status: csi.StorageHealthErrorType_STORAGE_DEGRADED, Reason: health.ReasonPoolNearlyFull, Message: strings.Join(nearlyFull, "; "),
		})
	}
	return resp, nil
}

// AbnormalVolumes returns every volume of the driver's pools with a
// controller-side health issue, by volume ID, with the message the legacy
// condition carries: for reporting health where the health monitor sidecar is
// not deployed (internal/pvcevents).
func (d controllerServer) AbnormalVolumes(ctx context.Context) (map[string]string, error) {
	resp, err := d.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{})
	if err != nil {
		return nil, err
	}
	out := make(map[string]string, len(resp.GetEntries()))
	for _, h := range resp.GetEntries() {
		var parts []string
		for _, s := range h.GetHealthStatuses() {
			parts = append(parts, s.GetReason()+": "+s.GetMessage())
		}
		out[h.GetVolumeId()] = strings.Join(parts, "; ")
	}
	return out, nil
}
