package driver

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// imageLayout is a sparse image file attached through a loop device: exact
// size, one writer node, Filesystem or Block access.
type imageLayout struct{ *Driver }

// stage attaches the image and, for Filesystem access, mounts its filesystem
// at the staging path, growing it first if it was expanded while unstaged.
func (d imageLayout) stage(ctx context.Context, nv nodeVolume, staging string, vc *csi.VolumeCapability) error {
	// The image is opened without following links, and attached, inspected and
	// mounted through that descriptor: nothing outside the pool is ever
	// attached or formatted, whatever was put in the volume's directory.
	h, err := nv.pool.OpenImage(nv.id)
	if err != nil {
		return err
	}
	defer h.Close()
	image := h.Path()
	if nv.caps.access == pool.AccessBlock {
		dev, err := d.attach(ctx, nv, image)
		if err != nil {
			return err
		}
		if _, err := d.refreshLoop(ctx, nv.pool, nv.id, dev, nv.vol); err != nil {
			return err
		}
	} else if err := d.stageFilesystem(ctx, nv, image, staging, vc); err != nil {
		return err
	}
	return nil
}

// publish bind-mounts the staged filesystem, or the loop device node, at the
// target.
func (d imageLayout) publish(ctx context.Context, nv nodeVolume, staging, target string, readOnly bool, vc *csi.VolumeCapability) error {
	image := nv.pool.ImagePath(nv.id)

	var source string
	if nv.caps.access == pool.AccessBlock {
		dev, ok, err := d.attachedDevice(image)
		if err != nil {
			return err
		}
		if !ok {
			return failf(errNotStaged, "volume %s is not staged on this node (no loop device for %s)", nv.id, image)
		}
		source = dev
	} else {
		info, mounted, err := d.mounts.Info(staging)
		if err != nil {
			return fmt.Errorf("inspect %s: %w", staging, err)
		}
		ours := false
		if mounted {
			if ours, err = d.isVolumeMount(info, image); err != nil {
				return err
			}
		}
		if !ours {
			return failf(errNotStaged, "volume %s is not staged at %s; call NodeStageVolume first", nv.id, staging)
		}
		source = staging
	}
	if done, err := d.alreadyPublished(nv, image, target, readOnly); done || err != nil {
		return err
	}
	if vc.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		if err := d.singleWriterFree(nv, image, staging, target); err != nil {
			return err
		}
	}
	var err error
	if nv.caps.access == pool.AccessBlock {
		if err := d.setBlockReadOnly(source, target, readOnly); err != nil {
			return err
		}
		err = d.mounts.BindBlock(ctx, source, target, readOnly)
	} else {
		err = d.mounts.Bind(ctx, source, target, readOnly, mount.BindOptions(vc.GetMount().GetMountFlags()))
	}
	if err != nil {
		return fmt.Errorf("publish volume %s at %s: %w", nv.id, target, err)
	}
	klog.FromContext(ctx).Info("Published volume", "volume", nv.id, "target", target, "readOnly", readOnly)
	return nil
}

// imageModes are the access modes an image volume can honour: one writer node, or
// read-only on many. Two nodes writing one filesystem image would corrupt it.
var imageModes = map[csi.VolumeCapability_AccessMode_Mode]bool{
	csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER:        true,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:   true,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER: true,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:  true,
	csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:    true,
}

func (imageLayout) allowed(s capsSpec) error {
	for _, m := range s.modes {
		if !imageModes[m] {
			return failf(errInvalid, "access mode %s is not supported by image volumes (single-node writer or multi-node read-only); use layout dir for multi-node writers", m)
		}
	}
	return nil
}

func (imageLayout) minSize(s capsSpec) int64 {
	if s.access == pool.AccessBlock {
		return mount.MinSize("")
	}
	return mount.MinSize(s.fsType)
}

func (imageLayout) fsType(s capsSpec) string {
	if s.access == pool.AccessBlock {
		return ""
	}
	return s.fsType
}

