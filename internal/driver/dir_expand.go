package driver

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// expandDir raises a dir volume's quota limit. Nothing changes on the nodes (a
// bind mount of a directory has no size of its own), so node expansion is never
// required. Shrinking is refused by returning the current, larger size, as the
// spec asks of a request already satisfied.
func (d *Driver) expandDir(ctx context.Context, p *pool.Pool, vid pool.VolumeID, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error) {
	size, err := pool.Capacity(r.GetRequiredBytes(), r.GetLimitBytes(), pool.MiB)
	if err != nil {
		return nil, poolStatus(err)
	}
	v, unlock, err := lockVolume(ctx, p, vid)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if size <= v.CapacityBytes {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: false}, nil
	}
	unlockPool, err := p.LockPool(ctx)
	if err != nil {
		return nil, poolStatus(err)
	}
	defer unlockPool()
	u, err := p.Usage()
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "%v", err)
	}
	if grow, avail := size-v.CapacityBytes, p.AvailableBytes(u); grow > avail {
		return nil, status.Errorf(codes.ResourceExhausted, "pool %s can back %d more bytes; growing volume %s by %d does not fit", p.Name, avail, vid, grow)
	}
	if v.Quota != nil && v.Quota.Enforced {
		b, err := d.quotaFor(ctx, p)
		if err != nil {
			return nil, err
		}
		if b.Kind() != v.Quota.Kind {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is limited by %s but the pool's filesystem now offers %s", vid, v.Quota.Kind, b.Kind())
		}
		if err := b.SetLimit(ctx, p.DataPath(vid), v.Quota.ID, size); err != nil {
			return nil, status.Errorf(codes.Internal, "raise limit of volume %s: %v", vid, err)
		}
	}
	old := v.CapacityBytes
	v.CapacityBytes = size
	if err := p.Save(v); err != nil {
		return nil, poolStatus(fmt.Errorf("limit raised to %d but not recorded: %w", size, err))
	}
	klog.FromContext(ctx).Info("Expanded dir volume", "volume", vid, "from", old, "to", size, "enforced", v.Quota != nil && v.Quota.Enforced)
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: false}, nil
}
