package central

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
)

// GetCapacity answers from the nodes' PoolNodes (docs/design/central-controller.md §6):
// a cache read, no call. With the node key in accessible_topology it is that node's
// pool: 0 when the node is not live, has no PoolNode, does not list the pool, or lists
// it Unavailable, so that no new claim goes to a node that cannot serve it. A node this
// process cannot judge yet (just started) is waited for, up to one stale limit
// (NodeView.AwaitVerdict).
//
// Without a topology (csi-provisioner always sends one with --enable-capacity; only
// another caller asks so) it is what the CSI spec asks for "any topology": the available
// bytes of every live node's pool summed, while maximum_volume_size is the largest one
// node offers, for a local volume is made on one node and never spans two.
func (s controllerServer) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (_ *csi.GetCapacityResponse, err error) {
	defer csierr.ToStatus(&err)
	cp, err := params.ParseCreate(req.GetParameters(), s.d.Params)
	if err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) > 0 {
		if _, err := params.ParseCaps(req.GetVolumeCapabilities(), params.DefaultFSType); err != nil {
			return nil, err
		}
	}
	seg := req.GetAccessibleTopology().GetSegments()
	if node, ok := seg[s.d.TopologyKey]; ok {
		s.d.Nodes.AwaitVerdict(ctx, node)
		pc, ok := livePool(s.d.Nodes, node, cp.Pool)
		if !ok {
			return &csi.GetCapacityResponse{}, nil
		}
		return capacityOf(pc), nil
	}
	if len(seg) > 0 {
		return &csi.GetCapacityResponse{}, nil // a topology without the node key: no local pool is there
	}
	out := &csi.GetCapacityResponse{}
	for _, node := range s.d.Nodes.Known() {
		pc, ok := livePool(s.d.Nodes, node, cp.Pool)
		if !ok {
			continue
		}
		c := capacityOf(pc)
		out.AvailableCapacity += c.AvailableCapacity
		if c.MaximumVolumeSize.GetValue() > out.MaximumVolumeSize.GetValue() {
			out.MaximumVolumeSize = c.MaximumVolumeSize
		}
		if m := c.MinimumVolumeSize; m != nil && (out.MinimumVolumeSize == nil || m.GetValue() < out.MinimumVolumeSize.GetValue()) {
			out.MinimumVolumeSize = m
		}
	}
	return out, nil
}

// livePool is node's figures for poolName, if the node is live and the pool Ok.
func livePool(nodes Nodes, node, poolName string) (nodecall.PoolCapacity, bool) {
	if live, _ := nodes.Live(node); !live {
		return nodecall.PoolCapacity{}, false
	}
	pc, ok := poolOf(nodes.Pools(node), poolName)
	if !ok || pc.Condition != nodecall.PoolOk {
		return nodecall.PoolCapacity{}, false
	}
	return pc, true
}

func capacityOf(pc nodecall.PoolCapacity) *csi.GetCapacityResponse {
	out := &csi.GetCapacityResponse{AvailableCapacity: max(pc.AvailableBytes, 0)}
	if pc.MaximumVolumeSize > 0 {
		out.MaximumVolumeSize = wrapperspb.Int64(pc.MaximumVolumeSize)
	}
	if pc.MinimumVolumeSize > 0 {
		out.MinimumVolumeSize = wrapperspb.Int64(pc.MinimumVolumeSize)
	}
	return out
}