func (imageLayout) sameFS(s capsSpec, fsType string) bool {
	return s.access != pool.AccessFilesystem || s.fsType == "" || s.fsType == fsType
}

func (imageLayout) volumeContext(*pool.Volume, map[string]string) {}

func (imageLayout) mountFS(v *pool.Volume) string { return v.FSType }

// attachedDevice is loops.Find with its failure (a scan of the loop devices
// that failed) as UNAVAILABLE: not knowing which device holds an image is no
// answer that none does, so it must never read as "not attached" (NOT_FOUND,
// a publish refused as a foreign mount, a detached-device condition).
func (d *Driver) attachedDevice(image string) (string, bool, error) {
	dev, ok, err := d.loops.Find(image)
	if err != nil {
		return "", false, failf(pool.ErrUnavailable, "cannot tell which loop device holds %s (retry): %w", image, err)
	}
	return dev, ok, nil
}

// delete removes an image volume that is not attached on this node.
func (d imageLayout) delete(ctx context.Context, p *pool.Pool, vid pool.VolumeID, _ *pool.Volume) error {
	dev, ok, err := d.attachedDevice(p.ImagePath(vid))
	if err != nil {
		// Not knowing whether a loop device holds the image is not knowing
		// whether a pod still writes to it: nothing is deleted on a guess.
		return fmt.Errorf("volume %s is not deleted: %w", vid, err)
	}
	if ok {
		return failf(errInUse, "volume %s is attached on this node as %s; unstage it before deleting", vid, dev)
	}
	return p.Delete(ctx, vid)
}

// fence: an image volume is one filesystem image, so any writer excludes every
// other node, readers included, since a reader of a filesystem another node is
// writing sees it corrupt.
// Publish records and stage records both hold a node: a node that staged the
// volume without ControllerPublishVolume (a CO that skips it) fences it too.
func (imageLayout) fence(v *pool.Volume, node string, readOnly bool) error {
	for _, r := range v.Published {
		if r.Node == node {
			continue
		}
		if !r.ReadOnly || !readOnly {
			return failf(errInUse,
				"volume %s is published to node %s (read-only=%t) since %s; an image volume held read-write can be on one node only. Unpublish it there first (for a dead node see docs/fencing.md)",
				v.ID, r.Node, r.ReadOnly, r.At.Format(time.RFC3339))
		}
	}
	for _, s := range v.Staged {
		if s.Node == node {
			continue
		}
		if !s.ReadOnly || !readOnly {
			return failf(errInUse,
				"volume %s is staged on node %s at %s (read-only=%t) since %s; an image volume held read-write can be on one node only. Unstage it there first (for a dead node see docs/fencing.md)",
				v.ID, s.Node, s.Path, s.ReadOnly, s.At.Format(time.RFC3339))
		}
	}
	return nil
}

// expand grows the image file and records the new size; the node grows the
// loop device and the filesystem.
func (d imageLayout) expand(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error) {
	v, err := d.growImage(ctx, p, vid, v, r)
	if err != nil {
		return nil, err
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: true}, nil
}

// nodeExpansionRequired: an image volume's loop device (and filesystem) only
// grow on the node.
func (imageLayout) nodeExpansionRequired() bool { return true }

