package driver

import (
	"context"
	"errors"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/cgroup"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// podUIDKey is the volume_context key kubelet fills with the pod's UID when
// the CSIDriver has podInfoOnMount.
const podUIDKey = "csi.storage.k8s.io/pod.uid"

// DefaultIOLimitsInterval is how often the node re-applies the I/O limits of
// the volumes published here (Options.IOLimitsInterval).
const DefaultIOLimitsInterval = 10 * time.Second

// throttled is one publication of an image volume to a pod: what the node
// holds to the volume's current limits.
type throttled struct {
	pool   *pool.Pool
	id     pool.VolumeID
	podUID string
	// applied is what was last written, and on which device ("" when
	// nothing was: no limits yet, or the pod's cgroup was not found).
	applied pool.IOLimits
	device  string
}

// ioLimits tracks this node's publications by target path.
type ioLimits struct {
	mu  sync.Mutex
	pub map[string]*throttled
}

// podUIDOf returns the pod UID of a publish's volume context, "" without
// one (no podInfoOnMount) or with one that is not a UUID: it becomes part of
// a cgroup path, so anything else is never used — but it is no reason to
// refuse the pod its volume (a static pod's UID is a hash, not a UUID): that
// pod is just not held to I/O limits, and the log says so.
func podUIDOf(ctx context.Context, volumeContext map[string]string) string {
	uid, ok := volumeContext[podUIDKey]
	if !ok || uid == "" {
		return ""
	}
	if err := cgroup.ValidatePodUID(uid); err != nil {
		klog.FromContext(ctx).Info("Pod UID is not a UUID: its pod is not held to the volume's I/O limits", "key", podUIDKey, "err", err)
		return ""
	}
	return uid
}

// trackPublish remembers a publication of an image volume to a pod and
// applies the volume's limits to it now. Failing to apply is logged, never
// the publish's failure: the pod runs unthrottled until the reconcile
// manages.
func (d *Driver) trackPublish(ctx context.Context, nv nodeVolume, target, podUID string) {
	if podUID == "" || nv.vol.Layout != pool.LayoutImage {
		return
	}
	t := &throttled{pool: nv.pool, id: nv.id, podUID: podUID}
	d.throttle.mu.Lock()
	if old, ok := d.throttle.pub[target]; ok && old.podUID == podUID && old.id == nv.id {
		t = old
	} else {
		if d.throttle.pub == nil {
			d.throttle.pub = map[string]*throttled{}
		}
		d.throttle.pub[target] = t
	}
	d.throttle.mu.Unlock()
	d.applyLimits(ctx, t, nv.vol)
}

// untrackPublish forgets a publication: the pod's cgroup goes with the pod.
func (d *Driver) untrackPublish(target string) {
	d.throttle.mu.Lock()
	delete(d.throttle.pub, target)
	d.throttle.mu.Unlock()
}

// applyLimits writes v's limits to the pod's cgroup for the volume's loop
// device, when they or the device changed since the last write. A volume
// that never had limits touches no cgroup.
func (d *Driver) applyLimits(ctx context.Context, t *throttled, v *pool.Volume) {
	logger := klog.FromContext(ctx).WithValues("volume", t.id, "pod", t.podUID)
	dev, ok, err := d.attachedDevice(t.pool.ImagePath(t.id))
	if err != nil || !ok {
		logger.V(4).Info("No loop device to throttle", "err", err)
		return
	}
	d.throttle.mu.Lock()
	same := t.device == dev && t.applied == v.IOLimits
	never := t.device == "" && v.IOLimits.IsZero()
	d.throttle.mu.Unlock()
	if never {
		return
	}
	l := v.IOLimits
	want := cgroup.Limits{ReadBPS: l.ReadBytesPerSecond, WriteBPS: l.WriteBytesPerSecond, ReadIOPS: l.ReadIOPS, WriteIOPS: l.WriteIOPS}
	if same {
		// Written before; the kernel may have moved on all the same: under
		// cgroup v1 a container (re)started since sits in a new cgroup that
		// holds nothing (Held tells).
		if held, _, err := d.cgroups.Held(t.podUID, dev); err != nil || held == want {
			return
		}
	}
	dir, err := d.cgroups.Apply(t.podUID, dev, want)
	if err != nil {
		if errors.Is(err, cgroup.ErrNoPodCgroup) {
			logger.Info("I/O limits not applied: the pod's cgroup is not found (tried again every reconcile)", "device", dev, "reason", err.Error())
		} else {
			logger.Error(err, "I/O limits not applied", "device", dev, "cgroup", dir)
		}
		return
	}
	d.throttle.mu.Lock()
	t.applied, t.device = l, dev
	d.throttle.mu.Unlock()
	logger.Info("Applied I/O limits", "device", dev, "cgroup", dir, "limits", l)
}

// reconcileIOLimits re-applies every publication's current limits: a
// VolumeAttributesClass changed by ControllerModifyVolume reaches running
// pods within one interval.
func (d *Driver) reconcileIOLimits(ctx context.Context) {
	d.throttle.mu.Lock()
	pubs := make([]*throttled, 0, len(d.throttle.pub))
	for _, t := range d.throttle.pub {
		pubs = append(pubs, t)
	}
	d.throttle.mu.Unlock()
	for _, t := range pubs {
		if ctx.Err() != nil {
			return
		}
		v, err := t.pool.Load(t.id)
		if err != nil {
			klog.FromContext(ctx).V(2).Info("I/O limits: volume record unreadable", "volume", t.id, "err", err)
			continue
		}
		d.applyLimits(ctx, t, v)
	}
}

// ThrottledPods lists the publications whose limits are applied, by target
// (for poolcsi status and tests).
func (d *Driver) ThrottledPods() map[string]pool.IOLimits {
	d.throttle.mu.Lock()
	defer d.throttle.mu.Unlock()
	out := map[string]pool.IOLimits{}
	for target, t := range d.throttle.pub {
		if t.device != "" {
			out[target] = t.applied
		}
	}
	return out
}
