package central

import (
	"context"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// migrateNodes is a Nodes of fixed liveness.
type migrateNodes struct {
	live   map[string]bool // known nodes, and whether each is live
	synced bool
}

func (n migrateNodes) Live(node string) (bool, time.Duration) { return n.live[node], 0 }

// AwaitVerdict: this fake judges every node at once.
func (n migrateNodes) AwaitVerdict(context.Context, string) {}
func (n migrateNodes) Known() []string {
	var out []string
	for k := range n.live {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
func (n migrateNodes) Pools(string) []nodecall.PoolCapacity { return nil }
func (n migrateNodes) Synced() bool                         { return n.synced }

func migrateCapacity(ns, name, driver, managedBy string) *storagev1.CSIStorageCapacity {
	return &storagev1.CSIStorageCapacity{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ns, Name: name, UID: types.UID("uid-" + name),
			Labels: map[string]string{migrateDriverLabel: driver, migrateManagedByLabel: managedBy},
		},
		StorageClassName: "poolcsi-local",
	}
}

const (
	migrateLongNode     = "nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn"              // 50: the base is cut
	migrateTooLongNode  = "mmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmm"    // 60: the node is dropped
	migrateLongValue    = "ext-53f40b57-nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn" // csi-provisioner's value for migrateLongNode
	migrateTooLongValue = "external-provisioner-9aba7cd2"                                   // and for migrateTooLongNode
	migrateLocalDriver  = "local.poolcsi.io"
	migrateOtherDriver  = "shared.poolcsi.io"
	migrateNS           = "poolcsi"
)

// The value csi-provisioner --node-deployment gives a node's objects, for node names
// short, long and too long for a label (the expected values were computed apart, from
// external-provisioner's rule: FNV-1a, 8 hex).
func TestNodeManagedBy(t *testing.T) {
	for _, tc := range []struct{ node, want string }{
		{"node-a", "external-provisioner-node-a"},
		{strings.Repeat("x", 42), "external-provisioner-" + strings.Repeat("x", 42)}, // exactly 63
		{migrateLongNode, migrateLongValue},
		{migrateTooLongNode, migrateTooLongValue},
	} {
		got := nodeManagedBy(tc.node)
		if got != tc.want {
			t.Errorf("nodeManagedBy(%q) = %q, want %q", tc.node, got, tc.want)
		}
		if len(got) > 63 {
			t.Errorf("nodeManagedBy(%q) is %d long, over a label value's 63", tc.node, len(got))
		}
	}
}

func TestCapacityMigration(t *testing.T) {
	objects := []*storagev1.CSIStorageCapacity{
		migrateCapacity(migrateNS, "csisc-a", migrateLocalDriver, "external-provisioner-node-a"),      // rolled: goes
		migrateCapacity(migrateNS, "csisc-a2", migrateLocalDriver, "external-provisioner-node-a"),     // its second class: goes
		migrateCapacity(migrateNS, "csisc-b", migrateLocalDriver, "external-provisioner-node-b"),      // not live: stays
		migrateCapacity(migrateNS, "csisc-c", migrateLocalDriver, "external-provisioner-node-c"),      // no PoolNode: stays
		migrateCapacity(migrateNS, "csisc-long", migrateLocalDriver, migrateLongValue),                // rolled, long name: goes
		migrateCapacity(migrateNS, "csisc-toolong", migrateLocalDriver, migrateTooLongValue),          // rolled, name dropped: goes
		migrateCapacity(migrateNS, "csisc-central", migrateLocalDriver, "external-provisioner"),       // the central provisioner's: stays
		migrateCapacity(migrateNS, "csisc-shared", migrateOtherDriver, "external-provisioner-node-a"), // another driver's: stays
		migrateCapacity("elsewhere", "csisc-other-ns", migrateLocalDriver, "external-provisioner-node-a"),
	}
	nodes := migrateNodes{synced: true, live: map[string]bool{"node-a": true, "node-b": false, migrateLongNode: true, migrateTooLongNode: true}}
	wantLeft := []string{"csisc-b", "csisc-c", "csisc-central", "csisc-other-ns", "csisc-shared"}

	for _, tc := range []struct {
		name  string
		nodes migrateNodes
		left  []string
	}{
		{"rolled nodes' objects go", nodes, wantLeft},
		{"nothing before the PoolNodes are listed", migrateNodes{live: nodes.live}, nil},
		{"nothing without a live node", migrateNodes{synced: true, live: map[string]bool{"node-b": false}}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset()
			var all []string
			for _, o := range objects {
				if _, err := client.StorageV1().CSIStorageCapacities(o.Namespace).Create(context.Background(), o, metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
				all = append(all, o.Name)
			}
			m := &CapacityMigration{Client: client, Namespace: migrateNS, Driver: migrateLocalDriver, Nodes: tc.nodes}
			n, err := m.Once(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			left := tc.left
			if left == nil {
				left = all
			}
			got := migrateLeft(t, client)
			sort.Strings(left)
			if !slices.Equal(got, left) {
				t.Errorf("left %v, want %v", got, left)
			}
			if want := len(objects) - len(left); n != want {
				t.Errorf("Once says %d deleted, want %d", n, want)
			}
			// A second pass finds nothing more.
			if n, err := m.Once(context.Background()); err != nil || n != 0 {
				t.Errorf("second pass: %d deleted, %v; want 0, nil", n, err)
			}
		})
	}
}

func migrateLeft(t *testing.T, client *fake.Clientset) []string {
	t.Helper()
	list, err := client.StorageV1().CSIStorageCapacities("").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, c := range list.Items {
		out = append(out, c.Name)
	}
	sort.Strings(out)
	return out
}

// Run stops with its context.
func TestCapacityMigrationRunStops(t *testing.T) {
	m := &CapacityMigration{Client: fake.NewClientset(), Namespace: migrateNS, Driver: migrateLocalDriver, Nodes: migrateNodes{}, Interval: time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}
