// Package ephemeral is the lifecycle of CSI ephemeral inline volumes
// (docs/ephemeral.md): parsed from a NodePublishVolume's attributes, made,
// formatted, recorded and mounted at the publish, taken down at the
// unpublish, swept when no unpublish came. It takes a narrow Deps, never the
// driver: this node's kernel and records (layout.Deps), the configured
// pools, a lock function and the lease.
package ephemeral

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// CSI ephemeral inline volumes (docs/ephemeral.md): kubelet calls
// NodePublishVolume, with no controller call and no stage, for a pod's
// `csi:` volume, and NodeUnpublishVolume when the pod goes. The volume is an
// image volume of a pool on this node, made at the publish and removed at the
// unpublish; a sweep removes those no unpublish reached.

// Volume attributes of an inline volume (the pod's csi.volumeAttributes).
const (
	AttrSize = "size"
	// ParamPool and ParamFSType are the other two.

	// ContextKey is what kubelet (podInfoOnMount) puts in the volume
	// context of an inline volume's NodePublishVolume.
	ContextKey = params.K8sPrefix + "ephemeral"
)

// DefaultSize is an inline volume's size when its attributes name none.
const DefaultSize = pool.GiB

// DefaultSweep is how often the node looks for inline volumes no
// unpublish removed (the driver's Options.EphemeralSweepInterval).
const DefaultSweep = 10 * time.Minute

// The holders under which inline volumes take a handle's in-process lock
// (internal/driver/request.go lists them).
const (
	HolderPublish   = "NodePublishVolume"
	HolderUnpublish = "NodeUnpublishVolume"
	HolderSweep     = "sweep"
)

// Deps is what inline volumes act through.
type Deps struct {
	// NodeID is this node: an inline volume is one node's.
	NodeID string
	// Node is this node's kernel, its stage records and request paths.
	Node *layout.Deps
	// Configured lists the operator's pools (inline volumes live only in
	// them), Pool returns a pool by name, Topology is this node's segment.
	Configured func() []string
	Pool       func(name string) *pool.Pool
	Topology   func() map[string]string
	// Default is the pool of inline volumes whose attributes name none (nil
	// for none, DefaultPool).
	Default *pool.Pool
	// Lock takes a handle's in-process lock as a call of holder would,
	// failing at once when it is held.
	Lock func(id, holder string) (release func(), err error)
	// EnsureLease makes sure this node holds its lease in p before it takes
	// an image read-write (as a stage does).
	EnsureLease func(ctx context.Context, p *pool.Pool) error
	// Forget drops what the driver keeps of a volume that is gone.
	Forget func(volume string)
}

// Volumes are this node's inline volumes.
type Volumes struct{ deps Deps }

// New returns the inline volumes of deps.
func New(deps Deps) *Volumes { return &Volumes{deps: deps} }

// ephemeralSpec is a parsed inline-volume NodePublishVolume.
type ephemeralSpec struct {
	handle string
	pool   *pool.Pool
	size   int64
	fsType string
	caps   params.Caps
	flags  []string
	pod    string
}

func Requested(volumeContext map[string]string) bool {
	return volumeContext[ContextKey] == "true"
}

// DefaultPool is the pool named (--ephemeral-pool), else the first local
// pool of pools (in the configuration's order) that allows inline volumes;
// nil for none.
func DefaultPool(pools []*pool.Pool, named string) (*pool.Pool, error) {
	if named != "" {
		for _, p := range pools {
			if p.Name() == named {
				if !p.AllowsEphemeral() {
					return nil, fmt.Errorf("ephemeral pool %s does not allow ephemeral inline volumes (a shared pool needs ephemeral: true in its config)", p.Name())
				}
				return p, nil
			}
		}
		return nil, fmt.Errorf("ephemeral pool %s is not configured", named)
	}
	for _, p := range pools {
		if !p.Shared() && p.AllowsEphemeral() {
			return p, nil
		}
	}
	return nil, nil
}

