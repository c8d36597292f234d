package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// The capacity figures of a PoolNode are refreshed when one moves by at least
// capacityStep, after a call that may have changed a pool's space (Poke), and at least
// every capacityRefresh; in between, each heartbeat repeats the figures last published.
const (
	capacityStep    = 1 << 20
	capacityRefresh = 60 * time.Second
)

// These are the driver's (params.ParamPool, poolset.TopologyKey): the agent asks its
// own node's GetCapacity exactly what the per-node provisioner asks today.
const (
	poolParam   = "pool"
	topologyKey = "topology.poolcsi.io/node"
)

// Publisher keeps this node's PoolNode: a heartbeat every Deps.Heartbeat and the
// capacity of each local pool, as the node's own GetCapacity answers it.
type Publisher struct {
	deps Deps
	poke chan struct{}

	// What this process last wrote (nil: read or create it first), and when its
	// capacity figures were last refreshed.
	last        *nodecall.PoolNode
	refreshedAt metav1.Time
}

func newPublisher(deps Deps) *Publisher {
	return &Publisher{deps: deps, poke: make(chan struct{}, 1)}
}

// Poke asks for a write with fresh figures now. Pokes coalesce: however many come before
// the publisher gets to them make one write.
func (p *Publisher) Poke() {
	select {
	case p.poke <- struct{}{}:
	default:
	}
}

// Run writes the PoolNode at once and then every heartbeat or poke until ctx ends. No
// last write is made on the way out: the controller sees the node go stale.
func (p *Publisher) Run(ctx context.Context) error {
	log := klog.FromContext(ctx).WithValues("node", p.deps.Node)
	ctx = klog.NewContext(ctx, log)
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		fresh := false
		select {
		case <-p.poke:
			fresh = true
		default:
		}
		if err := p.Beat(ctx, fresh); err != nil && ctx.Err() == nil {
			log.Error(err, "PoolNode not renewed")
		}
		select {
		case <-ctx.Done():
		case <-p.poke:
			p.Poke() // taken by the next round, which refreshes the figures
		case <-p.deps.Clock.After(p.deps.Heartbeat):
		}
	}, 0)
	return nil
}

// Beat writes the PoolNode once: renewTime, the agent, and the capacity figures,
// refreshed if fresh is set, if one moved by capacityStep or more, or if the last
// refresh is capacityRefresh seconds old.
func (p *Publisher) Beat(ctx context.Context, fresh bool) error {
	if p.last == nil {
		n, err := p.ensure(ctx)
		if err != nil {
			return err
		}
		p.last, fresh = n, true
	}
	now := p.deps.Clock.Now()
	pools := p.capacity(ctx)
	if !fresh && !moved(p.last.Status.Pools, pools) && now.Sub(p.refreshedAt.Time) < capacityRefresh {
		pools = p.last.Status.Pools
	} else {
		p.refreshedAt = metav1.NewTime(now)
	}
	n := p.last.DeepCopy()
	renew := metav1.NewMicroTime(now)
	n.Status = nodecall.PoolNodeStatus{RenewTime: &renew, Agent: nodecall.AgentInfo{Version: cut(p.deps.Version, nodecall.MaxVersion), Pod: cut(p.deps.Pod, nodecall.MaxPod)}, Pools: pools}
	out, err := p.deps.Calls.UpdateNodeStatus(ctx, n)
	if err != nil {
		// Changed or deleted by someone else: read it again next time.
		p.last = nil
		return fmt.Errorf("writing PoolNode %s: %w", p.deps.Node, err)
	}
	p.last = out
	return nil
}

// ensure reads this node's PoolNode, or creates it, owned by the Node so that it goes
// with it.
func (p *Publisher) ensure(ctx context.Context) (*nodecall.PoolNode, error) {
	n, err := p.deps.Calls.GetNode(ctx, p.deps.Node)
	if err == nil || !apierrors.IsNotFound(err) {
		return n, err
	}
	uid, err := p.deps.Calls.NodeUID(ctx, p.deps.Node)
	if err != nil {
		return nil, fmt.Errorf("reading Node %s for its PoolNode's owner: %w", p.deps.Node, err)
	}
	n = &nodecall.PoolNode{ObjectMeta: metav1.ObjectMeta{Name: p.deps.Node, OwnerReferences: []metav1.OwnerReference{nodecall.NodeOwner(p.deps.Node, string(uid))}}}
	made, err := p.deps.Calls.CreateNode(ctx, n)
	if apierrors.IsAlreadyExists(err) {
		return p.deps.Calls.GetNode(ctx, p.deps.Node)
	}
	if err == nil {
		klog.FromContext(ctx).Info("Created this node's PoolNode")
	}
	return made, err
}

// capacity asks this node's GetCapacity for each local pool, with this node's topology.
// A pool that does not answer, or not within a heartbeat, is Unavailable, its figures 0:
// a hung pool must not stop the heartbeat, which says that the agent lives.
func (p *Publisher) capacity(ctx context.Context) []nodecall.PoolCapacity {
	out := make([]nodecall.PoolCapacity, 0, len(p.deps.Pools))
	client := csi.NewControllerClient(p.deps.Conn)
	for _, name := range p.deps.Pools {
		cctx, cancel := context.WithTimeout(ctx, max(p.deps.Heartbeat, time.Second))
		resp, err := client.GetCapacity(cctx, &csi.GetCapacityRequest{
			Parameters:         map[string]string{poolParam: name},
			AccessibleTopology: &csi.Topology{Segments: map[string]string{topologyKey: p.deps.Node}},
		})
		cancel()
		if err != nil {
			klog.FromContext(ctx).V(2).Info("Pool capacity unknown; reporting it Unavailable", "pool", name, "code", status.Code(err).String(), "err", err)
			out = append(out, nodecall.PoolCapacity{Name: name, Condition: nodecall.PoolUnavailable})
			continue
		}
		out = append(out, nodecall.PoolCapacity{Name: name, AvailableBytes: resp.GetAvailableCapacity(),
			MaximumVolumeSize: resp.GetMaximumVolumeSize().GetValue(), MinimumVolumeSize: resp.GetMinimumVolumeSize().GetValue(),
			Condition: nodecall.PoolOk})
	}
	return out
}

// moved reports whether the new figures differ from the old by capacityStep or more, or
// in anything but the figures (a pool gone, come, or changed condition).
func moved(old, cur []nodecall.PoolCapacity) bool {
	if len(old) != len(cur) {
		return true
	}
	for i := range old {
		o, c := old[i], cur[i]
		if o.Name != c.Name || o.Condition != c.Condition {
			return true
		}
		for _, d := range []int64{o.AvailableBytes - c.AvailableBytes, o.MaximumVolumeSize - c.MaximumVolumeSize, o.MinimumVolumeSize - c.MinimumVolumeSize} {
			if d >= capacityStep || d <= -capacityStep {
				return true
			}
		}
	}
	return false
}
