package driver

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/csilegacy"
	"github.com/poolcsi/poolcsi/internal/ephemeral"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

var nodeCaps = []csi.NodeServiceCapability_RPC_Type{
	csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
	csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
	csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
	csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
	csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH,
	csilegacy.NodeVolumeCondition,
}

func (d nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	out := make([]*csi.NodeServiceCapability, 0, len(nodeCaps))
	for _, c := range nodeCaps {
		out = append(out, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: c}},
		})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: out}, nil
}

func (d nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             d.opts.NodeID,
		MaxVolumesPerNode:  d.opts.MaxVolumesPerNode,
		AccessibleTopology: &csi.Topology{Segments: d.pools.Topology()},
	}, nil
}

// nodeVolume resolves the volume of a stage or publish (call): the ID, the
// capability every one carries (checked before anything is locked), then the
// front hall (request.go), then what the volume must be for the capability.
// The caller defers release.
func (d nodeServer) nodeVolume(ctx context.Context, call holder, volumeID string, vc *csi.VolumeCapability, acc poolset.Access) (layout.NodeVolume, func(), error) {
	var caps params.Caps
	rq, err := d.resolve(ctx, call, volumeID, acc, func() (err error) {
		if vc == nil {
			return status.Error(codes.InvalidArgument, "volume_capability is required")
		}
		caps, err = params.ParseCaps([]*csi.VolumeCapability{vc}, "")
		return err
	})
	if err != nil {
		return layout.NodeVolume{}, nil, err
	}
	nv := layout.NodeVolume{ID: rq.id, Pool: rq.pool, Vol: rq.vol, Caps: caps}
	if err := d.CheckNodeUse(nv, vc); err != nil {
		rq.release()
		return nv, nil, err
	}
	return nv, rq.release, nil
}

