package central

import (
	"context"
	"fmt"
	"maps"
	"sync"

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
	r := &CapacityRefresh{d: d, pending: map[string]int{}, due: map[string]bool{}, kick: make(chan struct{}, 1)}
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

// Run looks at the nodes made servable again until ctx ends.
func (r *CapacityRefresh) Run(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-r.kick:
			r.drain(ctx)
		}
	}
}

// drain looks once at each node with an event not looked at yet.
func (r *CapacityRefresh) drain(ctx context.Context) {
	r.mu.Lock()
	due := r.due
	r.due = map[string]bool{}
	r.mu.Unlock()
	for node := range due {
		n, err := r.Once(ctx, node)
		if err != nil {
			klog.FromContext(ctx).Error(err, "Not refreshing the capacity of a node back", "node", node)
		}
		r.mu.Lock()
		left := r.pending[node] - 1
		if (err == nil && n == 0) || left <= 0 {
			delete(r.pending, node)
		} else {
			r.pending[node] = left
		}
		r.mu.Unlock()
	}
}

// Once deletes the central provisioner's CSIStorageCapacity objects of node that say 0
// while GetCapacity would answer more for their class now, and says how many went.
func (r *CapacityRefresh) Once(ctx context.Context, node string) (int, error) {
	list, err := r.d.Client.StorageV1().CSIStorageCapacities(r.d.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(labels.Set{migrateDriverLabel: r.d.Driver, migrateManagedByLabel: migrateManagedByBase}).String(),
	})
	if err != nil {
		return 0, fmt.Errorf("list CSIStorageCapacities of %s: %w", r.d.Driver, err)
	}
	classes := map[string]*storagev1.StorageClass{}
	deleted := 0
	var firstErr error
	for i := range list.Items {
		c := &list.Items[i]
		// The label selector is the server's; the reader checks it again. A per-node
		// provisioner's objects (managed-by external-provisioner-<node>) are the
		// migration's.
		if c.Labels[migrateDriverLabel] != r.d.Driver || c.Labels[migrateManagedByLabel] != migrateManagedByBase ||
			!r.selects(c.NodeTopology, node) || (c.Capacity != nil && c.Capacity.Sign() > 0) {
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
			deleted++
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

// selects says whether sel is csi-provisioner's segment of node: the node key alone, the
// only key a local node registers.
func (r *CapacityRefresh) selects(sel *metav1.LabelSelector, node string) bool {
	return sel != nil && len(sel.MatchExpressions) == 0 && maps.Equal(sel.MatchLabels, map[string]string{r.d.TopologyKey: node})
}
