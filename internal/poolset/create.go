package poolset

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TopologyKey is the topology segment that pins local-pool volumes to their node.
const TopologyKey = "topology.poolcsi.io/node"

// ForCreate is the pool parsed StorageClass parameters name: a configured
// one, or the share's, mounted (with the StorageClass's options and mount
// flags and what the request's secrets brought, acc) and laid out if new.
func (s *Set) ForCreate(ctx context.Context, sc params.Create, caps []*csi.VolumeCapability, acc Access) (*pool.Pool, error) {
	if sc.Share == nil {
		return s.ready(ctx, s.Pool(sc.Pool))
	}
	acc.fromStorageClass = true
	acc.scOptions = append(acc.scOptions, sc.Share.Options...)
	if sc.Layout == pool.LayoutDir && len(caps) > 0 {
		// Every capability of a CreateVolume carries the StorageClass's
		// mountOptions; the first one's are the share's.
		acc.scOptions = append(acc.scOptions, params.ShareFlags(caps[0].GetMount().GetMountFlags())...)
	}
	return s.Ensure(ctx, ShareRef(sc.Share.Ref), acc)
}

// Topology is this node's topology segment.
func (s *Set) Topology() map[string]string {
	return map[string]string{TopologyKey: s.deps.NodeID}
}

// Place decides a new volume's accessible topology. A local pool serves only
// this node, so a request that cannot accept this node fails here rather than
// making a volume no pod of the request could reach.
func (s *Set) Place(p *pool.Pool, req *csi.TopologyRequirement) (map[string]string, error) {
	if p.Shared() {
		return nil, nil
	}
	mine := s.Topology()
	requisite := req.GetRequisite()
	if len(requisite) == 0 {
		return mine, nil
	}
	for _, t := range requisite {
		if node, ok := t.GetSegments()[TopologyKey]; !ok || node == s.deps.NodeID {
			return mine, nil
		}
	}
	return nil, csierr.Failf(csierr.ErrTopology, "pool %s is local to node %s, which is not in the requisite topology %v; provision from that node's driver (distributed provisioning) or use a shared pool", p.Name(), s.deps.NodeID, requisite)
}

// NameInOther refuses a name that already names a volume in a pool other than
// want: the same name must always mean the same volume.
func (s *Set) NameInOther(name string, want *pool.Pool) error {
	for _, pn := range s.Names() {
		p := s.Pool(pn)
		if p == want {
			continue
		}
		if p.VolumeExists(p.NewID(name)) {
			return csierr.Failf(pool.ErrExists, "volume %q already exists in pool %s", name, pn)
		}
	}
	return nil
}