func (d nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (_ *csi.NodeStageVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	staging, err := d.RequestPath("staging_target_path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	if err := d.checkNesting("staging_target_path", staging); err != nil {
		return nil, err
	}
	vc := req.GetVolumeCapability()
	nv, release, err := d.nodeVolume(ctx, rpcNodeStageVolume, req.GetVolumeId(), vc, poolset.Access{Secrets: req.GetSecrets(), VolumeContext: req.GetVolumeContext(), MountFlags: vc.GetMount().GetMountFlags()})
	if err != nil {
		return nil, err
	}
	defer release()
	readOnly := params.ReadOnlyMode(req.GetVolumeCapability().GetAccessMode().GetMode())
	if !readOnly && nv.Vol.Layout == pool.LayoutImage {
		// A node that cannot renew its lease would not fence itself if cut
		// off: it takes no image read-write meanwhile.
		if err := d.leases.EnsureLease(ctx, nv.Pool); err != nil {
			return nil, err
		}
	}
	claimed, err := d.claimStage(ctx, nv, staging, readOnly)
	if err != nil {
		return nil, err
	}
	if claimed {
		if err := d.dropStaleStage(ctx, nv, staging, readOnly); err != nil {
			d.unclaimStage(ctx, nv)
			return nil, err
		}
	}
	if err := d.layoutOf(nv.Vol.Layout).Stage(ctx, nv, staging, req.GetVolumeCapability()); err != nil {
		if claimed {
			d.unclaimStage(ctx, nv)
		}
		d.ForgetStages(ctx, nv.ID) // those whose device went with the failure
		return nil, err
	}
	if !claimed {
		if err := d.recordStage(ctx, nv, staging, readOnly); err != nil {
			return nil, err
		}
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// claimStage records in volume.json, before anything is attached or mounted,
// that this node holds the volume at staging, and in the same locked update
// checks the fence: on a shared pool the other holder is another node, and a
// check made apart from the record would let two nodes both pass it. claimed
// tells whether this call added the record (a retried stage finds it there).
// The record also makes the controller refuse to delete the volume meanwhile.
func (d nodeServer) claimStage(ctx context.Context, nv layout.NodeVolume, staging string, readOnly bool) (claimed bool, err error) {
	err = updateVolume(ctx, nv.Pool, nv.ID, func(v *pool.Volume) (bool, error) {
		if err := d.layoutOf(v.Layout).Fence(v, d.opts.NodeID, readOnly); err != nil {
			return false, csierr.Failf(csierr.ErrInUse, "refusing to stage here (node %s): %w", d.opts.NodeID, err)
		}
		for _, s := range v.Staged {
			if s.Node == d.opts.NodeID {
				return false, nil // recordStage updates it once the stage is done
			}
		}
		v.SetStaged(d.opts.NodeID, staging, readOnly, time.Now())
		claimed = true
		return true, nil
	})
	return claimed, err
}

// recordStage makes this node's stage record say staging and readOnly, after a
// stage that found an older record of this node.
func (d nodeServer) recordStage(ctx context.Context, nv layout.NodeVolume, staging string, readOnly bool) error {
	return updateVolume(ctx, nv.Pool, nv.ID, func(v *pool.Volume) (bool, error) {
		for _, s := range v.Staged {
			if s.Node == d.opts.NodeID && s.Path == staging && s.ReadOnly == readOnly {
				return false, nil
			}
		}
		v.SetStaged(d.opts.NodeID, staging, readOnly, time.Now())
		return true, nil
	})
}

// unclaimStage takes back a claim whose stage failed, so it fences nothing.
func (d nodeServer) unclaimStage(ctx context.Context, nv layout.NodeVolume) {
	err := updateVolume(ctx, nv.Pool, nv.ID, func(v *pool.Volume) (bool, error) {
		before := len(v.Staged)
		v.ClearStaged(d.opts.NodeID)
		return len(v.Staged) != before, nil
	})
	if err != nil {
		klog.FromContext(ctx).Error(err, "Taking back the stage record of a failed stage", "volume", nv.ID)
	}
}

// updateVolume is pool.Update with its error mapped to a gRPC code.
func updateVolume(ctx context.Context, p *pool.Pool, id pool.VolumeID, change func(*pool.Volume) (bool, error)) error {
	return p.Update(ctx, id, change)
}

func (d nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (_ *csi.NodeUnstageVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	staging, err := d.RequestPath("staging_target_path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	rq, err := d.resolve(ctx, rpcNodeUnstageVolume, req.GetVolumeId(), poolset.Access{}, nil)
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p := rq.id, rq.pool
	image := p.ImagePath(vid)
	if err := d.fenceIfTaken(ctx, p, vid, image, staging); err != nil {
		return nil, err
	}
	if err := d.Mounts.UnmountChecked(ctx, staging, d.OnlyVolume(p, vid, "staging path", staging)); err != nil {
		return nil, fmt.Errorf("unmount %s: %w", staging, err)
	}
	if err := d.detachIfOurs(ctx, p, vid, image); err != nil {
		return nil, err
	}
	// Only now: a record goes once the kernel shows its device gone.
	d.ForgetStages(ctx, vid)
	err = updateVolume(ctx, p, vid, func(v *pool.Volume) (bool, error) {
		before := len(v.Staged)
		v.ClearStaged(d.opts.NodeID)
		return len(v.Staged) != before, nil
	})
	if err != nil && !csierr.Gone(err) {
		if cerr := p.Check(); cerr == nil || !p.Shared() {
			return nil, err
		}
		// Nothing of the volume is left on this node, but the pool does not
		// answer (a node cut off from it, rejoining). Its stage record is
		// left: it keeps fencing the volume, which is safe, until a
		// controller force-detaches it once this node's lease has expired.
		klog.FromContext(ctx).Error(err, "Unstaged volume on this node; its stage record stays in the pool, which does not answer", "volume", vid, "path", staging)
	}
	d.conditions.forget(vid.String())
	klog.FromContext(ctx).Info("Unstaged volume", "volume", vid, "path", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// detachIfOurs detaches the volume's loop device once nothing mounts it, or
// when this node's stage record says the device is this stage's (a mount still
// on it then fails the detach, and the call is retried). A device that is
// mounted and that this node never recorded belongs to something else (two
// node plugins on one kernel in tests, or an operator) and is left alone.
func (d nodeServer) detachIfOurs(ctx context.Context, p *pool.Pool, vid pool.VolumeID, image string) error {
	// Detach itself refuses a device that is still mounted (it reads the mount
	// table for that, so this does not read it again first).
	err := d.Loops.Detach(ctx, image)
	if errors.Is(err, mount.ErrDeviceBusy) {
		v, lerr := p.Load(vid)
		recorded := lerr != nil // unreadable metadata: act as before, fail the detach
		for _, s := range v.GetStaged() {
			recorded = recorded || s.Node == d.opts.NodeID
		}
		if !recorded {
			klog.FromContext(ctx).Info("Not detaching a loop device this node did not stage", "volume", vid, "reason", err.Error())
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("detach loop device of %s: %w", image, err)
	}
	return nil
}

func (d nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (_ *csi.NodePublishVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	target, err := d.RequestPath("target_path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	if err := d.checkNesting("target_path", target); err != nil {
		return nil, err
	}
	if ephemeral.Requested(req.GetVolumeContext()) {
		if err := d.inline.Publish(ctx, req, target); err != nil {
			return nil, err
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	return d.publishPersistent(ctx, req, target)
}

// publishPersistent publishes a volume of a pool, staged before, by its ID.
func (d nodeServer) publishPersistent(ctx context.Context, req *csi.NodePublishVolumeRequest, target string) (*csi.NodePublishVolumeResponse, error) {
	staging, err := d.RequestPath("staging_target_path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	if how := nestedIn(target, staging); how != "" {
		return nil, csierr.Failf(csierr.ErrInvalid, "target_path %q is %s staging_target_path %q: a volume is never published onto, inside or over its own stage", target, how, staging)
	}
	// Its stage mounted the share: the front hall mounts nothing here.
	nv, release, err := d.nodeVolume(ctx, rpcNodePublishVolume, req.GetVolumeId(), req.GetVolumeCapability(), poolset.Access{})
	if err != nil {
		return nil, err
	}
	defer release()
	readOnly := req.GetReadonly() || nv.Caps.ReadOnly()
	if err := d.layoutOf(nv.Vol.Layout).Publish(ctx, nv, staging, target, readOnly, req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	podUID, err := params.PodUID(req.GetVolumeContext())
	if err != nil {
		klog.FromContext(ctx).Info("Pod UID is not a UUID: its pod is not held to the volume's I/O limits", "key", params.PodUIDKey, "err", err)
	}
	d.throttle.Track(ctx, nv, target, podUID)
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (_ *csi.NodeUnpublishVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	target, err := d.RequestPath("target_path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	if pool.IsEphemeralHandle(req.GetVolumeId()) {
		if err := d.inline.Unpublish(ctx, req.GetVolumeId(), target); err != nil {
			return nil, err
		}
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	// The volume's pool, to tell its mounts from others: a volume whose pool
	// is unknown here (nil) has none.
	rq, err := d.resolve(ctx, rpcNodeUnpublishVolume, req.GetVolumeId(), poolset.Access{}, nil)
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p := rq.id, rq.pool
	if err := d.Mounts.UnmountChecked(ctx, target, d.OnlyVolume(p, vid, "target path", target)); err != nil {
		return nil, fmt.Errorf("unmount %s: %w", target, err)
	}
	d.conditions.forget(vid.String())
	d.throttle.Untrack(target)
	klog.FromContext(ctx).Info("Unpublished volume", "volume", vid, "target", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// KickIOLimits re-applies the I/O limits of the volumes published on this node now,
// rather than at the next --io-limits-interval: the local agent calls it after a
// ControllerModifyVolume it carried out for the central controller.
func (d nodeServer) KickIOLimits() { d.throttle.Kick() }
