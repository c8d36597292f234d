package driver

import (
	"context"
	"errors"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/csilegacy"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// StorageClass parameters poolcsi understands. Kubernetes' own csi.storage.k8s.io/*
// keys are accepted as sent; any other key is refused so a typo in a StorageClass
// fails loudly instead of silently giving the default.
// They are parsed in internal/params.
const (
	ParamPool   = params.ParamPool
	ParamLayout = params.ParamLayout
	ParamFSType = params.ParamFSType
)

var controllerCaps = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
	csi.ControllerServiceCapability_RPC_GET_VOLUME,
	csi.ControllerServiceCapability_RPC_GET_CAPACITY,
	csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
	csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
	csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
	csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
	csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
	csilegacy.ControllerVolumeCondition,
}

func (d controllerServer) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	out := make([]*csi.ControllerServiceCapability, 0, len(controllerCaps)+len(snapshotCaps))
	for _, c := range append(controllerCaps[:len(controllerCaps):len(controllerCaps)], snapshotCaps...) {
		if c == csi.ControllerServiceCapability_RPC_EXPAND_VOLUME && d.opts.ExpandOnNode {
			continue
		}
		out = append(out, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}},
		})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: out}, nil
}

func (d controllerServer) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (_ *csi.CreateVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	cr, err := d.createRequest(ctx, req)
	if err != nil {
		return nil, err
	}
	p, lay, src := cr.pool, cr.lay, cr.src
	id := p.NewID(cr.name)
	release, err := d.hold(id.String(), holdCreateVolume)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := d.pools.NameInOther(cr.name, p); err != nil {
		return nil, err
	}

	v, err := p.Reserve(ctx, pool.Spec{
		Name:          cr.name,
		Layout:        cr.Params.Layout,
		AccessType:    cr.Caps.Access,
		FSType:        cr.fsType,
		CapacityBytes: cr.size,
		Parameters:    cr.Params.Keep,
		Topology:      cr.topology,
		Source:        cr.source,
		IOLimits:      cr.Mutable.IOLimits,
		Preallocate:   cr.Mutable.Preallocate,
	})
	if err != nil {
		return nil, err
	}
	if err := d.CreateCompatible(v, cr.Caps, req.GetCapacityRange(), cr.Mutable); err != nil {
		return nil, csierr.Failf(pool.ErrExists, "volume %q exists with other attributes: %w", cr.name, err)
	}
	if !layout.SameSource(v.Source, cr.source) {
		return nil, csierr.Failf(pool.ErrExists, "volume %q exists with another content source", cr.name)
	}
	if v.State == pool.StateCreating {
		var made error // make's own error: a source it cannot find is no deleted volume
		v, err = p.Finish(ctx, id, func(v *pool.Volume) error {
			if src != nil {
				made = d.finishClone(ctx, p, v, src)
			} else {
				made = lay.FinishCreate(ctx, p, v)
			}
			return made
		})
		if made == nil && errors.Is(err, pool.ErrNotFound) {
			return nil, csierr.Failf(pool.ErrBusy, "volume %q was deleted while it was being created; retry", cr.name)
		}
		if err != nil {
			return nil, err
		}
	}
	return &csi.CreateVolumeResponse{Volume: d.csiVolume(p, v)}, nil
}

func (d controllerServer) csiVolume(p *pool.Pool, v *pool.Volume) *csi.Volume {
	out := &csi.Volume{
		VolumeId:      d.pools.WireID(p, v.ID),
		CapacityBytes: v.CapacityBytes,
		VolumeContext: map[string]string{ParamPool: p.Name(), ParamLayout: string(v.Layout)},
	}
	if p.Config().Share != nil {
		// NodeStageVolume and ControllerPublishVolume get the volume context:
		// the share's options reach every node this way. Never a secret.
		out.VolumeContext[ParamShareType] = p.Config().Share.Type
		out.VolumeContext[ParamShareSource] = p.Config().Share.Source
		if o := v.Parameters[ParamShareOptions]; o != "" {
			out.VolumeContext[ParamShareOptions] = o
		}
	}
	d.layoutOf(v.Layout).VolumeContext(v, out.VolumeContext)
	out.ContentSource = d.csiContentSource(p, v.Source)
	if len(v.Topology) > 0 {
		out.AccessibleTopology = []*csi.Topology{{Segments: v.Topology}}
	}
	return out
}