// stageFilesystem converges the staging path to "the volume's filesystem is mounted
// here" from whatever state a previous, possibly interrupted, call left.
func (d imageLayout) stageFilesystem(ctx context.Context, nv nodeVolume, image, staging string, vc *csi.VolumeCapability) error {
	readOnly := readOnlyMode(vc.GetAccessMode().GetMode())
	info, mounted, err := d.mounts.Info(staging)
	if err != nil {
		return fmt.Errorf("inspect %s: %w", staging, err)
	}
	if mounted {
		ours, err := d.isVolumeMount(info, image)
		if err != nil {
			return err
		}
		if !ours {
			return failf(errPathTaken, "staging path %s already holds another mount (%s)", staging, info.Source)
		}
		if info.ReadOnly != readOnly {
			return failf(errPathTaken, "volume %s is staged at %s with read-only=%v, the request asks read-only=%v", nv.id, staging, info.ReadOnly, readOnly)
		}
		return nil
	}
	dev, err := d.attach(ctx, nv, image)
	if err != nil {
		return err
	}
	found, err := d.devs.DiskFormat(ctx, dev)
	if err != nil {
		return fmt.Errorf("inspect %s: %w", dev, err)
	}
	switch found {
	case "":
		// Volumes are formatted at CreateVolume; a blank one was made by an older
		// version or lost its mkfs. Blank means no data, so formatting is safe.
		if err := d.devs.Format(ctx, dev, nv.vol.FSType); err != nil {
			return fmt.Errorf("format %s: %w", dev, err)
		}
	case nv.vol.FSType:
	default:
		return failf(errState, "volume %s should hold %s but %s holds %s; refusing to mount or format it", nv.id, nv.vol.FSType, dev, found)
	}
	growth, err := d.growBeforeMount(ctx, nv, dev, readOnly)
	if err != nil {
		return err
	}
	// The staging path is made by the mount itself, below the allowed
	// directory without links (internal/mount/beneath.go).
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
		return fmt.Errorf("mount %s at %s: %w", dev, staging, err)
	}
	d.growAfterMount(ctx, growth, nv, dev, staging)
	klog.FromContext(ctx).Info("Staged volume", "volume", nv.id, "device", dev, "path", staging, "fsType", nv.vol.FSType)
	return nil
}

// singleWriterFree enforces ReadWriteOncePod: the volume may be published at one
// target only.
func (d imageLayout) singleWriterFree(nv nodeVolume, image, staging, target string) error {
	dev, ok, err := d.loops.Find(image)
	if err != nil || !ok {
		return failf(errNotStaged, "volume %s is not attached on this node", nv.id)
	}
	points, err := d.mounts.MountPoints(dev)
	if err != nil {
		return fmt.Errorf("list mounts of %s: %w", dev, err)
	}
	for _, p := range points {
		if p != staging && p != target {
			return failf(errInUse, "volume %s has access mode SINGLE_NODE_SINGLE_WRITER and is already published at %s", nv.id, p)
		}
	}
	return nil
}

// alreadyPublished answers a repeated NodePublishVolume: done when the target
// already shows this volume the same way, ALREADY_EXISTS when it shows it
// differently or shows something else.
func (d imageLayout) alreadyPublished(nv nodeVolume, image, target string, readOnly bool) (bool, error) {
	info, mounted, err := d.mounts.Info(target)
	if err != nil {
		return false, fmt.Errorf("inspect %s: %w", target, err)
	}
	if !mounted {
		return false, nil
	}
	dev, ok, err := d.attachedDevice(image)
	if err != nil {
		return false, err
	}
	same := ok && (info.Source == dev || d.mounts.IsDevice(info.Target, dev))
	if !same {
		return false, failf(errPathTaken, "target path %s already holds another mount (%s)", target, info.Source)
	}
	if info.ReadOnly != readOnly {
		return false, failf(errPathTaken, "volume %s is published at %s with read-only=%v, the request asks read-only=%v", nv.id, target, info.ReadOnly, readOnly)
	}
	return true, nil
}

// attach attaches the volume's image (or finds it attached) and refuses a
// device this node fenced: it maps nothing any more, and the volume may be
// another node's now. Only an unstage (a detach) clears it.
func (d imageLayout) attach(ctx context.Context, nv nodeVolume, image string) (string, error) {
	dev, err := d.loops.Attach(ctx, image)
	if err != nil {
		return "", fmt.Errorf("attach %s: %w", image, err)
	}
	if fenced, err := d.loops.Fenced(dev); err == nil && fenced {
		return "", failf(errFenced, "volume %s: its loop device %s on node %s was fenced when the node could not renew its lease in pool %s; unstage it (delete the pod using it) before it can be staged again", nv.id, dev, d.opts.NodeID, nv.pool.Name)
	}
	return dev, nil
}
