// Package iolimits holds the pods of this node to their volumes' I/O limits
// through cgroups: it tracks each publication of an image volume to a pod,
// applies the volume's limits at the publish and again every interval (a
// modify, a restarted container), and after a restart of the node plugin finds
// its publications again from the mount table. It holds only Deps.
package iolimits

import (
	"context"
	"errors"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/cgroup"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// PodUIDKey is the volume_context key kubelet fills with the pod's UID when
// the CSIDriver has podInfoOnMount.
const PodUIDKey = params.PodUIDKey

// DefaultInterval is how often the node re-applies the I/O limits of
// the volumes published here (Options.IOLimitsInterval).
const DefaultInterval = 10 * time.Second

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

// Deps is what the throttle acts through.
type Deps struct {
	// Cgroups writes and reads pods' I/O limits.
	Cgroups layout.Cgroups
	// Node is the node's kernel (its mounts and loop devices) and the
	// paths it accepts.
	Node *layout.Deps
	// Names lists every pool this node serves, and Pool returns one by
	// name (nil if none).
	Names func() []string
	Pool  func(name string) *pool.Pool
	// Interval is how often Run re-applies the limits.
	Interval time.Duration
}

// Throttle tracks this node's publications by target path.
type Throttle struct {
	deps Deps
	mu   sync.Mutex
	pub  map[string]*throttled
	// kick asks Run for a reconcile now (Kick); one pending kick is enough.
	kick chan struct{}
}

// Track remembers a publication of an image volume to a pod and
// applies the volume's limits to it now. Failing to apply is logged, never
// the publish's failure: the pod runs unthrottled until the reconcile
// manages.
func (th *Throttle) Track(ctx context.Context, nv layout.NodeVolume, target, podUID string) {
	if podUID == "" || nv.Vol.Layout != pool.LayoutImage {
		return
	}
	t := &throttled{pool: nv.Pool, id: nv.ID, podUID: podUID}
	th.mu.Lock()
	if old, ok := th.pub[target]; ok && old.podUID == podUID && old.id == nv.ID {
		t = old
	} else {
		if th.pub == nil {
			th.pub = map[string]*throttled{}
		}
		th.pub[target] = t
	}
	th.mu.Unlock()
	th.applyLimits(ctx, t, nv.Vol)
}

// Untrack forgets a publication: the pod's cgroup goes with the pod.
func (th *Throttle) Untrack(target string) {
	th.mu.Lock()
	delete(th.pub, target)
	th.mu.Unlock()
}

// applyLimits writes v's limits to the pod's cgroup for the volume's loop
// device, when they or the device changed since the last write. A volume
// that never had limits touches no cgroup.
func (th *Throttle) applyLimits(ctx context.Context, t *throttled, v *pool.Volume) {
	logger := klog.FromContext(ctx).WithValues("volume", t.id, "pod", t.podUID)
	dev, ok, err := th.deps.Node.AttachedDevice(t.pool.ImagePath(t.id))
	if err != nil || !ok {
		logger.V(4).Info("No loop device to throttle", "err", err)
		return
	}
	th.mu.Lock()
	same := t.device == dev && t.applied == v.IOLimits
	never := t.device == "" && v.IOLimits.IsZero()
	th.mu.Unlock()
	if never {
		return
	}
	l := v.IOLimits
	want := cgroup.Limits{ReadBPS: l.ReadBytesPerSecond, WriteBPS: l.WriteBytesPerSecond, ReadIOPS: l.ReadIOPS, WriteIOPS: l.WriteIOPS}
	if same {
		// Written before; the kernel may have moved on all the same: under
		// cgroup v1 a container (re)started since sits in a new cgroup that
		// holds nothing (Held tells).
		if held, _, err := th.deps.Cgroups.Held(t.podUID, dev); err != nil || held == want {
			return
		}
	}
	dir, err := th.deps.Cgroups.Apply(t.podUID, dev, want)
	if err != nil {
		if errors.Is(err, cgroup.ErrNoPodCgroup) {
			logger.Info("I/O limits not applied: the pod's cgroup is not found (tried again every reconcile)", "device", dev, "reason", err.Error())
		} else {
			logger.Error(err, "I/O limits not applied", "device", dev, "cgroup", dir)
		}
		return
	}
	th.mu.Lock()
	t.applied, t.device = l, dev
	th.mu.Unlock()
	logger.Info("Applied I/O limits", "device", dev, "cgroup", dir, "limits", l)
}

// Reconcile re-applies every publication's current limits: a
// VolumeAttributesClass changed by ControllerModifyVolume reaches running
// pods within one interval.
func (th *Throttle) Reconcile(ctx context.Context) {
	th.mu.Lock()
	pubs := make([]*throttled, 0, len(th.pub))
	for _, t := range th.pub {
		pubs = append(pubs, t)
	}
	th.mu.Unlock()
	for _, t := range pubs {
		if ctx.Err() != nil {
			return
		}
		v, err := t.pool.Load(t.id)
		if err != nil {
			klog.FromContext(ctx).V(2).Info("I/O limits: volume record unreadable", "volume", t.id, "err", err)
			continue
		}
		th.applyLimits(ctx, t, v)
	}
}

// Pods lists the publications whose limits are applied, by target
// (for poolcsi status and tests).
func (th *Throttle) Pods() map[string]pool.IOLimits {
	th.mu.Lock()
	defer th.mu.Unlock()
	out := map[string]pool.IOLimits{}
	for target, t := range th.pub {
		if t.device != "" {
			out[target] = t.applied
		}
	}
	return out
}

// New makes the throttle over deps.
func New(deps Deps) *Throttle {
	return &Throttle{deps: deps, kick: make(chan struct{}, 1)}
}

// Kick asks Run to re-apply every publication's limits now rather than at the next
// interval: a VolumeAttributesClass changed on this node reaches running pods at once.
// Kicks coalesce, and never block.
func (th *Throttle) Kick() {
	select {
	case th.kick <- struct{}{}:
	default:
	}
}

// Run re-applies the limits of every publication every interval, or at once
// when kicked, until ctx ends; the first run is one interval after its start
// (Rebuild ran before the server) unless a kick comes first.
func (th *Throttle) Run(ctx context.Context) error {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		t := time.NewTimer(th.deps.Interval)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-th.kick:
		}
		th.Reconcile(ctx)
	}, 0)
	return nil
}