// parseEphemeral checks everything an inline volume's publish carries before
// anything is made: the handle, the capability, the attributes.
func (e *Volumes) parseEphemeral(req *csi.NodePublishVolumeRequest) (ephemeralSpec, error) {
	s := ephemeralSpec{handle: req.GetVolumeId(), size: DefaultSize}
	if err := pool.ValidateEphemeralHandle(s.handle); err != nil {
		return s, status.Error(codes.InvalidArgument, err.Error())
	}
	vc := req.GetVolumeCapability()
	if vc == nil {
		return s, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if vc.GetMount() == nil {
		return s, status.Error(codes.InvalidArgument, "an ephemeral inline volume is a filesystem: volume_capability must be a mount")
	}
	caps, err := params.ParseCaps([]*csi.VolumeCapability{vc}, "")
	if err != nil {
		return s, err
	}
	for _, m := range caps.Modes {
		if m != csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER && m != csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER &&
			m != csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER && m != csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY {
			return s, status.Errorf(codes.InvalidArgument, "access mode %s: an ephemeral inline volume is one pod's, on one node", m)
		}
	}
	s.caps = caps
	attrFS, err := e.parseEphemeralAttrs(&s, req.GetVolumeContext())
	if err != nil {
		return s, err
	}
	if attrFS != "" && caps.FSType != "" && attrFS != caps.FSType {
		return s, status.Errorf(codes.InvalidArgument, "volume attribute fsType=%s contradicts the volume's fsType %s", attrFS, caps.FSType)
	}
	s.fsType = firstNonEmpty(attrFS, caps.FSType, params.DefaultFSType)
	s.caps.FSType = s.fsType
	if err := e.ephemeralPoolOf(&s); err != nil {
		return s, err
	}
	if s.size, err = pool.Capacity(s.size, 0, mount.MinSize(s.fsType)); err != nil {
		return s, err
	}
	s.flags = vc.GetMount().GetMountFlags()
	if err := mount.CheckOptions(s.fsType, s.flags); err != nil {
		return s, status.Errorf(codes.InvalidArgument, "ephemeral volume %s: %v", s.handle, err)
	}
	return s, nil
}

// parseEphemeralAttrs reads the volume attributes into s (size, pool, pod)
// and returns the fsType they name ("" for none).
func (e *Volumes) parseEphemeralAttrs(s *ephemeralSpec, attrs map[string]string) (string, error) {
	var attrFS, ns, name string
	var err error
	for k, v := range attrs {
		switch {
		case k == AttrSize:
			if s.size, err = parseEphemeralSize(v); err != nil {
				return "", err
			}
		case k == params.ParamFSType:
			attrFS = strings.ToLower(v)
			if !mount.SupportedFS(attrFS) {
				return "", status.Errorf(codes.InvalidArgument, "volume attribute fsType=%q: supported filesystems are ext4, xfs, btrfs", v)
			}
		case k == params.ParamPool:
			if s.pool = e.deps.Pool(v); s.pool == nil || s.pool.Config().Share != nil || !slices.Contains(e.deps.Configured(), v) {
				return "", status.Errorf(codes.InvalidArgument, "volume attribute pool=%q: no such pool here (pools: %s)", v, poolset.JoinNames(e.deps.Configured()))
			}
		case k == params.K8sPrefix+"pod.namespace":
			ns = v
		case k == params.K8sPrefix+"pod.name":
			name = v
		case strings.HasPrefix(k, params.K8sPrefix):
			// pod.uid, serviceAccount.name, ephemeral: kubelet's, as sent.
		default:
			return "", status.Errorf(codes.InvalidArgument, "unknown volume attribute %q of an ephemeral inline volume (known: %s, %s, %s)", k, AttrSize, params.ParamFSType, params.ParamPool)
		}
	}
	if ns != "" || name != "" {
		s.pod = ns + "/" + name
		if len(s.pod) > 2*pool.MaxNameLength {
			return "", status.Error(codes.InvalidArgument, "pod namespace and name are too long")
		}
	}
	return attrFS, nil
}

// ephemeralPoolOf settles s's pool: the one its attributes named, else the
// default, and refuses one that does not allow inline volumes.
func (e *Volumes) ephemeralPoolOf(s *ephemeralSpec) error {
	if s.pool == nil {
		if s.pool = e.deps.Default; s.pool == nil {
			return status.Errorf(codes.InvalidArgument, "no local pool of node %s allows ephemeral inline volumes; name one with the pool attribute (pools: %s)", e.deps.NodeID, poolset.JoinNames(e.deps.Configured()))
		}
	}
	if !s.pool.AllowsEphemeral() {
		why := "its config says ephemeral: false"
		if s.pool.Shared() {
			why = "it is shared and its config does not say ephemeral: true"
		}
		return status.Errorf(codes.InvalidArgument, "pool %s does not allow ephemeral inline volumes: %s (docs/ephemeral.md)", s.pool.Name(), why)
	}
	return nil
}

// parseEphemeralSize reads the size attribute, a Kubernetes quantity.
func parseEphemeralSize(v string) (int64, error) {
	if len(v) > 64 {
		return 0, status.Error(codes.InvalidArgument, "volume attribute size is longer than any size")
	}
	q, err := resource.ParseQuantity(v)
	if err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "volume attribute size=%q: not a quantity (say 1Gi, 500Mi): %v", v, err)
	}
	if q.Sign() <= 0 {
		return 0, status.Errorf(codes.InvalidArgument, "volume attribute size=%q: must be positive", v)
	}
	if q.CmpInt64(pool.MaxCapacity) > 0 {
		return 0, csierr.Failf(pool.ErrOutOfRange, "volume attribute size=%q is above the largest volume, %d bytes", v, int64(pool.MaxCapacity))
	}
	return q.Value(), nil
}

