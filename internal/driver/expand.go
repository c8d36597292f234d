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

// ControllerExpandVolume grows a volume's image file and records the new size.
// The node catches up later — NodeExpandVolume online, or the next
// NodeStageVolume — because only the node can refresh its loop device and grow
// the filesystem on it.
func (d controllerServer) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (_ *csi.ControllerExpandVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	r := req.GetCapacityRange()
	rq, err := d.resolve(ctx, rpcControllerExpandVolume, req.GetVolumeId(), poolset.Access{Secrets: req.GetSecrets()}, func() error {
		if r == nil || (r.GetRequiredBytes() == 0 && r.GetLimitBytes() == 0) {
			return status.Error(codes.InvalidArgument, "capacity_range with required_bytes or limit_bytes is required")
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p, v := rq.id, rq.pool, rq.vol
	if err := layout.NotEphemeral(v, "be expanded"); err != nil {
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
			return nil, csierr.Failf(pool.ErrOutOfRange, "volume %s is %d bytes, above limit_bytes %d; poolcsi never shrinks a volume", vid, v.CapacityBytes, limit)
		}
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: lay.NodeExpansionRequired()}, nil
	}
	return lay.Expand(ctx, p, vid, v, r)
}

// NodeExpandVolume brings a staged volume to the size its image file has: the
// loop device first, then the filesystem, online. It accepts the staging path
// or any publish path of the volume, as kubelet may pass either.
func (d nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (_ *csi.NodeExpandVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	if pool.IsEphemeralHandle(req.GetVolumeId()) {
		return nil, csierr.Failf(csierr.ErrInvalid, "volume %s is an ephemeral inline volume: it cannot be expanded (it lives as long as its pod; its size is the pod's size attribute)", req.GetVolumeId())
	}
	// The volume is staged here, so its share (if it has one) is served: no mount.
	rq, err := d.resolve(ctx, rpcNodeExpandVolume, req.GetVolumeId(), poolset.Access{}, nil)
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p, v := rq.id, rq.pool, rq.vol
	if err := layout.NotEphemeral(v, "be expanded"); err != nil {
		return nil, err
	}
	path, err := d.volumePath(vid, req.GetVolumePath())
	if err != nil {
		return nil, err
	}
	if err := d.checkCapability(v, req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	return d.layoutOf(v.Layout).ExpandNode(ctx, layout.NodeVolume{ID: vid, Pool: p, Vol: v}, req, path)
}
