package driver

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// expand raises a dir volume's quota limit. Nothing changes on the nodes (a
// bind mount of a directory has no size of its own), so node expansion is never
// required. Shrinking is refused by returning the current, larger size, as the
// spec asks of a request already satisfied.
func (d dirLayout) expand(ctx context.Context, p *pool.Pool, vid pool.VolumeID, _ *pool.Volume, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error) {
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
		b, err := d.quotaFor(ctx, p)
		if err != nil {
			return err
		}
		if b.Kind() != v.Quota.Kind {
			return failf(errState, "volume %s is limited by %s but the pool's filesystem now offers %s", vid, v.Quota.Kind, b.Kind())
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

// expandNode: a directory has no size of its own to grow; the quota limit,
// raised by the controller, is all there is.
func (dirLayout) expandNode(_ context.Context, nv nodeVolume, _ *csi.NodeExpandVolumeRequest, _ string) (*csi.NodeExpandVolumeResponse, error) {
	return &csi.NodeExpandVolumeResponse{CapacityBytes: nv.vol.CapacityBytes}, nil
}

func (dirLayout) nodeExpansionRequired() bool { return false }