// findEphemeral finds the inline volume of handle in the pools that allow
// them: its pool and ID, or a nil pool when none holds it. A pool that cannot
// be read is an error (UNAVAILABLE), not "none": the volume may be there.
func (e *Volumes) findEphemeral(handle string) (*pool.Pool, pool.VolumeID, *pool.Volume, error) {
	name := pool.EphemeralName(handle)
	for _, pn := range e.deps.Configured() {
		p := e.deps.Pool(pn)
		if !p.AllowsEphemeral() {
			continue
		}
		vid := p.NewID(name)
		v, err := p.Load(vid)
		if errors.Is(err, pool.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, vid, nil, fmt.Errorf("look for ephemeral volume %s in pool %s: %w", handle, pn, err)
		}
		if v.Ephemeral == nil || v.Ephemeral.Handle != handle {
			return nil, vid, nil, csierr.Failf(csierr.ErrState, "volume %s of pool %s has the key of ephemeral volume %s but is not it", vid, pn, handle)
		}
		return p, vid, v, nil
	}
	return nil, pool.VolumeID{}, nil, nil
}

// Publish makes, mounts and records an inline volume at target.
// A retry finds what an earlier call made and converges; a failure removes
// everything unless the target already shows the volume (a pod uses it).
func (e *Volumes) Publish(ctx context.Context, req *csi.NodePublishVolumeRequest, target string) error {
	s, err := e.parseEphemeral(req)
	if err != nil {
		return err
	}
	release, err := e.deps.Lock(s.handle, HolderPublish)
	if err != nil {
		return err
	}
	defer release()
	found, _, _, err := e.findEphemeral(s.handle)
	if err != nil {
		return err
	}
	if found != nil && found != s.pool {
		return csierr.Failf(pool.ErrExists, "ephemeral volume %s exists in pool %s, the request names pool %s", s.handle, found.Name(), s.pool.Name())
	}
	p := s.pool
	readOnly := req.GetReadonly() || params.ReadOnlyMode(req.GetVolumeCapability().GetAccessMode().GetMode())
	var topology map[string]string
	if !p.Shared() {
		topology = e.deps.Topology()
	}
	v, err := p.Reserve(ctx, pool.Spec{
		Name:          pool.EphemeralName(s.handle),
		Layout:        pool.LayoutImage,
		AccessType:    pool.AccessFilesystem,
		FSType:        s.fsType,
		CapacityBytes: s.size,
		Topology:      topology,
		Ephemeral:     &pool.EphemeralRecord{Handle: s.handle, Node: e.deps.NodeID, Target: target, Pod: s.pod},
	})
	if err != nil {
		return err
	}
	vid := p.NewID(v.Name)
	if err := sameEphemeral(v, s, e.deps.NodeID, target); err != nil {
		return err // another publish's volume: not this call's to remove
	}
	if err := e.makeEphemeral(ctx, p, vid, v, s, target, readOnly); err != nil {
		e.rollbackEphemeral(ctx, p, vid, target)
		return err
	}
	return nil
}

