package layout

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/fsx"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/quota"
)

// Volume context keys of dir volumes: the CO (and `kubectl get pv -o yaml`) sees
// whether the size it asked for is a limit or only a promise.
const (
	CtxQuota        = "quota"
	CtxSizeEnforced = "sizeEnforced"
)

// quotaBackends remembers, per pool, how the pool's filesystem limits dir
// volumes. Detection needs the pool mounted, so a pool that is not there yet is
// detected again on the next use instead of being remembered as unlimited.
type quotaBackends struct {
	mu sync.Mutex
	m  map[string]quota.Backend
}

func (d *Deps) QuotaFor(ctx context.Context, p *pool.Pool) (quota.Backend, error) {
	d.Quotas.mu.Lock()
	defer d.Quotas.mu.Unlock()
	if b, ok := d.Quotas.m[p.Name()]; ok {
		return b, nil
	}
	if err := p.Check(); err != nil {
		return nil, err
	}
	b := quota.Detect(ctx, p.Path())
	if d.Quotas.m == nil {
		d.Quotas.m = map[string]quota.Backend{}
	}
	d.Quotas.m[p.Name()] = b
	logQuota(ctx, p, b)
	return b, nil
}

func logQuota(ctx context.Context, p *pool.Pool, b quota.Backend) {
	if b.Enforced() {
		klog.FromContext(ctx).Info("Dir volumes of this pool get enforced sizes", "pool", p.Name(), "quota", b.Kind())
		return
	}
	klog.FromContext(ctx).Info("Dir volumes of this pool will NOT have their size enforced", "pool", p.Name(), "reason", b.Reason())
}

// allowed: a directory is shared by bind mounts, so every access mode works,
// but it is no block device.
func (dirLayout) Allowed(s params.Caps) error {
	if s.Access == pool.AccessBlock {
		return csierr.Failf(csierr.ErrInvalid, "layout dir volumes are directories: block access needs layout image")
	}
	return nil
}

// finishCreate makes the data directory of a dir volume still in state
// creating, with its quota, and marks it ready. A half-made data directory from
// an interrupted attempt holds no user data and is made again.
func (d dirLayout) FinishCreate(ctx context.Context, p *pool.Pool, v *pool.Volume) error {
	return d.FinishCreateDirWith(ctx, p, v, nil)
}

// finishCreateDirWith is finishCreateDir with a step that fills the new data
// directory (a clone's copy) before the volume is marked ready.
func (d *Deps) FinishCreateDirWith(ctx context.Context, p *pool.Pool, v *pool.Volume, fill func(data string) error) error {
	vid, _ := pool.ParseVolumeID(v.ID)
	b, err := d.QuotaFor(ctx, p)
	if err != nil {
		return err
	}
	if v.Quota != nil {
		// An interrupted attempt's limit; its directory goes next (b.Remove
		// refuses a link, which MakeData's RemoveAll then takes as a link).
		if err := b.Remove(ctx, p.DataPath(vid), v.Quota.ID); err != nil {
			klog.FromContext(ctx).Info("Not removing the half-made data's quota", "volume", vid, "err", err)
		}
	}
	id, err := p.MakeData(ctx, v, b.Kind(), func(data string, claim func(uint64) (bool, error)) (uint64, error) {
		return b.Create(ctx, data, v.CapacityBytes, claim)
	})
	if err != nil {
		return fmt.Errorf("create data directory of volume %s (%s): %w", vid, b.Kind(), err)
	}
	if fill != nil {
		if err := fill(p.DataPath(vid)); err != nil {
			return err
		}
	}
	v.Quota = &pool.DirQuota{Kind: b.Kind(), Enforced: b.Enforced(), ID: id, Reason: b.Reason()}
	if err := p.MarkReady(v); err != nil {
		return err
	}
	log := klog.FromContext(ctx)
	if b.Enforced() {
		log.Info("Created dir volume", "volume", v.ID, "name", v.Name, "capacity", v.CapacityBytes, "quota", b.Kind(), "quotaID", id)
	} else {
		log.Info("Created dir volume; its size is NOT enforced", "volume", v.ID, "name", v.Name, "capacity", v.CapacityBytes, "reason", b.Reason())
	}
	return nil
}

// volumeContext says whether the size is enforced.
func (dirLayout) VolumeContext(v *pool.Volume, ctx map[string]string) {
	enforced, kind := false, quota.KindNone
	if v.Quota != nil {
		enforced, kind = v.Quota.Enforced, v.Quota.Kind
	}
	ctx[CtxQuota] = kind
	ctx[CtxSizeEnforced] = strconv.FormatBool(enforced)
}

