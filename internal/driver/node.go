package driver

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

var nodeCaps = []csi.NodeServiceCapability_RPC_Type{
	csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
	csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
	csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
	csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
	csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH,
}

func (d *Driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	out := make([]*csi.NodeServiceCapability, 0, len(nodeCaps))
	for _, c := range nodeCaps {
		out = append(out, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: c}},
		})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: out}, nil
}

func (d *Driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             d.opts.NodeID,
		MaxVolumesPerNode:  d.opts.MaxVolumesPerNode,
		AccessibleTopology: &csi.Topology{Segments: d.nodeTopology()},
	}, nil
}

// readOnlyMode tells whether an access mode only ever reads.
func readOnlyMode(m csi.VolumeCapability_AccessMode_Mode) bool {
	return m == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY ||
		m == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

// nodeVolume is what every node call resolves first: the volume, its pool and its
// parsed capability.
type nodeVolume struct {
	id   pool.VolumeID
	pool *pool.Pool
	vol  *pool.Volume
	caps capsSpec
}

// beginNodeCall checks the ID and capability every stage and publish carries,
// takes the volume's in-process lock and resolves the volume. The caller defers
// release.
func (d *Driver) beginNodeCall(method, volumeID string, vc *csi.VolumeCapability) (nodeVolume, func(), error) {
	if volumeID == "" {
		return nodeVolume{}, nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if vc == nil {
		return nodeVolume{}, nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	release, err := d.locks.acquire(volumeID, method)
	if err != nil {
		return nodeVolume{}, nil, err
	}
	nv, err := d.resolveNodeVolume(volumeID, vc)
	if err != nil {
		release()
		return nodeVolume{}, nil, err
	}
	return nv, release, nil
}

func (d *Driver) resolveNodeVolume(volumeID string, vc *csi.VolumeCapability) (nodeVolume, error) {
	var nv nodeVolume
	if vc == nil {
		return nv, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	caps, err := parseCaps([]*csi.VolumeCapability{vc}, "")
	if err != nil {
		return nv, err
	}
	nv.caps = caps
	if nv.id, nv.pool, err = d.volumeRef(volumeID); err != nil {
		return nv, err
	}
	if nv.vol, err = loadVolume(nv.pool, nv.id); err != nil {
		return nv, err
	}
	if err := caps.compatible(nv.vol); err != nil {
		return nv, status.Error(codes.FailedPrecondition, err.Error())
	}
	return nv, nil
}

func (d *Driver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	staging, err := cleanPath("staging_target_path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	nv, release, err := d.beginNodeCall("NodeStageVolume", req.GetVolumeId(), req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	defer release()
	if nv.vol.Layout == pool.LayoutDir {
		if err := d.stageDir(ctx, nv, staging, req.GetVolumeCapability()); err != nil {
			return nil, err
		}
		if err := d.recordStage(ctx, nv, staging); err != nil {
			return nil, err
		}
		return &csi.NodeStageVolumeResponse{}, nil
	}
	if err := d.nodeFence(nv, readOnlyMode(req.GetVolumeCapability().GetAccessMode().GetMode())); err != nil {
		return nil, err
	}
	image := nv.pool.ImagePath(nv.id)
	if _, err := nv.pool.ImageSize(nv.id); err != nil {
		return nil, grpcError(err)
	}
	if nv.caps.access == pool.AccessBlock {
		dev, err := d.loops.Attach(ctx, image)
		if err != nil {
			return nil, grpcError(fmt.Errorf("attach %s: %w", image, err))
		}
		if _, err := d.refreshLoop(nv.pool, nv.id, dev, nv.vol); err != nil {
			return nil, err
		}
	} else if err := d.stageFilesystem(ctx, nv, image, staging, req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	if err := d.recordStage(ctx, nv, staging); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// stageFilesystem converges the staging path to "the volume's filesystem is mounted
// here" from whatever state a previous, possibly interrupted, call left.
func (d *Driver) stageFilesystem(ctx context.Context, nv nodeVolume, image, staging string, vc *csi.VolumeCapability) error {
	readOnly := readOnlyMode(vc.GetAccessMode().GetMode())
	info, mounted, err := d.mounts.Info(staging)
	if err != nil {
		return grpcError(fmt.Errorf("inspect %s: %w", staging, err))
	}
	if mounted {
		if !d.isVolumeMount(info, image) {
			return status.Errorf(codes.AlreadyExists, "staging path %s already holds another mount (%s)", staging, info.Source)
		}
		if info.ReadOnly != readOnly {
			return status.Errorf(codes.AlreadyExists, "volume %s is staged at %s with read-only=%v, the request asks read-only=%v", nv.id, staging, info.ReadOnly, readOnly)
		}
		return nil
	}
	dev, err := d.loops.Attach(ctx, image)
	if err != nil {
		return grpcError(fmt.Errorf("attach %s: %w", image, err))
	}
	found, err := d.devs.DiskFormat(ctx, dev)
	if err != nil {
		return grpcError(fmt.Errorf("inspect %s: %w", dev, err))
	}
	switch found {
	case "":
		// Volumes are formatted at CreateVolume; a blank one was made by an older
		// version or lost its mkfs. Blank means no data, so formatting is safe.
		if err := d.devs.Format(ctx, dev, nv.vol.FSType); err != nil {
			return grpcError(fmt.Errorf("format %s: %w", dev, err))
		}
	case nv.vol.FSType:
	default:
		return status.Errorf(codes.FailedPrecondition, "volume %s should hold %s but %s holds %s; refusing to mount or format it", nv.id, nv.vol.FSType, dev, found)
	}
	growth, err := d.growBeforeMount(ctx, nv, dev, readOnly)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return grpcError(fmt.Errorf("create staging path: %w", err))
	}
	opts := slices.Clone(vc.GetMount().GetMountFlags())
	if readOnly {
		opts = append(opts, "ro")
	}
	if nv.vol.FSType == "xfs" && !slices.Contains(opts, "nouuid") {
		// A clone or restored snapshot has its source's filesystem UUID, and XFS
		// refuses a second mount of one UUID on a node. nouuid changes nothing else.
		opts = append(opts, "nouuid")
	}
	if err := d.mounts.Mount(ctx, dev, staging, nv.vol.FSType, opts); err != nil {
		if derr := d.loops.Detach(ctx, image); derr != nil {
			klog.FromContext(ctx).Error(derr, "Detach after failed mount", "device", dev)
		}
		return grpcError(fmt.Errorf("mount %s at %s: %w", dev, staging, err))
	}
	d.growAfterMount(ctx, growth, nv, dev, staging)
	klog.FromContext(ctx).Info("Staged volume", "volume", nv.id, "device", dev, "path", staging, "fsType", nv.vol.FSType)
	return nil
}

// isVolumeMount tells whether a mount comes from the loop device backed by image.
func (d *Driver) isVolumeMount(info mount.MountInfo, image string) bool {
	dev, ok, err := d.loops.Find(image)
	return err == nil && ok && dev == info.Source
}

// recordStage notes in volume.json that this node holds the volume, so the
// controller refuses to delete it meanwhile.
func (d *Driver) recordStage(ctx context.Context, nv nodeVolume, staging string) error {
	return d.updateVolume(ctx, nv.pool, nv.id, func(v *pool.Volume) (bool, error) {
		for _, s := range v.Staged {
			if s.Node == d.opts.NodeID && s.Path == staging {
				return false, nil
			}
		}
		v.SetStaged(d.opts.NodeID, staging, time.Now())
		return true, nil
	})
}

// updateVolume is pool.Update with its error mapped to a gRPC code.
func (d *Driver) updateVolume(ctx context.Context, p *pool.Pool, id pool.VolumeID, change func(*pool.Volume) (bool, error)) error {
	return grpcError(p.Update(ctx, id, change))
}

func (d *Driver) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	staging, err := cleanPath("staging_target_path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	vid, p, release, err := d.lockVolumeRef(req.GetVolumeId(), "NodeUnstageVolume")
	if err != nil {
		return nil, err
	}
	defer release()
	image := p.ImagePath(vid)
	if info, mounted, err := d.mounts.Info(staging); err != nil {
		return nil, grpcError(fmt.Errorf("inspect %s: %w", staging, err))
	} else if mounted && !d.isVolumeMount(info, image) && !d.mounts.SameDir(staging, p.DataPath(vid)) {
		return nil, status.Errorf(codes.FailedPrecondition, "staging path %s holds %s, not volume %s; refusing to unmount it", staging, info.Source, vid)
	}
	if err := d.mounts.Unmount(ctx, staging); err != nil {
		return nil, grpcError(fmt.Errorf("unmount %s: %w", staging, err))
	}
	if err := d.loops.Detach(ctx, image); err != nil {
		return nil, grpcError(fmt.Errorf("detach loop device of %s: %w", image, err))
	}
	err = d.updateVolume(ctx, p, vid, func(v *pool.Volume) (bool, error) {
		before := len(v.Staged)
		v.ClearStaged(d.opts.NodeID)
		return len(v.Staged) != before, nil
	})
	if err != nil && status.Code(err) != codes.NotFound {
		return nil, err
	}
	klog.FromContext(ctx).Info("Unstaged volume", "volume", vid, "path", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	target, err := cleanPath("target_path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	staging, err := cleanPath("staging_target_path", req.GetStagingTargetPath())
	if err != nil {
		return nil, err
	}
	nv, release, err := d.beginNodeCall("NodePublishVolume", req.GetVolumeId(), req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	defer release()
	readOnly := req.GetReadonly() || readOnlyMode(req.GetVolumeCapability().GetAccessMode().GetMode())
	if nv.vol.Layout == pool.LayoutDir {
		if err := d.publishDir(ctx, nv, staging, target, readOnly, req.GetVolumeCapability()); err != nil {
			return nil, err
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	image := nv.pool.ImagePath(nv.id)

	var source string
	if nv.caps.access == pool.AccessBlock {
		dev, ok, err := d.loops.Find(image)
		if err != nil || !ok {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged on this node (no loop device for %s)", nv.id, image)
		}
		source = dev
	} else {
		info, mounted, err := d.mounts.Info(staging)
		if err != nil {
			return nil, grpcError(fmt.Errorf("inspect %s: %w", staging, err))
		}
		if !mounted || !d.isVolumeMount(info, image) {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged at %s; call NodeStageVolume first", nv.id, staging)
		}
		source = staging
	}
	if done, err := d.alreadyPublished(nv, image, target, readOnly); done || err != nil {
		if err != nil {
			return nil, err
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if req.GetVolumeCapability().GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		if err := d.singleWriterFree(nv, image, staging, target); err != nil {
			return nil, err
		}
	}
	if nv.caps.access == pool.AccessBlock {
		if err := d.setBlockReadOnly(source, target, readOnly); err != nil {
			return nil, err
		}
		err = d.mounts.BindBlock(ctx, source, target, readOnly)
	} else {
		err = d.mounts.Bind(ctx, source, target, readOnly, req.GetVolumeCapability().GetMount().GetMountFlags())
	}
	if err != nil {
		return nil, grpcError(fmt.Errorf("publish volume %s at %s: %w", nv.id, target, err))
	}
	klog.FromContext(ctx).Info("Published volume", "volume", nv.id, "target", target, "readOnly", readOnly)
	return &csi.NodePublishVolumeResponse{}, nil
}

// singleWriterFree enforces ReadWriteOncePod: the volume may be published at one
// target only.
func (d *Driver) singleWriterFree(nv nodeVolume, image, staging, target string) error {
	dev, ok, err := d.loops.Find(image)
	if err != nil || !ok {
		return status.Errorf(codes.FailedPrecondition, "volume %s is not attached on this node", nv.id)
	}
	points, err := d.mounts.MountPoints(dev)
	if err != nil {
		return grpcError(fmt.Errorf("list mounts of %s: %w", dev, err))
	}
	for _, p := range points {
		if p != staging && p != target {
			return status.Errorf(codes.FailedPrecondition, "volume %s has access mode SINGLE_NODE_SINGLE_WRITER and is already published at %s", nv.id, p)
		}
	}
	return nil
}

// alreadyPublished answers a repeated NodePublishVolume: done when the target
// already shows this volume the same way, ALREADY_EXISTS when it shows it
// differently or shows something else.
func (d *Driver) alreadyPublished(nv nodeVolume, image, target string, readOnly bool) (bool, error) {
	info, mounted, err := d.mounts.Info(target)
	if err != nil {
		return false, grpcError(fmt.Errorf("inspect %s: %w", target, err))
	}
	if !mounted {
		return false, nil
	}
	dev, ok, _ := d.loops.Find(image)
	same := ok && (info.Source == dev || d.mounts.IsDevice(info.Target, dev))
	if !same {
		return false, status.Errorf(codes.AlreadyExists, "target path %s already holds another mount (%s)", target, info.Source)
	}
	if info.ReadOnly != readOnly {
		return false, status.Errorf(codes.AlreadyExists, "volume %s is published at %s with read-only=%v, the request asks read-only=%v", nv.id, target, info.ReadOnly, readOnly)
	}
	return true, nil
}

func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	target, err := cleanPath("target_path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	vid, err := parseVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	release, err := d.locks.acquire(vid.String(), "NodeUnpublishVolume")
	if err != nil {
		return nil, err
	}
	defer release()
	if err := d.mounts.Unmount(ctx, target); err != nil {
		return nil, grpcError(fmt.Errorf("unmount %s: %w", target, err))
	}
	klog.FromContext(ctx).Info("Unpublished volume", "volume", vid, "target", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}