// sameEphemeral refuses a volume of the handle's key that this publish did
// not ask for: other attributes, another node's or another target's.
func sameEphemeral(v *pool.Volume, s ephemeralSpec, node, target string) error {
	e := v.Ephemeral
	switch {
	case e == nil || e.Handle != s.handle:
		return csierr.Failf(csierr.ErrState, "volume %s has the key of ephemeral volume %s but is not it", v.ID, s.handle)
	case e.Node != node:
		return csierr.Failf(csierr.ErrInUse, "ephemeral volume %s belongs to node %s", s.handle, e.Node)
	case e.Target != target:
		return csierr.Failf(pool.ErrExists, "ephemeral volume %s is published at %s, not %s", s.handle, e.Target, target)
	case v.CapacityBytes != s.size || v.FSType != s.fsType:
		return csierr.Failf(pool.ErrExists, "ephemeral volume %s exists with size %d and fsType %s; the request asks %d and %s", s.handle, v.CapacityBytes, v.FSType, s.size, s.fsType)
	}
	return nil
}

// makeEphemeral converges a reserved inline volume to "formatted, recorded
// as this node's, mounted at target".
func (e *Volumes) makeEphemeral(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, s ephemeralSpec, target string, readOnly bool) error {
	lay := layout.Of(e.deps.Node, pool.LayoutImage)
	var err error
	if v.State == pool.StateCreating {
		if v, err = p.Finish(ctx, vid, func(v *pool.Volume) error { return lay.FinishCreate(ctx, p, v) }); err != nil {
			return err
		}
	}
	// The stage record says this node holds the volume: the controller's
	// DeleteVolume refuses it, and on a shared pool it fences other nodes.
	err = p.Update(ctx, vid, func(v *pool.Volume) (bool, error) {
		if err := lay.Fence(v, e.deps.NodeID, readOnly); err != nil {
			return false, err
		}
		for _, r := range v.Staged {
			if r.Node == e.deps.NodeID && r.Path == target && r.ReadOnly == readOnly {
				return false, nil
			}
		}
		v.SetStaged(e.deps.NodeID, target, readOnly, time.Now())
		return true, nil
	})
	if err != nil {
		return err
	}
	h, err := p.OpenImage(vid)
	if err != nil {
		return err
	}
	defer h.Close()
	info, mounted, err := e.deps.Node.Mounts.Info(target)
	if err != nil {
		return fmt.Errorf("inspect %s: %w", target, err)
	}
	if mounted {
		if !e.deps.Node.ShowsVolume(p, vid, target, info) {
			return csierr.Failf(csierr.ErrPathTaken, "target path %s already holds another mount (%s)", target, info.Source)
		}
		if info.ReadOnly != readOnly {
			return csierr.Failf(csierr.ErrPathTaken, "ephemeral volume %s is published at %s with read-only=%v, the request asks read-only=%v", s.handle, target, info.ReadOnly, readOnly)
		}
		return nil
	}
	if !readOnly {
		// As for a stage: a node that cannot renew its lease in a shared
		// pool would not fence itself if cut off, so it takes no image
		// read-write meanwhile.
		if err := e.deps.EnsureLease(ctx, p); err != nil {
			return err
		}
	}
	nv := layout.NodeVolume{ID: vid, Pool: p, Vol: v, Caps: s.caps}
	dev, err := e.deps.Node.AttachImage(ctx, nv, h.Path())
	if err != nil {
		return err
	}
	found, err := e.deps.Node.Devs.DiskFormat(ctx, dev)
	if err != nil {
		return fmt.Errorf("inspect %s: %w", dev, err)
	}
	if found != v.FSType {
		return csierr.Failf(csierr.ErrState, "ephemeral volume %s should hold %s but %s holds %q; refusing to mount it", s.handle, v.FSType, dev, found)
	}
	opts := slices.Clone(s.flags)
	if readOnly {
		opts = append(opts, "ro")
	}
	if v.FSType == "xfs" && !slices.Contains(opts, "nouuid") {
		opts = append(opts, "nouuid")
	}
	if err := e.deps.Node.Mounts.Mount(ctx, dev, target, v.FSType, opts); err != nil {
		return fmt.Errorf("mount %s at %s: %w", dev, target, err)
	}
	klog.FromContext(ctx).Info("Published ephemeral volume", "handle", s.handle, "volume", vid, "pod", s.pod,
		"device", dev, "target", target, "capacity", v.CapacityBytes, "fsType", v.FSType, "readOnly", readOnly)
	return nil
}