// delete removes exactly one dir volume: its subvolume or quota, then its
// directory, never anything above it (the pool, the volumes directory, siblings).
func (d dirLayout) Delete(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) error {
	if points, err := d.Mounts.MountsBelow(p.Dir(vid)); err != nil {
		return fmt.Errorf("inspect mounts of volume %s: %w", vid, err)
	} else if len(points) > 0 {
		return csierr.Failf(csierr.ErrInUse, "volume %s is mounted on this node at %s; unpublish and unstage it before deleting", vid, strings.Join(points, ", "))
	}
	// A bind mount of the data elsewhere (a target left behind) shows the same
	// files: removing them would empty a volume a pod still uses.
	if p.DataExists(vid) {
		if other, err := d.Mounts.MountedElsewhere(p.DataPath(vid)); err != nil {
			return fmt.Errorf("inspect mounts of volume %s: %w", vid, err)
		} else if other != "" {
			return csierr.Failf(csierr.ErrInUse, "volume %s is mounted on this node at %s; unpublish and unstage it before deleting", vid, other)
		}
	}
	// A link in place of the data directory is removed as a link; nothing is
	// deleted or unquota'd through it.
	if h, err := p.OpenData(vid); err == nil {
		_ = h.Close()
	} else if errors.Is(err, pool.ErrCorrupt) {
		v = nil // no quota step: RemoveAll takes the link itself
	}
	var q pool.DirQuota
	if v != nil && v.Quota != nil {
		q = *v.Quota
	}
	return p.DeleteWith(ctx, vid, func(data string) error {
		if q.Kind == "" || q.Kind == quota.KindNone {
			return nil
		}
		b, err := d.QuotaFor(ctx, p)
		if err != nil || b.Kind() != q.Kind {
			return nil // the files still go; a stale quota entry is harmless
		}
		if err := b.Remove(ctx, data, q.ID); err != nil {
			klog.FromContext(ctx).Error(err, "Removing the quota of a deleted volume", "volume", vid)
		}
		return nil
	})
}

func (dirLayout) MinSize(params.Caps) int64 { return mount.MinSize("") }

func (dirLayout) MountFS(*pool.Volume) string { return "" }

// fsType: a dir volume has the pool's filesystem, whatever the CO names.
func (dirLayout) FSType(params.Caps) string              { return "" }
func (dirLayout) SameFS(params.Caps, string) bool        { return true }
func (dirLayout) Fence(*pool.Volume, string, bool) error { return nil }

// expand raises a dir volume's quota limit. Nothing changes on the nodes (a
// bind mount of a directory has no size of its own), so node expansion is never
// required. Shrinking is refused by returning the current, larger size, as the
// spec asks of a request already satisfied.
func (d dirLayout) Expand(ctx context.Context, p *pool.Pool, vid pool.VolumeID, _ *pool.Volume, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error) {
	size, err := pool.Capacity(r.GetRequiredBytes(), r.GetLimitBytes(), pool.MiB)
	if err != nil {
		return nil, err
	}
	old := int64(-1)
	v, err := p.GrowDir(ctx, vid, size, func(v *pool.Volume, size int64) error {
		old = v.CapacityBytes
		if v.Quota == nil || !v.Quota.Enforced {
			return nil
		}
		b, err := d.QuotaFor(ctx, p)
		if err != nil {
			return err
		}
		if b.Kind() != v.Quota.Kind {
			return csierr.Failf(csierr.ErrState, "volume %s is limited by %s but the pool's filesystem now offers %s", vid, v.Quota.Kind, b.Kind())
		}
		if err := b.SetLimit(ctx, p.DataPath(vid), v.Quota.ID, size); err != nil {
			return fmt.Errorf("raise limit of volume %s: %w", vid, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if old < 0 {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: false}, nil
	}
	klog.FromContext(ctx).Info("Expanded dir volume", "volume", vid, "from", old, "to", v.CapacityBytes, "enforced", v.Quota != nil && v.Quota.Enforced)
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: false}, nil
}

func (dirLayout) NodeExpansionRequired() bool { return false }

// cloneFrom makes the new dir volume's data directory and copies the source's
// tree into it.
func (d dirLayout) CloneFrom(ctx context.Context, p *pool.Pool, v *pool.Volume, src *ContentSource) error {
	var from *pool.Handle
	var err error
	if src.IsSnapshot() {
		from, err = p.Snapshots().OpenData(src.SnapID)
	} else {
		from, err = p.OpenData(src.VolID)
	}
	if err != nil {
		return fmt.Errorf("source of volume %s: %w", v.ID, err)
	}
	defer from.Close()
	return d.FinishCreateDirWith(ctx, p, v, func(data string) error {
		if err := fsx.CopyTree(ctx, from.Path(), data); err != nil {
			return fmt.Errorf("copy source of volume %s: %w", v.ID, err)
		}
		return nil
	})
}
