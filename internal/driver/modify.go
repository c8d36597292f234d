package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// ControllerModifyVolume sets a volume's mutable parameters (a
// VolumeAttributesClass): its I/O limits, which the nodes apply to the pods
// using it (iolimits.go), and preallocation of its image. Only the keys given
// change; the whole request is checked before anything does.
func (d controllerServer) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (_ *csi.ControllerModifyVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	var m params.Mutable
	rq, err := d.resolve(ctx, rpcControllerModifyVolume, req.GetVolumeId(), poolset.Access{Secrets: req.GetSecrets()}, func() (err error) {
		m, err = params.ParseMutable(req.GetMutableParameters())
		return err
	})
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p, v := rq.id, rq.pool, rq.vol
	if err := m.ForLayout(v.Layout); err != nil {
		return nil, err
	}
	if m.Empty() {
		return &csi.ControllerModifyVolumeResponse{}, nil
	}
	before := *v
	// A volume's layout never changes: the check above holds for the record
	// Modify loads again under the volume's lock.
	v, err = p.Modify(ctx, vid, func(v *pool.Volume) error {
		m.Apply(v)
		return nil
	}, d.FS.Allocate)
	if err != nil {
		return nil, err
	}
	if before.IOLimits != v.IOLimits || before.Preallocate != v.Preallocate {
		klog.FromContext(ctx).Info("Modified volume", "volume", vid, "ioLimits", v.IOLimits, "preallocate", v.Preallocate)
	}
	return &csi.ControllerModifyVolumeResponse{}, nil
}
