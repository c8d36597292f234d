package central

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
)

const refreshKey = "topology.poolcsi.io/node"

// refreshObject is a central provisioner's CSIStorageCapacity of class for node.
func refreshObject(name, class, node string, capacity int64, mod func(*storagev1.CSIStorageCapacity)) *storagev1.CSIStorageCapacity {
	c := &storagev1.CSIStorageCapacity{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: migrateNS, Name: name, UID: types.UID("uid-" + name), ResourceVersion: "7",
			Labels: map[string]string{migrateDriverLabel: migrateLocalDriver, migrateManagedByLabel: migrateManagedByBase},
		},
		StorageClassName: class,
		NodeTopology:     &metav1.LabelSelector{MatchLabels: map[string]string{refreshKey: node}},
		Capacity:         resource.NewQuantity(capacity, resource.BinarySI),
	}
	if mod != nil {
		mod(c)
	}
	return c
}

func refreshClass(name, pool string) *storagev1.StorageClass {
	return &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: migrateLocalDriver,
		Parameters: map[string]string{params.ParamPool: pool}}
}

// A node that can serve again (back from stale, its pool Ok again or with room again)
// gets its central CSIStorageCapacity objects at 0 deleted at its event, so that
// csi-provisioner re-creates them at once with a fresh GetCapacity, instead of keeping
// the 0 until its next poll. Before CapacityRefresh nothing did: every "deleted" case
// below failed (the object stayed at 0 until the poll).
func TestCapacityRefresh(t *testing.T) {
	gib := int64(1 << 30)
	ok := func(name string, avail int64) nodecall.PoolCapacity {
		return nodecall.PoolCapacity{Name: name, AvailableBytes: avail, Condition: nodecall.PoolOk}
	}
	down := func(name string) nodecall.PoolCapacity {
		return nodecall.PoolCapacity{Name: name, Condition: nodecall.PoolUnavailable}
	}
	// A step: a heartbeat of node a with these pools, or (stale) the clock past the limit.
	type step struct {
		pools []nodecall.PoolCapacity
		stale bool
	}
	beat := func(pools ...nodecall.PoolCapacity) step { return step{pools: pools} }
	stale := step{stale: true}
	aLocal := refreshObject("a-local", "local", "a", 0, nil)
	for _, tc := range []struct {
		name    string
		steps   []step
		objects []*storagev1.CSIStorageCapacity
		deleted []string
	}{
		{name: "back from stale", steps: []step{beat(ok("local", gib)), beat(ok("local", gib)), stale, beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}, deleted: []string{"a-local"}},
		{name: "first heartbeat after the controller started", steps: []step{beat(ok("local", gib)), beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}, deleted: []string{"a-local"}},
		{name: "pool Ok again", steps: []step{beat(down("local")), beat(down("local")), beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}, deleted: []string{"a-local"}},
		{name: "pool with room again", steps: []step{beat(ok("local", 0)), beat(ok("local", 0)), beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}, deleted: []string{"a-local"}},
		{name: "no capacity field", steps: []step{beat(), beat(), stale, beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{refreshObject("a-local", "local", "a", 0, func(c *storagev1.CSIStorageCapacity) { c.Capacity = nil })},
			deleted: []string{"a-local"}},
		{name: "only the classes of the pool back", steps: []step{beat(ok("local", gib), down("fast")), beat(ok("local", gib), down("fast")), stale, beat(ok("local", gib), down("fast"))},
			objects: []*storagev1.CSIStorageCapacity{aLocal, refreshObject("a-fast", "fast", "a", 0, nil)}, deleted: []string{"a-local"}},
		{name: "still stale", steps: []step{beat(ok("local", gib)), beat(ok("local", gib)), stale},
			objects: []*storagev1.CSIStorageCapacity{aLocal}},
		{name: "first sighting only", steps: []step{beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}},
		{name: "live all along", steps: []step{beat(ok("local", gib)), beat(ok("local", gib)), beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}},
		{name: "back with the pool still down", steps: []step{beat(down("local")), beat(down("local")), stale, beat(down("local"))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}},
		{name: "back with the pool full", steps: []step{beat(ok("local", 0)), beat(ok("local", 0)), stale, beat(ok("local", 0))},
			objects: []*storagev1.CSIStorageCapacity{aLocal}},
		{name: "objects not to touch", steps: []step{beat(ok("local", gib)), beat(ok("local", gib)), stale, beat(ok("local", gib))},
			objects: []*storagev1.CSIStorageCapacity{
				refreshObject("right", "local", "a", gib, nil),
				refreshObject("other-node", "local", "b", 0, nil),
				refreshObject("per-node", "local", "a", 0, func(c *storagev1.CSIStorageCapacity) { c.Labels[migrateManagedByLabel] = "external-provisioner-a" }),
				refreshObject("other-driver", "local", "a", 0, func(c *storagev1.CSIStorageCapacity) { c.Labels[migrateDriverLabel] = migrateOtherDriver }),
				refreshObject("other-ns", "local", "a", 0, func(c *storagev1.CSIStorageCapacity) { c.Namespace = "elsewhere" }),
				refreshObject("no-class", "gone", "a", 0, nil),
				refreshObject("foreign-class", "foreign", "a", 0, nil),
				refreshObject("wider-segment", "local", "a", 0, func(c *storagev1.CSIStorageCapacity) { c.NodeTopology.MatchLabels["zone"] = "z" }),
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			objs := []runtime.Object{refreshClass("local", "local"), refreshClass("fast", "fast")}
			foreign := refreshClass("foreign", "local")
			foreign.Provisioner = migrateOtherDriver
			objs = append(objs, foreign)
			client := fake.NewClientset(objs...)
			clk := clocktesting.NewFakeClock(time.Now())
			view := NewNodeView(cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, cache.Indexers{}), 0, clk)
			r := NewCapacityRefresh(RefreshDeps{Client: client, Namespace: migrateNS, Driver: migrateLocalDriver, TopologyKey: refreshKey,
				Params: params.Config{Pools: []string{"local", "fast"}}, View: view})
			for i, s := range tc.steps {
				if i == len(tc.steps)-1 {
					// The objects as the provisioner's last poll left them, before the
					// last step.
					for _, o := range tc.objects {
						if _, err := client.StorageV1().CSIStorageCapacities(o.Namespace).Create(ctx, o, metav1.CreateOptions{}); err != nil {
							t.Fatal(err)
						}
					}
				}
				if s.stale {
					clk.Step(DefaultStaleAfter)
					continue
				}
				view.observe(refreshPoolNode(t, "a", i, s.pools))
				r.drain(ctx)
			}
			var left []string
			for _, ns := range []string{migrateNS, "elsewhere"} {
				l, err := client.StorageV1().CSIStorageCapacities(ns).List(ctx, metav1.ListOptions{})
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range l.Items {
					left = append(left, c.Name)
				}
			}
			for _, o := range tc.objects {
				if gone := !slices.Contains(left, o.Name); gone != slices.Contains(tc.deleted, o.Name) {
					t.Errorf("%s deleted: %v, want %v", o.Name, gone, !gone)
				}
			}
		})
	}
}

