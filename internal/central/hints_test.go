package central

import (
	"context"
	"slices"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	discoveryfake "k8s.io/client-go/discovery/fake"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	clienttesting "k8s.io/client-go/testing"
)

const testDriver = "local.poolcsi.io"

func pv(name, driver, handle string, nodes ...string) *unstructured.Unstructured {
	values := make([]any, len(nodes))
	for i, n := range nodes {
		values[i] = n
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "PersistentVolume",
		"metadata": map[string]any{"name": name},
		"spec": map[string]any{
			"csi": map[string]any{"driver": driver, "volumeHandle": handle},
			"nodeAffinity": map[string]any{"required": map[string]any{"nodeSelectorTerms": []any{
				map[string]any{"matchExpressions": []any{
					map[string]any{"key": "kubernetes.io/hostname", "operator": "In", "values": []any{"elsewhere"}},
					map[string]any{"key": testKey, "operator": "In", "values": values},
				}},
			}}},
		},
	}}
}

func content(name, driver string, spec, status map[string]any, managedBy string) *unstructured.Unstructured {
	spec["driver"] = driver
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
		"metadata": map[string]any{"name": name}, "spec": spec,
	}}
	if status != nil {
		u.Object["status"] = status
	}
	if managedBy != "" {
		u.SetLabels(map[string]string{managedByLabel: managedBy})
	}
	return u
}

func groupContent(name string, spec map[string]any, managedBy string) *unstructured.Unstructured {
	u := content(name, testDriver, spec, nil, managedBy)
	u.SetAPIVersion("groupsnapshot.storage.k8s.io/v1")
	u.SetKind("VolumeGroupSnapshotContent")
	return u
}