// rollbackEphemeral undoes a failed publish: unless the target shows the
// volume (an earlier publish a pod may use), the volume goes entirely.
func (e *Volumes) rollbackEphemeral(ctx context.Context, p *pool.Pool, vid pool.VolumeID, target string) {
	if info, mounted, err := e.deps.Node.Mounts.Info(target); err != nil || (mounted && e.deps.Node.ShowsVolume(p, vid, target, info)) {
		return
	}
	if err := e.removeEphemeral(ctx, p, vid, ""); err != nil {
		klog.FromContext(ctx).Error(err, "Removing an ephemeral volume after its publish failed; the sweep retries", "volume", vid)
	}
}

// removeEphemeral takes an inline volume down and deletes it: the mount at
// target (when named, and only if it is the volume's), the loop device (which
// refuses while anything else mounts it), the volume. It refuses a volume
// that is not this node's inline volume.
func (e *Volumes) removeEphemeral(ctx context.Context, p *pool.Pool, vid pool.VolumeID, target string) error {
	unlock, err := p.LockVolume(ctx, vid)
	if errors.Is(err, pool.ErrNotFound) {
		return p.Delete(ctx, vid) // gone, or a delete that crashed half way
	} else if err != nil {
		return err
	}
	defer unlock()
	v, err := p.Load(vid)
	switch {
	case errors.Is(err, pool.ErrNotFound):
	case err != nil:
		return csierr.Failf(csierr.ErrState, "volume %s: %v; not removing a volume whose metadata cannot be read (poolcsi pool check names the fault)", vid, err)
	case v.Ephemeral == nil:
		return csierr.Failf(csierr.ErrState, "volume %s is not an ephemeral inline volume", vid)
	case v.Ephemeral.Node != e.deps.NodeID:
		return csierr.Failf(csierr.ErrInUse, "ephemeral volume %s belongs to node %s", v.Ephemeral.Handle, v.Ephemeral.Node)
	}
	if target != "" {
		if err := e.deps.Node.Mounts.UnmountChecked(ctx, target, e.deps.Node.OnlyVolume(p, vid, "target path", target)); err != nil {
			return fmt.Errorf("unmount %s: %w", target, err)
		}
	}
	image := p.ImagePath(vid)
	if err := e.deps.Node.Loops.Detach(ctx, image); err != nil {
		if errors.Is(err, mount.ErrDeviceBusy) {
			return csierr.Failf(csierr.ErrInUse, "ephemeral volume %s is still mounted elsewhere on this node: %v", vid, err)
		}
		return fmt.Errorf("detach loop device of %s: %w", image, err)
	}
	e.deps.Node.ForgetStages(ctx, vid)
	if err := p.Delete(ctx, vid); err != nil {
		return err
	}
	e.deps.Forget(vid.String())
	return nil
}

