package layout

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// imageLayout is a sparse image file attached through a loop device: exact
// size, one writer node, Filesystem or Block access.
type imageLayout struct{ *Deps }

// imageModes are the access modes an image volume can honour: one writer node, or
// read-only on many. Two nodes writing one filesystem image would corrupt it.
var imageModes = map[csi.VolumeCapability_AccessMode_Mode]bool{
	csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER:        true,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:   true,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER: true,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:  true,
	csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:    true,
}

func (imageLayout) Allowed(s params.Caps) error {
	for _, m := range s.Modes {
		if !imageModes[m] {
			return csierr.Failf(csierr.ErrInvalid, "access mode %s is not supported by image volumes (single-node writer or multi-node read-only); use layout dir for multi-node writers", m)
		}
	}
	return nil
}

func (imageLayout) MinSize(s params.Caps) int64 {
	if s.Access == pool.AccessBlock {
		return mount.MinSize("")
	}
	return mount.MinSize(s.FSType)
}

func (imageLayout) FSType(s params.Caps) string {
	if s.Access == pool.AccessBlock {
		return ""
	}
	return s.FSType
}

func (imageLayout) SameFS(s params.Caps, fsType string) bool {
	return s.Access != pool.AccessFilesystem || s.FSType == "" || s.FSType == fsType
}

func (imageLayout) VolumeContext(*pool.Volume, map[string]string) {}

func (imageLayout) MountFS(v *pool.Volume) string { return v.FSType }

// delete removes an image volume that is not attached on this node.
func (d imageLayout) Delete(ctx context.Context, p *pool.Pool, vid pool.VolumeID, _ *pool.Volume) error {
	dev, ok, err := d.AttachedDevice(p.ImagePath(vid))
	if err != nil {
		// Not knowing whether a loop device holds the image is not knowing
		// whether a pod still writes to it: nothing is deleted on a guess.
		return fmt.Errorf("volume %s is not deleted: %w", vid, err)
	}
	if ok {
		return csierr.Failf(csierr.ErrInUse, "volume %s is attached on this node as %s; unstage it before deleting", vid, dev)
	}
	return p.Delete(ctx, vid)
}

// fence: an image volume is one filesystem image, so any writer excludes every
// other node, readers included, since a reader of a filesystem another node is
// writing sees it corrupt.
// Publish records and stage records both hold a node: a node that staged the
// volume without ControllerPublishVolume (a CO that skips it) fences it too.
func (imageLayout) Fence(v *pool.Volume, node string, readOnly bool) error {
	for _, r := range v.Published {
		if r.Node == node {
			continue
		}
		if !r.ReadOnly || !readOnly {
			return csierr.Failf(csierr.ErrInUse,
				"volume %s is published to node %s (read-only=%t) since %s; an image volume held read-write can be on one node only. Unpublish it there first (for a dead node see docs/fencing.md)",
				v.ID, r.Node, r.ReadOnly, r.At.Format(time.RFC3339))
		}
	}
	for _, s := range v.Staged {
		if s.Node == node {
			continue
		}
		if !s.ReadOnly || !readOnly {
			return csierr.Failf(csierr.ErrInUse,
				"volume %s is staged on node %s at %s (read-only=%t) since %s; an image volume held read-write can be on one node only. Unstage it there first (for a dead node see docs/fencing.md)",
				v.ID, s.Node, s.Path, s.ReadOnly, s.At.Format(time.RFC3339))
		}
	}
	return nil
}

// expand grows the image file and records the new size; the node grows the
// loop device and the filesystem.
func (d imageLayout) Expand(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error) {
	v, err := d.GrowImage(ctx, p, vid, v, r)
	if err != nil {
		return nil, err
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: true}, nil
}

// nodeExpansionRequired: an image volume's loop device (and filesystem) only
// grow on the node.
func (imageLayout) NodeExpansionRequired() bool { return true }

