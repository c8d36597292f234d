package layout

import (
	"context"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// stage attaches the image and, for Filesystem access, mounts its filesystem
// at the staging path, growing it first if it was expanded while unstaged.
func (d imageLayout) Stage(ctx context.Context, nv NodeVolume, staging string, vc *csi.VolumeCapability) error {
	// The image is opened without following links, and attached, inspected and
	// mounted through that descriptor: nothing outside the pool is ever
	// attached or formatted, whatever was put in the volume's directory.
	h, err := nv.Pool.OpenImage(nv.ID)
	if err != nil {
		return err
	}
	defer h.Close()
	image := h.Path()
	if nv.Caps.Access == pool.AccessBlock {
		dev, err := d.attach(ctx, nv, image)
		if err != nil {
			return err
		}
		if _, err := d.RefreshLoop(ctx, nv.Pool, nv.ID, dev, nv.Vol); err != nil {
			return err
		}
	} else if err := d.stageFilesystem(ctx, nv, image, staging, vc); err != nil {
		return err
	}
	return nil
}

// publish bind-mounts the staged filesystem, or the loop device node, at the
// target.
func (d imageLayout) Publish(ctx context.Context, nv NodeVolume, staging, target string, readOnly bool, vc *csi.VolumeCapability) error {
	image := nv.Pool.ImagePath(nv.ID)

	var source string
	if nv.Caps.Access == pool.AccessBlock {
		dev, ok, err := d.AttachedDevice(image)
		if err != nil {
			return err
		}
		if !ok {
			return csierr.Failf(csierr.ErrNotStaged, "volume %s is not staged on this node (no loop device for %s)", nv.ID, image)
		}
		source = dev
	} else {
		info, mounted, err := d.Mounts.Info(staging)
		if err != nil {
			return fmt.Errorf("inspect %s: %w", staging, err)
		}
		ours := false
		if mounted {
			if ours, err = d.IsVolumeMount(info, image); err != nil {
				return err
			}
		}
		if !ours {
			return csierr.Failf(csierr.ErrNotStaged, "volume %s is not staged at %s; call NodeStageVolume first", nv.ID, staging)
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
	if nv.Caps.Access == pool.AccessBlock {
		if err := d.SetBlockReadOnly(source, target, readOnly); err != nil {
			return err
		}
		err = d.Mounts.BindBlock(ctx, source, target, readOnly)
	} else {
		err = d.Mounts.Bind(ctx, source, target, readOnly, mount.BindOptions(vc.GetMount().GetMountFlags()))
	}
	if err != nil {
		return fmt.Errorf("publish volume %s at %s: %w", nv.ID, target, err)
	}
	klog.FromContext(ctx).Info("Published volume", "volume", nv.ID, "target", target, "readOnly", readOnly)
	return nil
}

// stageFilesystem converges the staging path to "the volume's filesystem is mounted
// here" from whatever state a previous, possibly interrupted, call left.
func (d imageLayout) stageFilesystem(ctx context.Context, nv NodeVolume, image, staging string, vc *csi.VolumeCapability) error {
	readOnly := params.ReadOnlyMode(vc.GetAccessMode().GetMode())
	info, mounted, err := d.Mounts.Info(staging)
	if err != nil {
		return fmt.Errorf("inspect %s: %w", staging, err)
	}
	if mounted {
		ours, err := d.IsVolumeMount(info, image)
		if err != nil {
			return err
		}
		if !ours {
			return csierr.Failf(csierr.ErrPathTaken, "staging path %s already holds another mount (%s)", staging, info.Source)
		}
		if info.ReadOnly != readOnly {
			return csierr.Failf(csierr.ErrPathTaken, "volume %s is staged at %s with read-only=%v, the request asks read-only=%v", nv.ID, staging, info.ReadOnly, readOnly)
		}
		return nil
	}
	dev, err := d.attach(ctx, nv, image)
	if err != nil {
		return err
	}
	found, err := d.Devs.DiskFormat(ctx, dev)
	if err != nil {
		return fmt.Errorf("inspect %s: %w", dev, err)
	}
	switch found {
	case "":
		// Volumes are formatted at CreateVolume; a blank one was made by an older
		// version or lost its mkfs. Blank means no data, so formatting is safe.
		if err := d.Devs.Format(ctx, dev, nv.Vol.FSType); err != nil {
			return fmt.Errorf("format %s: %w", dev, err)
		}
	case nv.Vol.FSType:
	default:
		return csierr.Failf(csierr.ErrState, "volume %s should hold %s but %s holds %s; refusing to mount or format it", nv.ID, nv.Vol.FSType, dev, found)
	}
	growth, err := d.GrowBeforeMount(ctx, nv, dev, readOnly)
	if err != nil {
		return err
	}
	// The staging path is made by the mount itself, below the allowed
	// directory without links (internal/mount/beneath.go).
	opts := slices.Clone(vc.GetMount().GetMountFlags())
	if readOnly {
		opts = append(opts, "ro")
	}
	if nv.Vol.FSType == "xfs" && !slices.Contains(opts, "nouuid") {
		// A clone or restored snapshot has its source's filesystem UUID, and XFS
		// refuses a second mount of one UUID on a node. nouuid changes nothing else.
		opts = append(opts, "nouuid")
	}
	if err := d.Mounts.Mount(ctx, dev, staging, nv.Vol.FSType, opts); err != nil {
		if derr := d.Loops.Detach(ctx, image); derr != nil {
			klog.FromContext(ctx).Error(derr, "Detach after failed mount", "device", dev)
		}
		return fmt.Errorf("mount %s at %s: %w", dev, staging, err)
	}
	d.GrowAfterMount(ctx, growth, nv, dev, staging)
	klog.FromContext(ctx).Info("Staged volume", "volume", nv.ID, "device", dev, "path", staging, "fsType", nv.Vol.FSType)
	return nil
}

// singleWriterFree enforces ReadWriteOncePod: the volume may be published at one
// target only.
func (d imageLayout) singleWriterFree(nv NodeVolume, image, staging, target string) error {
	dev, ok, err := d.Loops.Find(image)
	if err != nil || !ok {
		return csierr.Failf(csierr.ErrNotStaged, "volume %s is not attached on this node", nv.ID)
	}
	points, err := d.Mounts.MountPoints(dev)
	if err != nil {
		return fmt.Errorf("list mounts of %s: %w", dev, err)
	}
	for _, p := range points {
		if p != staging && p != target {
			return csierr.Failf(csierr.ErrInUse, "volume %s has access mode SINGLE_NODE_SINGLE_WRITER and is already published at %s", nv.ID, p)
		}
	}
	return nil
}

// alreadyPublished answers a repeated NodePublishVolume: done when the target
// already shows this volume the same way, ALREADY_EXISTS when it shows it
// differently or shows something else.
func (d imageLayout) alreadyPublished(nv NodeVolume, image, target string, readOnly bool) (bool, error) {
	info, mounted, err := d.Mounts.Info(target)
	if err != nil {
		return false, fmt.Errorf("inspect %s: %w", target, err)
	}
	if !mounted {
		return false, nil
	}
	dev, ok, err := d.AttachedDevice(image)
	if err != nil {
		return false, err
	}
	same := ok && (info.Source == dev || d.Mounts.IsDevice(info.Target, dev))
	if !same {
		return false, csierr.Failf(csierr.ErrPathTaken, "target path %s already holds another mount (%s)", target, info.Source)
	}
	if info.ReadOnly != readOnly {
		return false, csierr.Failf(csierr.ErrPathTaken, "volume %s is published at %s with read-only=%v, the request asks read-only=%v", nv.ID, target, info.ReadOnly, readOnly)
	}
	return true, nil
}

// attach attaches the volume's image (or finds it attached) and refuses a
// device this node fenced: it maps nothing any more, and the volume may be
// another node's now. Only an unstage (a detach) clears it.
// On a shared pool, the node records the image before it attaches it and
// the device once attached (noderecords.go): its fence finds the device by
// that record, without the pool.
func (d imageLayout) attach(ctx context.Context, nv NodeVolume, image string) (string, error) {
	rec, err := d.NoteStage(nv, image)
	if err != nil {
		return "", err
	}
	dev, err := d.Loops.Attach(ctx, image)
	if err != nil {
		d.ForgetStages(ctx, nv.ID)
		return "", fmt.Errorf("attach %s: %w", image, err)
	}
	if err := d.NoteDevice(ctx, rec, dev); err != nil {
		return "", err
	}
	if rec.Pool != "" && !rec.ReadOnly && d.LeaseLost != nil && d.LeaseLost(rec.Pool) {
		// The lease was fresh when the stage began (ensureLease), but the
		// stage stalled: the fence may have listed the kernel's devices
		// before this one existed. Now that it is recorded, any later
		// fence finds it; this one is fenced here.
		log := klog.FromContext(ctx).WithValues("volume", nv.ID, "device", dev)
		log.Info("This node's lease in the pool expired or was fenced while the volume was being attached: fencing and detaching its new loop device")
		if err := d.Loops.Fence(dev); err != nil {
			log.Error(err, "Fencing the loop device of a stage that raced the fence")
		}
		// Nothing mounts it yet: detached, it takes no I/O either way.
		if err := d.Loops.Detach(ctx, image); err != nil {
			log.Error(err, "Detaching the fenced loop device of a stage that raced the fence")
		}
		d.ForgetStages(ctx, nv.ID)
		return "", csierr.Failf(pool.ErrUnavailable, "node %s: its lease in pool %s expired or was fenced while volume %s was being attached; not taking it read-write (retry once the lease is renewed)", d.NodeID, nv.Pool.Name(), nv.ID)
	}
	if fenced, err := d.Loops.Fenced(dev); err == nil && fenced {
		return "", csierr.Failf(csierr.ErrFenced, "volume %s: its loop device %s on node %s was fenced when the node could not renew its lease in pool %s; unstage it (delete the pod using it) before it can be staged again", nv.ID, dev, d.NodeID, nv.Pool.Name())
	}
	return dev, nil
}

// attachedDevice is loops.Find with its failure (a scan of the loop devices
// that failed) as UNAVAILABLE: not knowing which device holds an image is no
// answer that none does, so it must never read as "not attached" (NOT_FOUND,
// a publish refused as a foreign mount, a detached-device condition).
func (d *Deps) AttachedDevice(image string) (string, bool, error) {
	dev, ok, err := d.Loops.Find(image)
	if err != nil {
		return "", false, csierr.Failf(pool.ErrUnavailable, "cannot tell which loop device holds %s (retry): %w", image, err)
	}
	return dev, ok, nil
}

// expandNode brings a staged image volume to the size its image file has: the
// loop device first, then the filesystem, online.
func (d imageLayout) ExpandNode(ctx context.Context, nv NodeVolume, req *csi.NodeExpandVolumeRequest, path string) (*csi.NodeExpandVolumeResponse, error) {
	v := nv.Vol
	image := nv.Pool.ImagePath(nv.ID)
	dev, attached, err := d.Loops.Find(image)
	if err != nil {
		return nil, fmt.Errorf("find loop device of %s: %w", image, err)
	}
	if !attached {
		return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not staged on this node", nv.ID)
	}
	if r := req.GetCapacityRange(); d.ExpandOnNode && !nv.Pool.Shared() && r.GetRequiredBytes() > v.CapacityBytes {
		// Local pools deployed with one cluster-wide resizer: the resizer cannot
		// reach this node's pool, so it skips ControllerExpandVolume (not
		// advertised) and the file grows here, where the pool is.
		if v, err = d.GrowImage(ctx, nv.Pool, nv.ID, v, r); err != nil {
			return nil, err
		}
	}
	info, mounted, err := d.Mounts.Info(path)
	if err != nil {
		return nil, fmt.Errorf("inspect %s: %w", path, err)
	}
	holds := mounted && (info.Source == dev || d.Mounts.IsDevice(info.Target, dev))
	if !holds && v.AccessType == pool.AccessBlock {
		// A block volume's staging path has nothing mounted on it.
		holds = slices.ContainsFunc(v.Staged, func(s pool.StageRecord) bool { return s.Node == d.NodeID && s.Path == path })
	}
	if !holds {
		return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not mounted at %s", nv.ID, path)
	}

	size, err := d.RefreshLoop(ctx, nv.Pool, nv.ID, dev, v)
	if err != nil {
		return nil, err
	}
	if req := req.GetCapacityRange().GetRequiredBytes(); req > size {
		return nil, csierr.Failf(csierr.ErrState, "volume %s is %d bytes, %d were asked: ControllerExpandVolume has not grown it yet", nv.ID, size, req)
	}
	if v.AccessType == pool.AccessFilesystem {
		if info.ReadOnly {
			path, info = d.writableMount(nv, req.GetStagingTargetPath(), dev, path, info)
		}
		if info.ReadOnly {
			// Growing writes the filesystem, and a read-only stage must not be
			// written. Answering the new size would make kubelet mark the claim
			// resized while the filesystem keeps its old size: answer an error
			// kubelet retries (and shows as an event) instead; the next
			// read-write stage grows the filesystem.
			return nil, csierr.Failf(csierr.ErrState,
				"volume %s is mounted read-only at %s: its filesystem cannot grow to %d bytes until the volume is staged read-write, which grows it", nv.ID, path, size)
		}
		need, err := d.Devs.NeedResize(ctx, dev, path)
		if err != nil {
			return nil, fmt.Errorf("volume %s: %w", nv.ID, err)
		}
		if need {
			if err := d.Devs.ResizeFS(ctx, dev, path); err != nil {
				return nil, fmt.Errorf("grow filesystem of volume %s: %w", nv.ID, err)
			}
		}
	}
	klog.FromContext(ctx).Info("Expanded volume on node", "volume", nv.ID, "path", path, "device", dev, "size", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// writableMount finds a read-write mount of the volume's filesystem to grow
// through when the path kubelet named is read-only: a pod's publish path may be
// a read-only bind of a read-write staging mount, which kubelet names, or this
// node's stage record does. It returns path and info unchanged when there is
// none.
func (d imageLayout) writableMount(nv NodeVolume, staging, dev, path string, info mount.MountInfo) (string, mount.MountInfo) {
	candidates := []string{staging}
	for _, s := range nv.Vol.Staged {
		if s.Node == d.NodeID {
			candidates = append(candidates, s.Path)
		}
	}
	for _, c := range candidates {
		if c == "" {
			continue
		}
		sp, err := d.RequestPath("staging_target_path", c)
		if err != nil || sp == path {
			continue
		}
		if si, ok, err := d.Mounts.Info(sp); err == nil && ok && !si.ReadOnly && (si.Source == dev || d.Mounts.OnDevice(sp, dev)) {
			return sp, si
		}
	}
	return path, info
}

// refreshLoop makes the loop device as large as the image file and returns that
// size. The file is the truth (ControllerExpandVolume grows it before it records
// the size); a file smaller than its record was damaged, and is not hidden.
func (d *Deps) RefreshLoop(ctx context.Context, p *pool.Pool, vid pool.VolumeID, dev string, v *pool.Volume) (int64, error) {
	imageSize, err := p.Images().Size(vid)
	if err != nil {
		return 0, err
	}
	if imageSize < v.CapacityBytes {
		return 0, csierr.Failf(csierr.ErrState, "volume %s: image %s is %d bytes but %d are recorded; the image was truncated", v.ID, p.ImagePath(vid), imageSize, v.CapacityBytes)
	}
	size, err := d.Devs.Size(dev)
	if err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if size >= imageSize {
		return size, nil
	}
	if err := d.Loops.Refresh(dev); err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if size, err = d.Devs.Size(dev); err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	klog.FromContext(ctx).V(2).Info("Refreshed loop device size", "volume", v.ID, "device", dev, "size", size)
	return size, nil
}

// growBeforeMount runs during NodeStageVolume between attach and mount: it
// refreshes the loop device and, when the filesystem is smaller than its
// device, grows an ext4 filesystem offline at once (e2fsck + resize2fs, which
// needs no CAP_SYS_RESOURCE) or notes that xfs/btrfs must grow once mounted.
// A read-only stage grows nothing: it must not write the volume.
func (d *Deps) GrowBeforeMount(ctx context.Context, nv NodeVolume, dev string, readOnly bool) (stageGrowth, error) {
	size, err := d.RefreshLoop(ctx, nv.Pool, nv.ID, dev, nv.Vol)
	if err != nil || readOnly {
		return stageGrowth{}, err
	}
	fsType, fsSize, err := d.Devs.FilesystemSize(dev)
	if err != nil {
		return stageGrowth{}, fmt.Errorf("volume %s: %w", nv.ID, err)
	}
	if size-fsSize < GrowSlack {
		return stageGrowth{}, nil
	}
	klog.FromContext(ctx).Info("Volume was expanded while not staged; growing its filesystem", "volume", nv.ID, "fsType", fsType, "from", fsSize, "to", size)
	if fsType != "ext4" {
		return stageGrowth{afterMount: true}, nil
	}
	if err := d.Devs.ResizeFS(ctx, dev, ""); err != nil {
		return stageGrowth{}, fmt.Errorf("grow filesystem of volume %s offline: %w", nv.ID, err)
	}
	return stageGrowth{}, nil
}

// growAfterMount finishes what growBeforeMount left for a mounted filesystem.
// A failure does not fail the stage: the volume is usable at its old size, and
// kubelet follows an offline expansion with NodeExpandVolume, which retries.
func (d *Deps) GrowAfterMount(ctx context.Context, g stageGrowth, nv NodeVolume, dev, staging string) {
	if !g.afterMount {
		return
	}
	if err := d.Devs.ResizeFS(ctx, dev, staging); err != nil {
		klog.FromContext(ctx).Error(err, "Growing the filesystem after staging failed; NodeExpandVolume will retry", "volume", nv.ID, "path", staging)
	}
}

// stats of an image volume: its filesystem's, or its block device's size.
func (d imageLayout) Stats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	image := p.ImagePath(vid)
	dev, attached, err := d.AttachedDevice(image)
	if err != nil {
		return nil, err
	}
	if !attached {
		return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not attached on this node, so not mounted at %s", vid, path)
	}
	if !d.Mounts.OnDevice(path, dev) {
		info, mounted, err := d.Mounts.Info(path)
		if err != nil {
			return nil, fmt.Errorf("inspect %s: %w", path, err)
		}
		if !mounted || (info.Source != dev && !d.Mounts.IsDevice(info.Target, dev)) {
			return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not mounted at %s", vid, path)
		}
	}
	if v.AccessType == pool.AccessBlock {
		size, err := d.Devs.Size(dev)
		if err != nil {
			return nil, fmt.Errorf("size of %s: %w", dev, err)
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
	}
	return d.FilesystemStats(path)
}

// setBlockReadOnly makes a block publish's read-only request real. A read-only
// bind mount of a device node does not stop writes through it, so read-only
// needs the kernel's read-only flag on the loop device — and that flag is per
// device: it covers every publish of the volume on this node. Read-only and
// read-write publishes of one block volume on one node therefore cannot be
// honoured together, and the second is refused rather than silently weakened
// (read-write made read-only, or read-only made writable). A flag left by an
// earlier read-only publish is cleared by the next read-write publish once no
// other publish remains, and by Attach on the next stage.
func (d *Deps) SetBlockReadOnly(dev, target string, readOnly bool) error {
	points, err := d.Mounts.MountPoints(dev)
	if err != nil {
		return fmt.Errorf("list mounts of %s: %w", dev, err)
	}
	points = slices.DeleteFunc(points, func(p string) bool { return p == target })
	// The device's flag, not the mounts' flags, tells what the other publishes are:
	// kubelet bind-mounts every block publish again under its global map path
	// (volumeDevices/<pv>/dev/<pod>) read-write whatever the publish was, and a mount
	// flag on a device node restricts nothing anyway.
	ro, err := d.Devs.ReadOnly(dev)
	if err != nil {
		return err
	}
	if readOnly {
		if ro {
			return nil // every publish on this node is read-only already
		}
		if len(points) > 0 {
			return csierr.Failf(csierr.ErrInUse, "block device %s is published read-write at %s; a read-only publish on the same node cannot be enforced beside it", dev, points[0])
		}
		if err := d.Devs.SetReadOnly(dev, true); err != nil {
			return err
		}
		return nil
	}
	if !ro {
		return nil
	}
	if len(points) > 0 {
		return csierr.Failf(csierr.ErrInUse, "block device %s is published read-only at %s; a read-write publish on the same node would make that one writable", dev, points[0])
	}
	if err := d.Devs.SetReadOnly(dev, false); err != nil {
		return err
	}
	return nil
}

// AttachImage attaches nv's image as a stage does (attach), for an inline
// volume, which the node makes, stages and publishes in one call.
func (d *Deps) AttachImage(ctx context.Context, nv NodeVolume, image string) (string, error) {
	return imageLayout{d}.attach(ctx, nv, image)
}