// Unpublish is NodeUnpublishVolume of an inline volume's handle:
// unmount, detach, delete; nothing found is done.
func (e *Volumes) Unpublish(ctx context.Context, handle, target string) error {
	release, err := e.deps.Lock(handle, HolderUnpublish)
	if err != nil {
		return err
	}
	defer release()
	p, vid, v, err := e.findEphemeral(handle)
	if err != nil {
		return err
	}
	if p == nil {
		// Nothing of it is here: only a mount of nothing poolcsi knows could
		// be at target, and it is not ours to take down.
		if err := e.deps.Node.Mounts.UnmountChecked(ctx, target, e.deps.Node.OnlyVolume(nil, vid, "target path", target)); err != nil {
			return fmt.Errorf("unmount %s: %w", target, err)
		}
		return nil
	}
	if v.Ephemeral.Target != target {
		// Another path of the same pod volume: take down only that mount.
		return e.deps.Node.Mounts.UnmountChecked(ctx, target, e.deps.Node.OnlyVolume(p, vid, "target path", target))
	}
	if err := e.removeEphemeral(ctx, p, vid, target); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Unpublished and deleted ephemeral volume", "handle", handle, "volume", vid, "pod", v.Ephemeral.Pod, "target", target)
	return nil
}

// Ref resolves the handle of an inline volume to its volume, for
// the node calls that name it (NodeGetVolumeStats).
func (e *Volumes) Ref(handle string) (*pool.Pool, pool.VolumeID, error) {
	p, vid, _, err := e.findEphemeral(handle)
	if err != nil {
		return nil, vid, err
	}
	if p == nil {
		return nil, vid, csierr.Failf(pool.ErrNotFound, "ephemeral volume %s does not exist on node %s", handle, e.deps.NodeID)
	}
	return p, vid, nil
}

// Sweep removes this node's inline volumes whose target no longer
// shows them and whose handle no call holds: what a driver or kubelet that
// stopped between a publish and its unpublish, or a node that rebooted, left.
// One whose target still shows it is kept: kubelet will unpublish it. It
// returns how many it removed.
func (e *Volumes) Sweep(ctx context.Context) int {
	logger := klog.FromContext(ctx)
	removed := 0
	for _, pn := range e.deps.Configured() {
		p := e.deps.Pool(pn)
		if p.Check() != nil {
			continue // unavailable: the next sweep looks again
		}
		entries, _, err := p.ListPage("", 0, func(ent pool.Entry) bool {
			return ent.Err == nil && ent.Volume.Ephemeral != nil && ent.Volume.Ephemeral.Node == e.deps.NodeID
		})
		if err != nil {
			logger.Error(err, "Listing a pool for ephemeral volumes to sweep", "pool", pn)
			continue
		}
		for _, ent := range entries {
			if ctx.Err() != nil {
				return removed
			}
			if e.sweepOne(ctx, p, ent.ID, ent.Volume.Ephemeral) {
				removed++
			}
		}
	}
	logger.V(2).Info("Swept ephemeral volumes", "removed", removed)
	return removed
}

func (e *Volumes) sweepOne(ctx context.Context, p *pool.Pool, vid pool.VolumeID, rec *pool.EphemeralRecord) bool {
	logger := klog.FromContext(ctx)
	release, err := e.deps.Lock(rec.Handle, HolderSweep)
	if err != nil {
		return false // a publish or unpublish is under way: it decides
	}
	defer release()
	// The recorded target is pool content: checked like a request's path
	// before it is looked at.
	if target, err := e.deps.Node.RequestPath("target", rec.Target); err == nil {
		if info, mounted, err := e.deps.Node.Mounts.Info(target); err != nil || (mounted && e.deps.Node.ShowsVolume(p, vid, target, info)) {
			return false // in use (or unknown): kubelet unpublishes it
		}
	}
	if err := e.removeEphemeral(ctx, p, vid, ""); err != nil {
		logger.Error(err, "Sweeping an ephemeral volume whose target no longer holds it; the next sweep retries", "handle", rec.Handle, "volume", vid, "pod", rec.Pod)
		return false
	}
	logger.Info("Swept ephemeral volume no unpublish removed", "handle", rec.Handle, "volume", vid, "pod", rec.Pod, "target", rec.Target)
	return true
}

func firstNonEmpty(s ...string) string {
	for _, x := range s {
		if x != "" {
			return x
		}
	}
	return ""
}