// finishCreate makes the image and formats it. Formatting the file before any node
// attaches it is faster (no loop device, ext4 skips zeroing inode tables) and
// means NodeStageVolume never formats a volume that should already hold data.
func (d imageLayout) FinishCreate(ctx context.Context, p *pool.Pool, v *pool.Volume) error {
	vid, _ := pool.ParseVolumeID(v.ID)
	if err := p.Images().Prepare(v); err != nil {
		return err
	}
	if v.AccessType == pool.AccessFilesystem {
		if err := d.format(ctx, p, vid, v.FSType); err != nil {
			if derr := p.Images().Discard(v); derr != nil {
				klog.FromContext(ctx).Error(derr, "Discarding the image after a failed mkfs", "volume", v.ID)
			}
			return fmt.Errorf("format volume %s as %s: %w", v.ID, v.FSType, err)
		}
	}
	if v.Preallocate {
		if err := p.Images().Allocate(ctx, v, d.FS.Allocate); err != nil {
			return err
		}
	}
	if err := p.Images().Sync(vid); err != nil {
		return err
	}
	if err := p.MarkReady(v); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Created volume", "volume", v.ID, "name", v.Name, "capacity", v.CapacityBytes, "fsType", v.FSType, "access", v.AccessType)
	return nil
}

// format makes a filesystem on a volume's image, through a descriptor opened
// without following links.
func (d imageLayout) format(ctx context.Context, p *pool.Pool, vid pool.VolumeID, fsType string) error {
	h, err := p.OpenImage(vid)
	if err != nil {
		return err
	}
	defer h.Close()
	return d.Devs.Format(ctx, h.Path(), fsType)
}

// cloneFrom copies an image (a snapshot's, or a volume's, frozen on whichever
// node has it staged read-write, as a snapshot's is) into the new volume's
// image, grown to its size. A source some node could not keep frozen for the
// whole copy fails the clone (retried): a copy of a filesystem being written
// is no filesystem anyone can trust.
func (d imageLayout) CloneFrom(ctx context.Context, p *pool.Pool, v *pool.Volume, src *ContentSource) error {
	var from *pool.Handle
	var err error
	thaw := func() error { return nil }
	if src.IsSnapshot() {
		from, err = p.Snapshots().OpenImage(src.SnapID)
	} else if thaw, err = d.Freeze(ctx, p, src.VolID, src.Vol); err == nil {
		if from, err = p.OpenImage(src.VolID); err != nil {
			_ = thaw()
		}
	}
	if err != nil {
		return fmt.Errorf("source of volume %s: %w", v.ID, err)
	}
	defer from.Close()
	method, err := p.Images().PrepareFrom(ctx, v, from.Path())
	if terr := thaw(); err == nil && terr != nil {
		err = terr
	}
	if err != nil {
		return fmt.Errorf("copy source of volume %s: %w", v.ID, err)
	}
	if v.Preallocate {
		if err := p.Images().Allocate(ctx, v, d.FS.Allocate); err != nil {
			return err
		}
	}
	if err := p.MarkReady(v); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Created volume from a copy", "volume", v.ID, "name", v.Name, "source", src.Record, "capacity", v.CapacityBytes, "copy", method)
	return nil
}

// growImage grows an image volume's file to the range asked (rounded as
// CreateVolume rounds) and records the new size.
func (d *Deps) GrowImage(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, r *csi.CapacityRange) (*pool.Volume, error) {
	size, err := pool.Capacity(r.GetRequiredBytes(), r.GetLimitBytes(), MinSizeOf(v))
	if err != nil {
		return nil, err
	}
	before := v.CapacityBytes
	v, err = p.Grow(ctx, vid, size, r.GetLimitBytes(), d.FS.Allocate)
	if err != nil {
		return nil, err
	}
	if v.CapacityBytes != before {
		klog.FromContext(ctx).Info("Expanded volume", "volume", vid, "from", before, "to", v.CapacityBytes)
	}
	return v, nil
}