func newTestHints(t *testing.T, contents bool, objs ...runtime.Object) (*HintIndex, *dynamicfake.FakeDynamicClient) {
	t.Helper()
	client := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		PVsResource:           "PersistentVolumeList",
		ContentsResource:      "VolumeSnapshotContentList",
		GroupContentsResource: "VolumeGroupSnapshotContentList",
	}, objs...)
	d := HintsDeps{Client: client, Driver: testDriver, TopologyKey: testKey}
	if contents {
		d.Discovery = &discoveryfake.FakeDiscovery{Fake: &clienttesting.Fake{Resources: []*metav1.APIResourceList{
			{GroupVersion: "snapshot.storage.k8s.io/v1", APIResources: []metav1.APIResource{{Name: "volumesnapshotcontents"}}},
			{GroupVersion: "groupsnapshot.storage.k8s.io/v1", APIResources: []metav1.APIResource{{Name: "volumegroupsnapshotcontents"}}},
		}}}
	}
	h := NewHints(d)
	if h.Synced() {
		t.Fatal("synced before Run")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	waitFor(t, "the hints to sync", h.Synced)
	return h, client
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	}); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func TestHints(t *testing.T) {
	v1 := "local.00000000000000000000000000000001"
	v2 := "local.00000000000000000000000000000002"
	vGone := "local.00000000000000000000000000000009"
	s1 := "local@00000000000000000000000000000001"
	s2 := "local@00000000000000000000000000000002"
	s3 := "local@00000000000000000000000000000003"
	g1 := "local@g-00000000000000000000000000000001"
	g2 := "local@g-00000000000000000000000000000002"
	h, client := newTestHints(t, true,
		pv("pv-1", testDriver, v1, "node-a"),
		pv("pv-2", testDriver, v2, "node-b"),
		pv("pv-other-driver", "other.csi", "local.00000000000000000000000000000003", "node-c"),
		pv("pv-two-nodes", testDriver, "local.00000000000000000000000000000004", "node-a", "node-b"),
		// A dynamic content: its source's PV wins over a stale label.
		content("c1", testDriver, map[string]any{"source": map[string]any{"volumeHandle": v1}}, map[string]any{"snapshotHandle": s1}, "node-z"),
		// A pre-provisioned content of the per-node era: its label.
		content("c2", testDriver, map[string]any{"source": map[string]any{"snapshotHandle": s2}}, nil, "node-b"),
		// A source whose PV is gone and no label: no hint.
		content("c3", testDriver, map[string]any{"source": map[string]any{"volumeHandle": vGone}}, map[string]any{"snapshotHandle": s3}, ""),
		content("c-other", "other.csi", map[string]any{"source": map[string]any{"snapshotHandle": "local@00000000000000000000000000000005"}}, nil, "node-c"),
		groupContent("g1", map[string]any{"source": map[string]any{"volumeHandles": []any{vGone, v2}}}, ""),
		groupContent("g2", map[string]any{"source": map[string]any{"groupSnapshotHandles": map[string]any{"volumeGroupSnapshotHandle": g2}}}, "node-c"),
	)
	// g1's handle arrives with its status, as the snapshotter writes it.
	g1c, err := client.Resource(GroupContentsResource).Get(context.Background(), "g1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	g1c.Object["status"] = map[string]any{"volumeGroupSnapshotHandle": g1}
	if _, err := client.Resource(GroupContentsResource).Update(context.Background(), g1c, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "g1's status", func() bool { _, ok := h.GroupNode(g1); return ok })

	for _, c := range []struct {
		name, id string
		get      func(string) (string, bool)
		want     string
	}{
		{"PV", v1, h.VolumeNode, "node-a"},
		{"another PV", v2, h.VolumeNode, "node-b"},
		{"another driver's PV", "local.00000000000000000000000000000003", h.VolumeNode, ""},
		{"PV of two nodes", "local.00000000000000000000000000000004", h.VolumeNode, ""},
		{"no PV", vGone, h.VolumeNode, ""},
		{"content's source PV", s1, h.SnapshotNode, "node-a"},
		{"content's label", s2, h.SnapshotNode, "node-b"},
		{"content without a hint", s3, h.SnapshotNode, ""},
		{"another driver's content", "local@00000000000000000000000000000005", h.SnapshotNode, ""},
		{"group's member PV", g1, h.GroupNode, "node-b"},
		{"group's label", g2, h.GroupNode, "node-c"},
	} {
		t.Run(c.name, func(t *testing.T) {
			n, ok := c.get(c.id)
			if n != c.want || ok != (c.want != "") {
				t.Errorf("got %q %v, want %q", n, ok, c.want)
			}
		})
	}

	// The informers keep only the handle → node pair.
	pvs, _, _ := h.informers()
	for _, o := range pvs.GetStore().List() {
		u := o.(*unstructured.Unstructured)
		if _, ok := u.Object["spec"]; ok {
			t.Errorf("stored PV %s keeps its spec: %v", u.GetName(), u.Object)
		}
	}

	// A PV made later is seen; a deleted one is forgotten.
	v5 := "local.00000000000000000000000000000005"
	if _, err := client.Resource(PVsResource).Create(context.Background(), pv("pv-5", testDriver, v5, "node-c"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "pv-5", func() bool { n, _ := h.VolumeNode(v5); return n == "node-c" })
	if err := client.Resource(PVsResource).Delete(context.Background(), "pv-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "pv-1 gone", func() bool { _, ok := h.VolumeNode(v1); return !ok })

	// Learnt answers come after the objects.
	h.Learn(v1, "node-x")
	h.Learn(v2, "node-x")
	if n, _ := h.VolumeNode(v1); n != "node-x" {
		t.Errorf("learnt: %q", n)
	}
	if n, _ := h.VolumeNode(v2); n != "node-b" {
		t.Errorf("the PV's node is overridden by a learnt one: %q", n)
	}
}

// TestHintsWithoutContents: without discovery (or the CRDs), only PVs and learnt
// answers are hints, and the hints sync on PVs alone.
func TestHintsWithoutContents(t *testing.T) {
	s2 := "local@00000000000000000000000000000002"
	h, _ := newTestHints(t, false,
		content("c2", testDriver, map[string]any{"source": map[string]any{"snapshotHandle": s2}}, nil, "node-b"))
	if _, ok := h.SnapshotNode(s2); ok {
		t.Error("a content was read without discovery")
	}
	h.Learn(s2, "node-a")
	if n, _ := h.SnapshotNode(s2); n != "node-a" {
		t.Errorf("learnt: %q", n)
	}
	for i := range learntHints + 1 {
		h.Learn("local@"+string(rune(i)), "n")
	}
	if _, ok := h.SnapshotNode(s2); ok {
		t.Error("the LRU kept more than its size")
	}
}

// TestGroupNodes: a group content whose member PVs sit on two nodes names both; one
// on one node names none (the one-node path); a group learnt at its create names its
// nodes.
func TestGroupNodes(t *testing.T) {
	v1 := "local.00000000000000000000000000000001"
	v2 := "local.00000000000000000000000000000002"
	v3 := "local.00000000000000000000000000000003"
	across := "local@g-00000000000000000000000000000001"
	one := "local@g-00000000000000000000000000000002"
	learnt := "local@g-00000000000000000000000000000003"
	h, _ := newTestHints(t, true,
		pv("pv-1", testDriver, v1, "node-b"),
		pv("pv-2", testDriver, v2, "node-a"),
		pv("pv-3", testDriver, v3, "node-b"),
		groupContent("across", map[string]any{"source": map[string]any{"volumeHandles": []any{v1, v2, v3},
			"groupSnapshotHandles": map[string]any{"volumeGroupSnapshotHandle": across}}}, ""),
		groupContent("one", map[string]any{"source": map[string]any{"volumeHandles": []any{v1, v3},
			"groupSnapshotHandles": map[string]any{"volumeGroupSnapshotHandle": one}}}, ""),
	)
	h.LearnGroup(learnt, []string{"node-c", "node-a"})
	for id, want := range map[string][]string{across: {"node-a", "node-b"}, one: {"node-b"}, learnt: {"node-a", "node-c"}} {
		if got := h.GroupNodes(id); !slices.Equal(got, want) {
			t.Errorf("GroupNodes(%s) = %v, want %v", id, got, want)
		}
	}
}