func (d controllerServer) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (_ *csi.DeleteVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	rq, err := d.resolve(ctx, rpcDeleteVolume, req.GetVolumeId(), poolset.Access{Secrets: req.GetSecrets()}, nil)
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p := rq.id, rq.pool
	if p == nil {
		// Not a pool of this driver, or a share without one: nothing of the
		// volume exists there. A share that cannot be mounted is UNAVAILABLE:
		// the provisioner retries, nothing is said deleted that was not.
		return &csi.DeleteVolumeResponse{}, nil
	}
	unlock, err := p.LockVolume(ctx, vid)
	if errors.Is(err, pool.ErrNotFound) {
		// Gone, or renamed away by a delete that crashed before removing it:
		// finish that one (it passed every check below before the rename).
		return &csi.DeleteVolumeResponse{}, p.Delete(ctx, vid)
	} else if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := p.Load(vid)
	switch {
	case err == nil && v.Ephemeral != nil:
		return nil, csierr.Failf(csierr.ErrInUse, "volume %s is the ephemeral inline volume %s of pod %s on node %s: only that node's NodeUnpublishVolume (or its sweep) removes it", vid, v.Ephemeral.Handle, v.Ephemeral.Pod, v.Ephemeral.Node)
	case err == nil && v.IsStaged():
		var where []string
		for _, s := range v.Staged {
			where = append(where, s.Node+":"+s.Path)
		}
		return nil, csierr.Failf(csierr.ErrInUse, "volume %s is still staged on %s; unstage it before deleting", vid, strings.Join(where, ", "))
	case err == nil && len(v.Published) > 0:
		return nil, publishedError(v)
	case err != nil && !errors.Is(err, pool.ErrNotFound):
		// Damaged, or written by a newer driver: it may record nodes that still
		// hold the volume, so nothing is deleted on a guess.
		return nil, csierr.Failf(csierr.ErrState,
			"volume %s: %v. poolcsi does not delete a volume whose metadata it cannot read: it may still be staged or published. "+
				"Repair %s (poolcsi pool check names the fault) or, if the data is no longer wanted, remove the volume's directory by hand",
			vid, err, p.MetadataPath(vid))
	}
	// No metadata at all is a create interrupted before it wrote any: nothing
	// holds it, and an image layout's delete removes whatever it left.
	lay := d.layoutOf(pool.LayoutImage)
	if err == nil {
		lay = d.layoutOf(v.Layout)
	} else {
		v = nil
	}
	if err := lay.Delete(ctx, p, vid, v); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Deleted volume", "volume", vid)
	return &csi.DeleteVolumeResponse{}, nil
}