// The refresher runs on the view's events: a node back from stale has its object at 0
// re-made by the provisioner within its events, not at the next poll.
func TestCapacityRefreshRun(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset(refreshClass("local", "local"), refreshObject("a-local", "local", "a", 0, nil))
	clk := clocktesting.NewFakeClock(time.Now())
	view := NewNodeView(cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, cache.Indexers{}), 0, clk)
	r := NewCapacityRefresh(RefreshDeps{Client: client, Namespace: migrateNS, Driver: migrateLocalDriver, TopologyKey: refreshKey,
		Params: params.Config{Pools: []string{"local"}}, View: view})
	r.gap = time.Millisecond
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	pools := []nodecall.PoolCapacity{{Name: "local", AvailableBytes: 1 << 30, Condition: nodecall.PoolOk}}
	view.observe(refreshPoolNode(t, "a", 1, pools))
	clk.Step(DefaultStaleAfter)
	view.observe(refreshPoolNode(t, "a", 2, pools))
	left := func() []string {
		l, err := client.StorageV1().CSIStorageCapacities(migrateNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, c := range l.Items {
			out = append(out, c.Name)
		}
		return out
	}
	until(t, "the object at 0 deleted", func() bool { return len(left()) == 0 })
	// Re-made at 0 again (a replica whose view lagged answered): the next heartbeat
	// deletes it again; re-made right, the one after leaves it and the node is done.
	rv := 3
	remake := func(name string, capacity int64) {
		t.Helper()
		if _, err := client.StorageV1().CSIStorageCapacities(migrateNS).Create(ctx, refreshObject(name, "local", "a", capacity, nil), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		view.observe(refreshPoolNode(t, "a", rv, pools))
		rv++
	}
	remake("lagged", 0)
	until(t, "the object re-made at 0 deleted", func() bool { return len(left()) == 0 })
	remake("right", 1<<30)
	until(t, "node a done", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		_, pending := r.pending["a"]
		return !pending
	})
	remake("later", 0) // no longer watched for: the provisioner's own figure, left to its poll
	r.drain(ctx)
	if got := left(); !slices.Equal(got, []string{"later", "right"}) {
		t.Errorf("left %v, want [later right]", got)
	}
}

// refreshPoolNode is node's PoolNode at resourceVersion rv with pools.
func refreshPoolNode(t *testing.T, node string, rv int, pools []nodecall.PoolCapacity) *unstructured.Unstructured {
	t.Helper()
	n := &nodecall.PoolNode{ObjectMeta: metav1.ObjectMeta{Name: node, ResourceVersion: strconv.Itoa(rv)},
		Status: nodecall.PoolNodeStatus{Pools: pools}}
	u, err := n.ToUnstructured()
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// One look lists the objects once for every node with an event since the last: a
// controller's start, when every node's first change is a rise, costs one list, not one
// per node.
func TestCapacityRefreshOneList(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset(refreshClass("local", "local"), refreshObject("a-local", "local", "a", 0, nil), refreshObject("b-local", "local", "b", 0, nil))
	view := NewNodeView(cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, cache.Indexers{}), 0, clocktesting.NewFakeClock(time.Now()))
	r := NewCapacityRefresh(RefreshDeps{Client: client, Namespace: migrateNS, Driver: migrateLocalDriver, TopologyKey: refreshKey,
		Params: params.Config{Pools: []string{"local"}}, View: view})
	pools := []nodecall.PoolCapacity{{Name: "local", AvailableBytes: 1 << 30, Condition: nodecall.PoolOk}}
	for _, node := range []string{"a", "b"} {
		view.observe(refreshPoolNode(t, node, 1, pools))
		view.observe(refreshPoolNode(t, node, 2, pools))
	}
	client.ClearActions()
	r.drain(ctx)
	lists := 0
	for _, a := range client.Actions() {
		if a.GetVerb() == "list" && a.GetResource().Resource == "csistoragecapacities" {
			lists++
		}
	}
	l, err := client.StorageV1().CSIStorageCapacities(migrateNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if lists != 1 || len(l.Items) != 0 {
		t.Errorf("%d lists, %d objects left; want 1, 0", lists, len(l.Items))
	}
}
