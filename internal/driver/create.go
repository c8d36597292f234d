package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// volumeCreate is a CreateVolume resolved before anything is written: what
// it asks for (params.Volume), its content source, and the pool, layout,
// topology and size of the new volume.
type volumeCreate struct {
	name string
	params.Volume
	src      *layout.ContentSource // nil for an empty volume
	source   *pool.ContentSource
	pool     *pool.Pool
	lay      layout.Layout
	fsType   string // what volume.json records
	topology map[string]string
	size     int64
}

// createRequest checks, parses and resolves a CreateVolume in one step, in
// this order: the name, the content source (NOT_FOUND when it does not
// exist), the parameters and capabilities, the pool (a StorageClass's share
// is mounted and laid out here), the topology, the size.
func (d controllerServer) createRequest(ctx context.Context, req *csi.CreateVolumeRequest) (*volumeCreate, error) {
	cr := &volumeCreate{name: req.GetName()}
	if err := params.CheckVolumeName(cr.name); err != nil {
		return nil, err
	}
	acc := poolset.Access{Secrets: req.GetSecrets()}
	var err error
	if cr.src, err = d.resolveContentSource(ctx, req.GetVolumeContentSource(), acc); err != nil {
		return nil, err
	}
	if cr.Volume, err = params.ParseVolume(req, cr.src.Params(), d.pools.Params()); err != nil {
		return nil, err
	}
	cr.lay = layout.Of(&d.Deps, cr.Params.Layout)
	if err := cr.lay.Allowed(cr.Caps); err != nil {
		return nil, err
	}
	cr.fsType = cr.lay.FSType(cr.Caps)
	if cr.pool, err = d.pools.ForCreate(ctx, cr.Params, req.GetVolumeCapabilities(), acc); err != nil {
		return nil, err
	}
	if cr.topology, err = d.pools.Place(cr.pool, req.GetAccessibilityRequirements()); err != nil {
		return nil, err
	}
	minimum := cr.lay.MinSize(cr.Caps)
	if cr.src == nil {
		if cr.size, err = pool.Capacity(req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes(), minimum); err != nil {
			return nil, err
		}
		return cr, nil
	}
	if err := cr.src.Check(cr.pool, cr.Params.Layout, cr.lay, cr.Caps); err != nil {
		return nil, err
	}
	if cr.size, err = cr.src.SourceSize(req.GetCapacityRange(), minimum); err != nil {
		return nil, err
	}
	cr.source = &cr.src.Record
	return cr, nil
}