func (d controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (_ *csi.ValidateVolumeCapabilitiesResponse, err error) {
	defer csierr.ToStatus(&err)
	rq, err := d.resolve(ctx, rpcValidateVolumeCapabilities, req.GetVolumeId(), poolset.Access{}, func() error {
		if len(req.GetVolumeCapabilities()) == 0 {
			return status.Error(codes.InvalidArgument, "volume_capabilities are required")
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	v := rq.vol
	if _, err := params.ParseCreate(req.GetParameters(), d.pools.Params()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	caps, err := params.ParseCaps(req.GetVolumeCapabilities(), "")
	if err == nil {
		err = d.Compatible(caps, v)
	}
	if err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// listed is one volume of ListVolumes with the pool it came from.
type listed struct {
	pool  *pool.Pool
	entry pool.Entry
}

// pageVolumes lists, across every pool in (pool name, key) order, the volumes
// keep accepts from the volume ID token (inclusive; "" for the start), at most
// max (0: all), and returns the ID of the next one keep accepts ("" at the
// end): the next page's token. It reads only the page's metadata (plus the
// next entry's), so a walk costs what it returns, whatever the pool's size.
func (d controllerServer) pageVolumes(token string, max int, keep func(*pool.Pool, pool.Entry) bool) ([]listed, string, error) {
	var start pool.VolumeID
	if token != "" {
		id, err := pool.ParseVolumeID(token)
		if err != nil {
			return nil, "", status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token)
		}
		start = id
	}
	return walkPools(d.core, start.Pool, start.Key, max, func(p *pool.Pool, from string, limit int) ([]listed, string, error) {
		page, next, err := p.ListPage(from, limit, func(e pool.Entry) bool { return keep(p, e) })
		out := make([]listed, len(page))
		for i, e := range page {
			out[i] = listed{pool: p, entry: e}
		}
		if next != "" {
			next = p.IDOf(next).String()
		}
		return out, next, err
	}, func(l listed) string { return l.entry.ID.String() })
}

// walkPools pages through the pools in name order, from key startKey of pool
// startPool: list returns one pool's page from a key, at most limit entries
// (0: all), and the token of the entry after it. It returns at most most
// entries (0: all) and the next page's token.
func walkPools[E any](d *core, startPool, startKey string, most int, list func(p *pool.Pool, from string, limit int) ([]E, string, error), token func(E) string) ([]E, string, error) {
	var out []E
	for _, pn := range d.pools.Names() {
		if pn < startPool {
			continue
		}
		from := ""
		if pn == startPool {
			from = startKey
		}
		limit := 0
		if most > 0 {
			// A full page still asks for one entry: its token is the next page's.
			limit = max(most-len(out), 1)
		}
		page, next, err := list(d.pools.Pool(pn), from, limit)
		if err != nil {
			return nil, "", err
		}
		if most > 0 && len(out) == most {
			if len(page) > 0 {
				return out, token(page[0]), nil
			}
			continue
		}
		out = append(out, page...)
		if next != "" {
			return out, next, nil
		}
	}
	return out, "", nil
}

// ListVolumes pages by volume ID: the token is the ID of the first volume of the
// next page, so volumes created or deleted between pages neither repeat nor vanish
// from the rest of the listing. Ready volumes are listed, and volumes whose
// metadata is damaged (so the CO still sees they exist; the condition says why).
func (d controllerServer) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (_ *csi.ListVolumesResponse, err error) {
	defer csierr.ToStatus(&err)
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max_entries must not be negative")
	}
	vols, next, err := d.pageVolumes(req.GetStartingToken(), int(req.GetMaxEntries()), func(_ *pool.Pool, e pool.Entry) bool {
		if e.Err != nil {
			klog.FromContext(ctx).Error(e.Err, "Volume metadata unreadable", "volume", e.ID)
			return true
		}
		// Inline volumes have no PV and are never the CO's to act on: left
		// out (poolcsi pool list shows them).
		return e.Volume.State == pool.StateReady && e.Volume.Ephemeral == nil
	})
	if err != nil {
		return nil, err
	}
	resp := &csi.ListVolumesResponse{NextToken: next, Entries: make([]*csi.ListVolumesResponse_Entry, 0, len(vols))}
	spaces := map[*pool.Pool]health.PoolSpace{} // one statfs per pool of the page
	var contexts contextInterner
	for i, l := range vols {
		// Each volume's record is let go once its entry is built: an unpaged
		// listing of 10,000 volumes would otherwise hold every record and
		// every entry at once (the budget in docs/performance.md: under 50 MiB
		// resident after an unpaged listing of 10,000 volumes).
		vols[i] = listed{}
		space, ok := spaces[l.pool]
		if !ok {
			space = health.StatPool(l.pool)
			spaces[l.pool] = space
		}
		st := &csi.ListVolumesResponse_VolumeStatus{}
		csilegacy.SetCondition(st, health.CheckVolume(l.pool, l.entry, space, d.opts.Health).Issues)
		if l.entry.Volume == nil {
			// Capacity 0 means unknown; the condition says why.
			resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{Volume: &csi.Volume{
				VolumeId: d.pools.WireID(l.pool, l.entry.ID.String()), VolumeContext: map[string]string{ParamPool: l.pool.Name()},
			}, Status: st})
			continue
		}
		st.PublishedNodeIds = l.entry.Volume.PublishedNodes()
		v := d.csiVolume(l.pool, l.entry.Volume)
		v.VolumeContext = contexts.intern(v.VolumeContext)
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{Volume: v, Status: st})
	}
	return resp, nil
}

// contextInterner hands out one map for each distinct volume context of a
// listing: the volumes of a pool and layout mostly have the same few keys,
// and a small map is about half of what a listed entry holds, so 10,000
// entries share a handful of maps instead of holding 10,000 (the memory budget
// in docs/performance.md). The response only reads them, while it is marshalled.
type contextInterner struct {
	seen map[string]map[string]string
	key  []byte
}

func (c *contextInterner) intern(m map[string]string) map[string]string {
	var keys [4]string
	if len(m) > len(keys) {
		return m // not worth a key; never the case today
	}
	n := 0
	for k := range m {
		keys[n] = k
		n++
	}
	slices.Sort(keys[:n])
	c.key = c.key[:0]
	for _, k := range keys[:n] {
		c.key = append(append(append(append(c.key, k...), 0), m[k]...), 0)
	}
	// Looked up without allocating; a key is only copied when first seen.
	if shared, ok := c.seen[string(c.key)]; ok {
		return shared
	}
	if c.seen == nil {
		c.seen = map[string]map[string]string{}
	}
	c.seen[string(c.key)] = m
	return m
}

func (d controllerServer) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (_ *csi.ControllerGetVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	rq, err := d.resolve(ctx, rpcControllerGetVolume, req.GetVolumeId(), poolset.Access{}, nil)
	if err != nil {
		return nil, err
	}
	vid, p, v := rq.id, rq.pool, rq.vol
	st := &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: v.PublishedNodes()}
	issues, err := d.controllerIssues(p, vid)
	if err != nil {
		return nil, err
	}
	csilegacy.SetCondition(st, issues)
	return &csi.ControllerGetVolumeResponse{Volume: d.csiVolume(p, v), Status: st}, nil
}

func (d controllerServer) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (_ *csi.GetCapacityResponse, err error) {
	defer csierr.ToStatus(&err)
	sc, err := params.ParseCreate(req.GetParameters(), d.pools.Params())
	if err != nil {
		return nil, err
	}
	p, err := d.pools.ForCreate(ctx, sc, req.GetVolumeCapabilities(), poolset.Access{})
	if err != nil {
		return nil, err
	}
	if seg := req.GetAccessibleTopology().GetSegments(); isLocal(p) && seg != nil && seg[TopologyKey] != d.opts.NodeID {
		return &csi.GetCapacityResponse{}, nil // the pool is not on that node
	}
	// From the capacity ledger, not a walk of the pool, unless the ledger
	// cannot be trusted (pool.Capacity).
	avail, err := p.Ledger().Capacity()
	if err != nil {
		return nil, err
	}
	return &csi.GetCapacityResponse{
		AvailableCapacity: avail,
		MaximumVolumeSize: wrapInt64(min(avail, pool.MaxCapacity)),
		MinimumVolumeSize: wrapInt64(pool.MiB),
	}, nil
}
