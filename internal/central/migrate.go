package central

import (
	"context"
	"fmt"
	"hash/fnv"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/runner"
)

// DefaultMigrateInterval is how often CapacityMigration looks for the per-node
// provisioners' CSIStorageCapacity objects.
const DefaultMigrateInterval = 5 * time.Minute

// The labels csi-provisioner puts on the CSIStorageCapacity objects it keeps.
const (
	migrateDriverLabel    = "csi.storage.k8s.io/drivername"
	migrateManagedByLabel = "csi.storage.k8s.io/managed-by"
	// migrateManagedByBase is csi-provisioner's managed-by value; with --node-deployment it is
	// migrateManagedByBase-<node>, cut to a label's length (nodeManagedBy).
	migrateManagedByBase = "external-provisioner"
)

// CapacityMigration deletes what the per-node provisioners of the old layout left
// behind (docs/design/central-controller.md §8 item 4): each kept one
// CSIStorageCapacity per class for its own node, owned by the DaemonSet (ownerref
// level 1), which stays, so nothing would ever delete them and they would go on
// reporting the node's space as it was. Once a node runs the agent (its PoolNode is
// live), its pod has no provisioner any more, and the central provisioner's objects
// (managed-by external-provisioner, owned by the Deployment) report its space: the old
// ones go. A node not yet rolled (no live PoolNode) keeps its own, which its
// provisioner still keeps.
type CapacityMigration struct {
	Client kubernetes.Interface
	// Namespace is where the provisioners kept them (the release's).
	Namespace string
	// Driver is the local driver's name (csi.storage.k8s.io/drivername).
	Driver string
	Nodes  Nodes
	// Interval between passes; 0: DefaultMigrateInterval.
	Interval time.Duration
}

// Run makes a pass every Interval until ctx ends; the first one Interval after the
// start, when the PoolNodes have been listed.
func (m *CapacityMigration) Run(ctx context.Context) error {
	interval := m.Interval
	if interval <= 0 {
		interval = DefaultMigrateInterval
	}
	return runner.Every{Interval: interval, F: func(ctx context.Context) {
		if _, err := m.Once(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Removing the per-node provisioners' CSIStorageCapacity objects", "namespace", m.Namespace)
		}
	}}.Run(ctx)
}

// Once deletes the objects of every node whose PoolNode is live, and says how many
// went. Before the PoolNodes' first list it deletes nothing.
func (m *CapacityMigration) Once(ctx context.Context) (int, error) {
	if !m.Nodes.Synced() {
		return 0, nil
	}
	rolled := map[string]string{} // managed-by value → node
	for _, node := range m.Nodes.Known() {
		if live, _ := m.Nodes.Live(node); live {
			rolled[nodeManagedBy(node)] = node
		}
	}
	if len(rolled) == 0 {
		return 0, nil
	}
	list, err := m.Client.StorageV1().CSIStorageCapacities(m.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(labels.Set{migrateDriverLabel: m.Driver}).String(),
	})
	if err != nil {
		return 0, fmt.Errorf("list CSIStorageCapacities of %s: %w", m.Driver, err)
	}
	log := klog.FromContext(ctx)
	deleted := 0
	var firstErr error
	for i := range list.Items {
		c := &list.Items[i]
		// The label selector is the server's; the reader checks it again.
		if c.Labels[migrateDriverLabel] != m.Driver {
			continue
		}
		node, ok := rolled[c.Labels[migrateManagedByLabel]]
		if !ok {
			continue
		}
		// The UID precondition: an object of the name made again meanwhile is not this one.
		uid := c.UID
		err := m.Client.StorageV1().CSIStorageCapacities(m.Namespace).Delete(ctx, c.Name, metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: &uid},
		})
		switch {
		case err == nil:
			deleted++
			log.Info("Deleted a CSIStorageCapacity of a per-node provisioner: its node runs the local agent now",
				"name", c.Name, "node", node, "storageClass", c.StorageClassName)
		case apierrors.IsNotFound(err), apierrors.IsConflict(err):
		default:
			if firstErr == nil {
				firstErr = fmt.Errorf("delete CSIStorageCapacity %s/%s: %w", m.Namespace, c.Name, err)
			}
		}
	}
	return deleted, firstErr
}

// nodeManagedBy is the managed-by value csi-provisioner --node-deployment gives the
// objects of node: migrateManagedByBase-<node> when that fits a label value (63); else the
// base is cut and an 8-hex FNV-1a hash of the base stands between it and the node name;
// a node name too long for even that gives the base, cut, and the hash of the whole
// name (external-provisioner's getNameWithMaxLength, cmd/csi-provisioner/util.go).
func nodeManagedBy(node string) string {
	const maxLen = validation.DNS1035LabelMaxLength
	name := migrateManagedByBase + "-" + node
	if len(name) <= maxLen {
		return name
	}
	keep := maxLen - len("-12345678-") - len(node)
	if keep > 0 {
		return migrateManagedByBase[:keep] + "-" + migrateFNV(migrateManagedByBase) + "-" + node
	}
	short := migrateManagedByBase[:min(len(migrateManagedByBase), maxLen-9)] + "-" + migrateFNV(name)
	return short[:min(maxLen, len(short))]
}

func migrateFNV(s string) string {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return fmt.Sprintf("%08x", h.Sum32())
}
