package central

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/params"
)

// refreshChecks is how many of a node's events CapacityRefresh looks at after the one
// that made it servable again, while each look still finds an object to remove: with
// more than one replica, the provisioner's GetCapacity may reach a replica whose view
// has not seen the heartbeat yet and write 0 again.
const refreshChecks = 3

// CapacityRefresh makes the central csi-provisioner ask GetCapacity again for a node as
// soon as the node can serve claims again (docs/design/central-controller.md §6).
//
// GetCapacity answers 0 for a node that is not live or whose pool is Unavailable, and
// csi-provisioner asks it once per --capacity-poll-interval (a minute): a node back
// from stale kept its CSIStorageCapacity objects at 0, unschedulable for local claims,
// until the next poll, up to a minute after its agent beat again, while its own
// per-node provisioner used to answer from its pool at once. csi-provisioner re-creates
// at once, with a fresh GetCapacity, an object of its own that someone else deleted
// (external-provisioner pkg/capacity, onCDelete); an update by someone else is only
// remembered. So when the node view sees an event make a pool of a node servable again
// (NodeView.OnChange), this deletes the central provisioner's objects of that node that
// say 0 for a class whose pool GetCapacity now answers more than 0 for, each with
// preconditions on its UID and resourceVersion: one the provisioner rewrote meanwhile
// is left. Between the delete and the re-create the scheduler sees no object for that
// class and node, which it takes as it took the 0.
type CapacityRefresh struct {
	d RefreshDeps

	mu      sync.Mutex
	pending map[string]int  // node → looks left
	due     map[string]bool // nodes with an event not looked at yet
	kick    chan struct{}
	gap     time.Duration
}

// RefreshDeps is what CapacityRefresh acts through.
type RefreshDeps struct {
	Client kubernetes.Interface
	// Namespace is where the central provisioner keeps its objects (the release's).
	Namespace string
	// Driver is the local driver's name (csi.storage.k8s.io/drivername).
	Driver      string
	TopologyKey string
	// Params maps a class's parameters to its pool, as GetCapacity does.
	Params params.Config
	// View is the node view whose events are watched, and whose figures are compared.
	View *NodeView
}

// NewCapacityRefresh returns the refresher of d.View's nodes, registered on it.
func NewCapacityRefresh(d RefreshDeps) *CapacityRefresh {
	r := &CapacityRefresh{d: d, pending: map[string]int{}, due: map[string]bool{}, kick: make(chan struct{}, 1), gap: refreshGap}
	d.View.OnChange(r.changed)
	return r
}

// changed is the view's listener: it must not block.
func (r *CapacityRefresh) changed(node string, rose bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rose {
		r.pending[node] = refreshChecks
	}
	if _, ok := r.pending[node]; !ok {
		return
	}
	r.due[node] = true
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// refreshGap is the least time between two looks: one look lists the objects of every
// node with an event since the last, so the heartbeats of a controller's start (every
// node's first change is a rise) cost one list a second, not one per node.
const refreshGap = time.Second

// Run looks at the nodes made servable again until ctx ends.
func (r *CapacityRefresh) Run(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-r.kick:
			r.drain(ctx)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(r.gap):
		}
	}
}

// drain looks once at the nodes with an event not looked at yet.
func (r *CapacityRefresh) drain(ctx context.Context) {
	r.mu.Lock()
	due := slices.Sorted(maps.Keys(r.due))
	r.due = map[string]bool{}
	r.mu.Unlock()
	if len(due) == 0 {
		return
	}
	deleted, err := r.Once(ctx, due...)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Not refreshing the capacity of nodes that serve again", "nodes", due)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, node := range due {
		left := r.pending[node] - 1
		if (err == nil && deleted[node] == 0) || left <= 0 {
			delete(r.pending, node)
		} else {
			r.pending[node] = left
		}
	}
}

// Once deletes the central provisioner's CSIStorageCapacity objects of nodes that say 0
// while GetCapacity would answer more for their class now, and says how many went of
// each node. One list serves every node.
func (r *CapacityRefresh) Once(ctx context.Context, nodes ...string) (map[string]int, error) {
	list, err := r.d.Client.StorageV1().CSIStorageCapacities(r.d.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(labels.Set{migrateDriverLabel: r.d.Driver, migrateManagedByLabel: migrateManagedByBase}).String(),
	})
	if err != nil {
		return nil, fmt.Errorf("list CSIStorageCapacities of %s: %w", r.d.Driver, err)
	}
	classes := map[string]*storagev1.StorageClass{}
	deleted := map[string]int{}
	var firstErr error
	for i := range list.Items {
		c := &list.Items[i]
		node, ok := r.nodeOf(c.NodeTopology)
		if !ok || !slices.Contains(nodes, node) {
			continue
		}
		// The label selector is the server's; the reader checks it again. A per-node
		// provisioner's objects (managed-by external-provisioner-<node>) are the
		// migration's.
		if c.Labels[migrateDriverLabel] != r.d.Driver || c.Labels[migrateManagedByLabel] != migrateManagedByBase ||
			(c.Capacity != nil && c.Capacity.Sign() > 0) {
			continue
		}
		sc, seen := classes[c.StorageClassName]
		if !seen {
			sc, err = r.d.Client.StorageV1().StorageClasses().Get(ctx, c.StorageClassName, metav1.GetOptions{})
			if err != nil {
				sc = nil
				if !apierrors.IsNotFound(err) && firstErr == nil {
					firstErr = fmt.Errorf("get StorageClass %s: %w", c.StorageClassName, err)
				}
			}
			classes[c.StorageClassName] = sc
		}
		if sc == nil || sc.Provisioner != r.d.Driver {
			continue
		}
		cp, err := params.ParseCreate(sc.Parameters, r.d.Params)
		if err != nil {
			continue // GetCapacity fails for it too
		}
		if pc, ok := livePool(r.d.View, node, cp.Pool); !ok || pc.AvailableBytes <= 0 {
			continue
		}
		uid, rv := c.UID, c.ResourceVersion
		err = r.d.Client.StorageV1().CSIStorageCapacities(r.d.Namespace).Delete(ctx, c.Name, metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv},
		})
		switch {
		case err == nil:
			deleted[node]++
			klog.FromContext(ctx).Info("Deleted a CSIStorageCapacity at 0 of a node that serves again, for the provisioner to ask GetCapacity again now",
				"name", c.Name, "node", node, "storageClass", c.StorageClassName, "pool", cp.Pool)
		case apierrors.IsNotFound(err), apierrors.IsConflict(err):
		default:
			if firstErr == nil {
				firstErr = fmt.Errorf("delete CSIStorageCapacity %s/%s: %w", r.d.Namespace, c.Name, err)
			}
		}
	}
	return deleted, firstErr
}

// nodeOf is the node whose csi-provisioner segment sel is: the node key alone, the only
// key a local node registers.
func (r *CapacityRefresh) nodeOf(sel *metav1.LabelSelector) (string, bool) {
	if sel == nil || len(sel.MatchExpressions) != 0 || len(sel.MatchLabels) != 1 {
		return "", false
	}
	node, ok := sel.MatchLabels[r.d.TopologyKey]
	return node, ok && node != ""
}
