package driver

import (
	"context"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

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
	if nv.caps.Access == pool.AccessBlock {
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
	if nv.caps.Access == pool.AccessBlock {
		dev, ok, err := d.attachedDevice(image)
		if err != nil {
			return err
		}
		if !ok {
			return csierr.Failf(csierr.ErrNotStaged, "volume %s is not staged on this node (no loop device for %s)", nv.id, image)
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
			return csierr.Failf(csierr.ErrNotStaged, "volume %s is not staged at %s; call NodeStageVolume first", nv.id, staging)
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
	if nv.caps.Access == pool.AccessBlock {
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
			return csierr.Failf(csierr.ErrPathTaken, "staging path %s already holds another mount (%s)", staging, info.Source)
		}
		if info.ReadOnly != readOnly {
			return csierr.Failf(csierr.ErrPathTaken, "volume %s is staged at %s with read-only=%v, the request asks read-only=%v", nv.id, staging, info.ReadOnly, readOnly)
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
		return csierr.Failf(csierr.ErrState, "volume %s should hold %s but %s holds %s; refusing to mount or format it", nv.id, nv.vol.FSType, dev, found)
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
		return csierr.Failf(csierr.ErrNotStaged, "volume %s is not attached on this node", nv.id)
	}
	points, err := d.mounts.MountPoints(dev)
	if err != nil {
		return fmt.Errorf("list mounts of %s: %w", dev, err)
	}
	for _, p := range points {
		if p != staging && p != target {
			return csierr.Failf(csierr.ErrInUse, "volume %s has access mode SINGLE_NODE_SINGLE_WRITER and is already published at %s", nv.id, p)
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
		return false, csierr.Failf(csierr.ErrPathTaken, "target path %s already holds another mount (%s)", target, info.Source)
	}
	if info.ReadOnly != readOnly {
		return false, csierr.Failf(csierr.ErrPathTaken, "volume %s is published at %s with read-only=%v, the request asks read-only=%v", nv.id, target, info.ReadOnly, readOnly)
	}
	return true, nil
}

// attach attaches the volume's image (or finds it attached) and refuses a
// device this node fenced: it maps nothing any more, and the volume may be
// another node's now. Only an unstage (a detach) clears it.
// On a shared pool, the node records the image before it attaches it and
// the device once attached (noderecords.go): its fence finds the device by
// that record, without the pool.
func (d imageLayout) attach(ctx context.Context, nv nodeVolume, image string) (string, error) {
	rec, err := d.noteStage(nv, image)
	if err != nil {
		return "", err
	}
	dev, err := d.loops.Attach(ctx, image)
	if err != nil {
		d.forgetStages(ctx, nv.id)
		return "", fmt.Errorf("attach %s: %w", image, err)
	}
	if err := d.noteDevice(ctx, rec, dev); err != nil {
		return "", err
	}
	if rec.Pool != "" && !rec.ReadOnly && d.leaseState.lost(rec.Pool) {
		// The lease was fresh when the stage began (ensureLease), but the
		// stage stalled: the fence may have listed the kernel's devices
		// before this one existed. Now that it is recorded, any later
		// fence finds it; this one is fenced here.
		log := klog.FromContext(ctx).WithValues("volume", nv.id, "device", dev)
		log.Info("This node's lease in the pool expired or was fenced while the volume was being attached: fencing and detaching its new loop device")
		if err := d.loops.Fence(dev); err != nil {
			log.Error(err, "Fencing the loop device of a stage that raced the fence")
		}
		// Nothing mounts it yet: detached, it takes no I/O either way.
		if err := d.loops.Detach(ctx, image); err != nil {
			log.Error(err, "Detaching the fenced loop device of a stage that raced the fence")
		}
		d.forgetStages(ctx, nv.id)
		return "", csierr.Failf(pool.ErrUnavailable, "node %s: its lease in pool %s expired or was fenced while volume %s was being attached; not taking it read-write (retry once the lease is renewed)", d.nodeID, nv.pool.Name(), nv.id)
	}
	if fenced, err := d.loops.Fenced(dev); err == nil && fenced {
		return "", csierr.Failf(csierr.ErrFenced, "volume %s: its loop device %s on node %s was fenced when the node could not renew its lease in pool %s; unstage it (delete the pod using it) before it can be staged again", nv.id, dev, d.nodeID, nv.pool.Name())
	}
	return dev, nil
}

// attachedDevice is loops.Find with its failure (a scan of the loop devices
// that failed) as UNAVAILABLE: not knowing which device holds an image is no
// answer that none does, so it must never read as "not attached" (NOT_FOUND,
// a publish refused as a foreign mount, a detached-device condition).
func (d *layoutDeps) attachedDevice(image string) (string, bool, error) {
	dev, ok, err := d.loops.Find(image)
	if err != nil {
		return "", false, csierr.Failf(pool.ErrUnavailable, "cannot tell which loop device holds %s (retry): %w", image, err)
	}
	return dev, ok, nil
}

// expandNode brings a staged image volume to the size its image file has: the
// loop device first, then the filesystem, online.
func (d imageLayout) expandNode(ctx context.Context, nv nodeVolume, req *csi.NodeExpandVolumeRequest, path string) (*csi.NodeExpandVolumeResponse, error) {
	v := nv.vol
	image := nv.pool.ImagePath(nv.id)
	dev, attached, err := d.loops.Find(image)
	if err != nil {
		return nil, fmt.Errorf("find loop device of %s: %w", image, err)
	}
	if !attached {
		return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not staged on this node", nv.id)
	}
	if r := req.GetCapacityRange(); d.expandOnNode && isLocal(nv.pool) && r.GetRequiredBytes() > v.CapacityBytes {
		// Local pools deployed with one cluster-wide resizer: the resizer cannot
		// reach this node's pool, so it skips ControllerExpandVolume (not
		// advertised) and the file grows here, where the pool is.
		if v, err = d.growImage(ctx, nv.pool, nv.id, v, r); err != nil {
			return nil, err
		}
	}
	info, mounted, err := d.mounts.Info(path)
	if err != nil {
		return nil, fmt.Errorf("inspect %s: %w", path, err)
	}
	holds := mounted && (info.Source == dev || d.mounts.IsDevice(info.Target, dev))
	if !holds && v.AccessType == pool.AccessBlock {
		// A block volume's staging path has nothing mounted on it.
		holds = slices.ContainsFunc(v.Staged, func(s pool.StageRecord) bool { return s.Node == d.nodeID && s.Path == path })
	}
	if !holds {
		return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not mounted at %s", nv.id, path)
	}

	size, err := d.refreshLoop(ctx, nv.pool, nv.id, dev, v)
	if err != nil {
		return nil, err
	}
	if req := req.GetCapacityRange().GetRequiredBytes(); req > size {
		return nil, csierr.Failf(csierr.ErrState, "volume %s is %d bytes, %d were asked: ControllerExpandVolume has not grown it yet", nv.id, size, req)
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
				"volume %s is mounted read-only at %s: its filesystem cannot grow to %d bytes until the volume is staged read-write, which grows it", nv.id, path, size)
		}
		need, err := d.devs.NeedResize(dev, path)
		if err != nil {
			return nil, fmt.Errorf("volume %s: %w", nv.id, err)
		}
		if need {
			if err := d.devs.ResizeFS(ctx, dev, path); err != nil {
				return nil, fmt.Errorf("grow filesystem of volume %s: %w", nv.id, err)
			}
		}
	}
	klog.FromContext(ctx).Info("Expanded volume on node", "volume", nv.id, "path", path, "device", dev, "size", size)
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// writableMount finds a read-write mount of the volume's filesystem to grow
// through when the path kubelet named is read-only: a pod's publish path may be
// a read-only bind of a read-write staging mount, which kubelet names, or this
// node's stage record does. It returns path and info unchanged when there is
// none.
func (d imageLayout) writableMount(nv nodeVolume, staging, dev, path string, info mount.MountInfo) (string, mount.MountInfo) {
	candidates := []string{staging}
	for _, s := range nv.vol.Staged {
		if s.Node == d.nodeID {
			candidates = append(candidates, s.Path)
		}
	}
	for _, c := range candidates {
		if c == "" {
			continue
		}
		sp, err := d.requestPath("staging_target_path", c)
		if err != nil || sp == path {
			continue
		}
		if si, ok, err := d.mounts.Info(sp); err == nil && ok && !si.ReadOnly && (si.Source == dev || d.mounts.OnDevice(sp, dev)) {
			return sp, si
		}
	}
	return path, info
}

// refreshLoop makes the loop device as large as the image file and returns that
// size. The file is the truth (ControllerExpandVolume grows it before it records
// the size); a file smaller than its record was damaged, and is not hidden.
func (d *layoutDeps) refreshLoop(ctx context.Context, p *pool.Pool, vid pool.VolumeID, dev string, v *pool.Volume) (int64, error) {
	imageSize, err := p.ImageSize(vid)
	if err != nil {
		return 0, err
	}
	if imageSize < v.CapacityBytes {
		return 0, csierr.Failf(csierr.ErrState, "volume %s: image %s is %d bytes but %d are recorded; the image was truncated", v.ID, p.ImagePath(vid), imageSize, v.CapacityBytes)
	}
	size, err := d.devs.Size(dev)
	if err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if size >= imageSize {
		return size, nil
	}
	if err := d.loops.Refresh(dev); err != nil {
		return 0, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	if size, err = d.devs.Size(dev); err != nil {
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
func (d *layoutDeps) growBeforeMount(ctx context.Context, nv nodeVolume, dev string, readOnly bool) (stageGrowth, error) {
	size, err := d.refreshLoop(ctx, nv.pool, nv.id, dev, nv.vol)
	if err != nil || readOnly {
		return stageGrowth{}, err
	}
	fsType, fsSize, err := d.devs.FilesystemSize(dev)
	if err != nil {
		return stageGrowth{}, fmt.Errorf("volume %s: %w", nv.id, err)
	}
	if size-fsSize < growSlack {
		return stageGrowth{}, nil
	}
	klog.FromContext(ctx).Info("Volume was expanded while not staged; growing its filesystem", "volume", nv.id, "fsType", fsType, "from", fsSize, "to", size)
	if fsType != "ext4" {
		return stageGrowth{afterMount: true}, nil
	}
	if err := d.devs.ResizeFS(ctx, dev, ""); err != nil {
		return stageGrowth{}, fmt.Errorf("grow filesystem of volume %s offline: %w", nv.id, err)
	}
	return stageGrowth{}, nil
}

// growAfterMount finishes what growBeforeMount left for a mounted filesystem.
// A failure does not fail the stage: the volume is usable at its old size, and
// kubelet follows an offline expansion with NodeExpandVolume, which retries.
func (d *layoutDeps) growAfterMount(ctx context.Context, g stageGrowth, nv nodeVolume, dev, staging string) {
	if !g.afterMount {
		return
	}
	if err := d.devs.ResizeFS(ctx, dev, staging); err != nil {
		klog.FromContext(ctx).Error(err, "Growing the filesystem after staging failed; NodeExpandVolume will retry", "volume", nv.id, "path", staging)
	}
}

// stats of an image volume: its filesystem's, or its block device's size.
func (d imageLayout) stats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	image := p.ImagePath(vid)
	dev, attached, err := d.attachedDevice(image)
	if err != nil {
		return nil, err
	}
	if !attached {
		return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not attached on this node, so not mounted at %s", vid, path)
	}
	if !d.mounts.OnDevice(path, dev) {
		info, mounted, err := d.mounts.Info(path)
		if err != nil {
			return nil, fmt.Errorf("inspect %s: %w", path, err)
		}
		if !mounted || (info.Source != dev && !d.mounts.IsDevice(info.Target, dev)) {
			return nil, csierr.Failf(csierr.ErrNotAtPath, "volume %s is not mounted at %s", vid, path)
		}
	}
	if v.AccessType == pool.AccessBlock {
		size, err := d.devs.Size(dev)
		if err != nil {
			return nil, fmt.Errorf("size of %s: %w", dev, err)
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
	}
	return d.filesystemStats(path)
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
func (d *layoutDeps) setBlockReadOnly(dev, target string, readOnly bool) error {
	points, err := d.mounts.MountPoints(dev)
	if err != nil {
		return fmt.Errorf("list mounts of %s: %w", dev, err)
	}
	points = slices.DeleteFunc(points, func(p string) bool { return p == target })
	// The device's flag, not the mounts' flags, tells what the other publishes are:
	// kubelet bind-mounts every block publish again under its global map path
	// (volumeDevices/<pv>/dev/<pod>) read-write whatever the publish was, and a mount
	// flag on a device node restricts nothing anyway.
	ro, err := d.devs.ReadOnly(dev)
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
		if err := d.devs.SetReadOnly(dev, true); err != nil {
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
	if err := d.devs.SetReadOnly(dev, false); err != nil {
		return err
	}
	return nil
}
