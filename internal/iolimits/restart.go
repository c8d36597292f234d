package iolimits

import (
	"context"
	"path/filepath"
	"slices"
	"strings"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/cgroup"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// blockPublishDir is what precedes <pv>/<pod UID> in kubelet's block publish
// path, below its root directory.
var blockPublishDir = []string{"plugins", "kubernetes.io", "csi", "volumeDevices", "publish"}

// podUIDOfTarget returns the pod UID in a kubelet target path, false when the
// path is not one or the UID is not a lowercase UUID (it becomes part of a
// cgroup path). kubelet v1.36 (pkg/volume/csi) publishes a filesystem volume
// at <root>/pods/<pod UID>/volumes/kubernetes.io~csi/<pv>/mount
// (csiMountMgr.GetPath) and a block volume at
// <root>/plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod UID>
// (csiBlockMapper.getPublishPath). Its other binds of a block device
// (volumeDevices/<pv>/dev/<pod UID>, the global map path) are no publish and
// match neither.
func podUIDOfTarget(target string) (string, bool) {
	parts := strings.Split(target, "/")
	n := len(parts)
	var uid string
	switch {
	case n >= 7 && parts[n-6] == "pods" && parts[n-4] == "volumes" && parts[n-3] == "kubernetes.io~csi" &&
		parts[n-2] != "" && parts[n-1] == "mount":
		uid = parts[n-5]
	case n >= 8 && slices.Equal(parts[n-7:n-2], blockPublishDir) && parts[n-2] != "":
		uid = parts[n-1]
	default:
		return "", false
	}
	if cgroup.ValidatePodUID(uid) != nil {
		return "", false
	}
	return uid, true
}

// Rebuild finds again, after a restart, the publications of image
// volumes this node staged, from the mount table: the tracking is in memory
// only, and without it a class changed later never reaches pods already
// running. It writes nothing: it records what each pod's cgroup already
// holds, so the reconcile writes only what differs. It runs before the
// server serves; a publication a handler tracked first is kept.
func (th *Throttle) Rebuild(ctx context.Context) {
	found := 0
	for _, name := range th.deps.Names() {
		if p := th.deps.Pool(name); p != nil {
			found += th.rebuildPool(ctx, p)
		}
	}
	klog.FromContext(ctx).Info("I/O limits: found the publications of this node again", "count", found)
}

// RebuildPool is Rebuild for one pool, for a pool that did not answer when
// Rebuild ran: it must run before the pool serves any call.
func (th *Throttle) RebuildPool(ctx context.Context, p *pool.Pool) {
	found := th.rebuildPool(ctx, p)
	klog.FromContext(ctx).Info("I/O limits: found the publications of this node in a pool again", "pool", p.Name(), "count", found)
}

func (th *Throttle) rebuildPool(ctx context.Context, p *pool.Pool) int {
	entries, err := p.List()
	if err != nil {
		klog.FromContext(ctx).Error(err, "I/O limits: cannot list the pool's volumes; its running pods keep the limits they have until published again", "pool", p.Name())
		return 0
	}
	found := 0
	for _, e := range entries {
		if ctx.Err() != nil {
			return found
		}
		if e.Err != nil || e.Volume == nil || e.Volume.Layout != pool.LayoutImage {
			continue
		}
		found += th.rediscoverPublishes(ctx, p, e.ID, e.Volume)
	}
	return found
}

// rediscoverPublishes tracks the publications of one volume: the mount points
// of its loop device that are kubelet target paths, below the allowed path
// prefix, other than this node's staging paths (an inline volume is staged at
// its target and never tracked). It returns how many it tracked.
func (th *Throttle) rediscoverPublishes(ctx context.Context, p *pool.Pool, id pool.VolumeID, v *pool.Volume) int {
	var staging []string
	for _, s := range v.Staged {
		if s.Node == th.deps.Node.NodeID {
			staging = append(staging, s.Path, filepath.Clean(s.Path))
		}
	}
	if len(staging) == 0 {
		return 0
	}
	logger := klog.FromContext(ctx).WithValues("volume", id)
	dev, ok, err := th.deps.Node.AttachedDevice(p.ImagePath(id))
	if err != nil || !ok {
		logger.V(2).Info("I/O limits: a volume staged here has no loop device", "err", err)
		return 0
	}
	points, err := th.deps.Node.Mounts.MountPoints(dev)
	if err != nil {
		logger.Error(err, "I/O limits: cannot list the mounts of a volume's loop device", "device", dev)
		return 0
	}
	n := 0
	for _, m := range points {
		if slices.Contains(staging, m) {
			continue
		}
		// The same check a request's target path passes: below the prefix,
		// clean, through no link.
		target, err := th.deps.Node.RequestPath("target_path", m)
		if err != nil || target != m {
			logger.V(2).Info("I/O limits: not a target path this driver publishes to", "path", m, "err", err)
			continue
		}
		uid, ok := podUIDOfTarget(target)
		if !ok {
			logger.V(2).Info("I/O limits: no pod UID in the path; that pod is not held to the volume's limits", "path", target)
			continue
		}
		t := &throttled{pool: p, id: id, podUID: uid}
		held, _, err := th.deps.Cgroups.Held(uid, dev)
		if err == nil && !held.IsZero() {
			t.device = dev
			t.applied = pool.IOLimits{ReadBytesPerSecond: held.ReadBPS, WriteBytesPerSecond: held.WriteBPS, ReadIOPS: held.ReadIOPS, WriteIOPS: held.WriteIOPS}
		}
		th.mu.Lock()
		if _, dup := th.pub[target]; !dup {
			if th.pub == nil {
				th.pub = map[string]*throttled{}
			}
			th.pub[target] = t
			n++
		}
		th.mu.Unlock()
		logger.V(2).Info("I/O limits: tracking a publication found again", "target", target, "pod", uid, "device", dev, "held", held, "err", err)
	}
	return n
}
