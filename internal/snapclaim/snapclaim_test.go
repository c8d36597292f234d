package snapclaim

import (
	"context"
	"errors"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	discoveryfake "k8s.io/client-go/discovery/fake"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	clienttesting "k8s.io/client-go/testing"
)

const (
	driver = "local.poolcsi.io"
	node   = "node-1"
	here   = "local-xfs@0123456789abcdef0123456789abcdef"
)

func content(name, drv string, source map[string]any, labels map[string]string) *unstructured.Unstructured {
	return object("snapshot.storage.k8s.io/v1", "VolumeSnapshotContent", "volumeSnapshotRef", "Retain", name, drv, source, labels)
}

func newClaimer(t *testing.T, holds func(context.Context, string) (bool, error), objs ...runtime.Object) (*Claimer, *dynamicfake.FakeDynamicClient) {
	t.Helper()
	client := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		ContentsResource:      "VolumeSnapshotContentList",
		GroupContentsResource: "VolumeGroupSnapshotContentList",
	}, objs...)
	return &Claimer{Client: client, Driver: driver, Node: node, Holds: holds, HoldsVolume: volumeHere, HoldsGroup: groupHere}, client
}

func holdsHere(_ context.Context, h string) (bool, error) { return h == here, nil }

func labelOf(t *testing.T, c *dynamicfake.FakeDynamicClient, name string) (string, bool) {
	t.Helper()
	return labelIn(t, c, ContentsResource, name)
}

func labelIn(t *testing.T, c *dynamicfake.FakeDynamicClient, r schema.GroupVersionResource, name string) (string, bool) {
	t.Helper()
	u, err := c.Resource(r).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v, ok := u.GetLabels()[ManagedByLabel]
	return v, ok
}

func TestClaim(t *testing.T) {
	snap := map[string]any{"snapshotHandle": here}
	for _, tc := range []struct {
		name    string
		content *unstructured.Unstructured
		holds   func(context.Context, string) (bool, error)
		want    bool
	}{
		{"pre-provisioned, held here", content("c", driver, snap, nil), holdsHere, true},
		{"pre-provisioned, held elsewhere", content("c", driver, map[string]any{"snapshotHandle": "local-xfs@ffffffffffffffffffffffffffffffff"}, nil), holdsHere, false},
		{"already labelled for another node", content("c", driver, snap, map[string]string{ManagedByLabel: "node-2"}), holdsHere, false},
		{"another driver's", content("c", "poolcsi.io", snap, nil), holdsHere, false},
		// Dynamic contents have a source volume; snapshot-controller labels them.
		{"dynamic", content("c", driver, map[string]any{"volumeHandle": "local-xfs.0123456789abcdef0123456789abcdef"}, nil), holdsHere, false},
		{"no source", content("c", driver, nil, nil), holdsHere, false},
		// The snapshot-controller's member of a cut group: source volume, group handle
		// annotated, snapshot handle in status.
		{"group member, held here", member("c", here), holdsHere, true},
		{"group member, held elsewhere", member("c", "local-xfs@ffffffffffffffffffffffffffffffff"), holdsHere, false},
		{"group member before its status", member("c", ""), holdsHere, false},
		{"pool unreadable", content("c", driver, snap, nil), func(context.Context, string) (bool, error) { return false, errors.New("EIO") }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, _ := tc.content.GetLabels()[ManagedByLabel]
			cl, client := newClaimer(t, tc.holds, tc.content)
			if got := cl.Claim(context.Background(), tc.content); got != tc.want {
				t.Fatalf("Claim = %v, want %v", got, tc.want)
			}
			label, _ := labelOf(t, client, "c")
			want := before
			if tc.want {
				want = node
			}
			if label != want {
				t.Fatalf("label after Claim = %q, want %q", label, want)
			}
		})
	}
}

// Run labels a content created while it watches, and leaves the others alone.
func TestRunClaimsNewContents(t *testing.T) {
	cl, client := newClaimer(t, holdsHere, content("elsewhere", driver, map[string]any{"snapshotHandle": "local-xfs@ffffffffffffffffffffffffffffffff"}, nil))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); cl.Run(ctx, time.Minute) }()
	t.Cleanup(func() { cancel(); <-done })

	if _, err := client.Resource(ContentsResource).Create(ctx, content("mine", driver, map[string]any{"snapshotHandle": here}, nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if v, ok := labelOf(t, client, "mine"); ok {
			if v != node {
				t.Fatalf("label = %q, want %q", v, node)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the content created while Run watched was never labelled")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if v, ok := labelOf(t, client, "elsewhere"); ok {
		t.Fatalf("a content whose snapshot is not here was labelled %q", v)
	}
}

// member is a group member content as external-snapshotter v8.7.0's snapshot-controller
// writes it (createIndividualSnapshotForGroupSnapshot); snap "" is before its status.
func member(name, snap string) *unstructured.Unstructured {
	u := content(name, driver, map[string]any{"volumeHandle": hereVol1}, nil)
	u.SetAnnotations(map[string]string{GroupHandleAnnotation: hereGroup})
	if snap != "" {
		u.Object["status"] = map[string]any{"snapshotHandle": snap, "volumeGroupSnapshotHandle": hereGroup, "readyToUse": true}
	}
	return u
}

const (
	hereVol1  = "local-xfs.0123456789abcdef0123456789abcdef"
	hereVol2  = "local-xfs.fedcba9876543210fedcba9876543210"
	elseVol   = "local-xfs.ffffffffffffffffffffffffffffffff"
	hereGroup = "local-xfs@g-0123456789abcdef0123456789abcdef"
)

func volumeHere(_ context.Context, h string) (bool, error) {
	return h == hereVol1 || h == hereVol2, nil
}

func groupHere(_ context.Context, g string, snaps []string) (bool, error) {
	return g == hereGroup && len(snaps) == 1 && snaps[0] == here, nil
}

func groupContent(name, drv string, source map[string]any, labels map[string]string) *unstructured.Unstructured {
	return object("groupsnapshot.storage.k8s.io/v1", "VolumeGroupSnapshotContent", "volumeGroupSnapshotRef", "Delete", name, drv, source, labels)
}

// object is a (group) snapshot content as the API server would return it.
func object(apiVersion, kind, ref, policy, name, drv string, source map[string]any, labels map[string]string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": apiVersion,
		"kind":       kind,
		"metadata":   map[string]any{"name": name},
		"spec": map[string]any{
			"driver":         drv,
			"deletionPolicy": policy,
			"source":         source,
			ref:              map[string]any{"name": "snap", "namespace": "default"},
		},
	}}
	u.SetLabels(labels)
	return u
}

func volumes(handles ...string) map[string]any {
	out := make([]any, len(handles))
	for i, h := range handles {
		out[i] = h
	}
	return map[string]any{"volumeHandles": out}
}

func preGroup(group string, snaps ...string) map[string]any {
	out := make([]any, len(snaps))
	for i, h := range snaps {
		out[i] = h
	}
	return map[string]any{"groupSnapshotHandles": map[string]any{"volumeGroupSnapshotHandle": group, "volumeSnapshotHandles": out}}
}

func TestClaimGroup(t *testing.T) {
	many := make([]string, maxGroupHandles+1)
	for i := range many {
		many[i] = hereVol1
	}
	var looked int
	counting := func(_ context.Context, h string) (bool, error) { looked++; return volumeHere(context.Background(), h) }
	for _, tc := range []struct {
		name        string
		content     *unstructured.Unstructured
		holdsVolume func(context.Context, string) (bool, error)
		want        bool
		maxLookups  int
	}{
		{"dynamic, every volume here", groupContent("g", driver, volumes(hereVol1, hereVol2), nil), counting, true, 2},
		{"dynamic, one volume elsewhere", groupContent("g", driver, volumes(hereVol1, elseVol, hereVol2), nil), counting, false, 2},
		{"dynamic, one volume", groupContent("g", driver, volumes(hereVol1), nil), counting, true, 1},
		{"another driver's", groupContent("g", "poolcsi.io", volumes(hereVol1), nil), counting, false, 0},
		{"already labelled for another node", groupContent("g", driver, volumes(hereVol1), map[string]string{ManagedByLabel: "node-2"}), counting, false, 0},
		{"pre-provisioned, here", groupContent("g", driver, preGroup(hereGroup, here), nil), counting, true, 0},
		{"pre-provisioned, elsewhere", groupContent("g", driver, preGroup("local-xfs@g-ffffffffffffffffffffffffffffffff", here), nil), counting, false, 0},
		{"pre-provisioned, other members", groupContent("g", driver, preGroup(hereGroup, here, "local-xfs@ffffffffffffffffffffffffffffffff"), nil), counting, false, 0},
		{"too many volume handles", groupContent("g", driver, volumes(many...), nil), counting, false, 0},
		{"too many snapshot handles", groupContent("g", driver, preGroup(hereGroup, many...), nil), counting, false, 0},
		{"both sources", groupContent("g", driver, map[string]any{"volumeHandles": []any{hereVol1}, "groupSnapshotHandles": preGroup(hereGroup, here)["groupSnapshotHandles"]}, nil), counting, false, 0},
		{"no source", groupContent("g", driver, nil, nil), counting, false, 0},
		{"pool unreadable", groupContent("g", driver, volumes(hereVol1), nil), func(context.Context, string) (bool, error) { looked++; return false, errors.New("EIO") }, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			looked = 0
			before, _ := tc.content.GetLabels()[ManagedByLabel]
			cl, client := newClaimer(t, holdsHere, tc.content)
			cl.HoldsVolume = tc.holdsVolume
			if got := cl.ClaimGroup(context.Background(), tc.content); got != tc.want {
				t.Fatalf("ClaimGroup = %v, want %v", got, tc.want)
			}
			if looked > tc.maxLookups {
				t.Fatalf("looked up %d volumes, want at most %d", looked, tc.maxLookups)
			}
			label, _ := labelIn(t, client, GroupContentsResource, "g")
			want := before
			if tc.want {
				want = node
			}
			if label != want {
				t.Fatalf("label after ClaimGroup = %q, want %q", label, want)
			}
		})
	}
}

// A patch the API server refuses (a conflict: the content changed since it was read) is
// logged and left to the next event; the next look claims it.
func TestClaimPatchConflictIsNotFatal(t *testing.T) {
	for _, tc := range []struct {
		name     string
		resource schema.GroupVersionResource
		obj      *unstructured.Unstructured
		claim    func(*Claimer) func(context.Context, *unstructured.Unstructured) bool
	}{
		{"single", ContentsResource, content("c", driver, map[string]any{"snapshotHandle": here}, nil), func(c *Claimer) func(context.Context, *unstructured.Unstructured) bool { return c.Claim }},
		{"group", GroupContentsResource, groupContent("c", driver, volumes(hereVol1), nil), func(c *Claimer) func(context.Context, *unstructured.Unstructured) bool { return c.ClaimGroup }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl, client := newClaimer(t, holdsHere, tc.obj)
			conflicts := 1
			client.PrependReactor("patch", tc.resource.Resource, func(clienttesting.Action) (bool, runtime.Object, error) {
				if conflicts == 0 {
					return false, nil, nil
				}
				conflicts--
				return true, nil, apierrors.NewConflict(tc.resource.GroupResource(), "c", errors.New("the object has been modified"))
			})
			if cl := tc.claim(cl); cl(context.Background(), tc.obj) {
				t.Fatal("claimed although the patch conflicted")
			}
			if v, ok := labelIn(t, client, tc.resource, "c"); ok {
				t.Fatalf("labelled %q although the patch conflicted", v)
			}
			if !tc.claim(cl)(context.Background(), tc.obj) {
				t.Fatal("the next look did not claim it")
			}
			if v, _ := labelIn(t, client, tc.resource, "c"); v != node {
				t.Fatalf("label = %q, want %q", v, node)
			}
		})
	}
}

func groupDiscovery(served bool) *discoveryfake.FakeDiscovery {
	d := &discoveryfake.FakeDiscovery{Fake: &clienttesting.Fake{}}
	if served {
		d.Resources = []*metav1.APIResourceList{{
			GroupVersion: GroupContentsResource.GroupVersion().String(),
			APIResources: []metav1.APIResource{{Name: "volumegroupsnapshotcontents", Kind: "VolumeGroupSnapshotContent"}, {Name: "volumegroupsnapshotclasses", Kind: "VolumeGroupSnapshotClass"}},
		}}
	}
	return d
}

// Run watches group contents only when discovery says the API server serves them; without
// the CRDs it still claims single contents, and looks for the group API once.
func TestRunGroupContents(t *testing.T) {
	failing := &discoveryfake.FakeDiscovery{Fake: &clienttesting.Fake{}}
	failing.PrependReactor("get", "resource", func(clienttesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("etcd leader changed")
	})
	for _, tc := range []struct {
		name      string
		discovery *discoveryfake.FakeDiscovery
		groups    bool
	}{
		{"CRDs installed", groupDiscovery(true), true},
		{"CRDs absent", groupDiscovery(false), false},
		{"discovery fails", failing, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl, client := newClaimer(t, holdsHere)
			cl.Discovery = tc.discovery
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); cl.Run(ctx, time.Minute) }()
			t.Cleanup(func() { cancel(); <-done })

			if _, err := client.Resource(GroupContentsResource).Create(ctx, groupContent("group", driver, volumes(hereVol1, hereVol2), nil), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if _, err := client.Resource(ContentsResource).Create(ctx, content("single", driver, map[string]any{"snapshotHandle": here}, nil), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			// The informers handle events in order per resource, not across them: wait for
			// the single content, then for the group one where it is watched.
			waitLabel(t, client, ContentsResource, "single")
			if tc.groups {
				waitLabel(t, client, GroupContentsResource, "group")
			} else if v, ok := labelIn(t, client, GroupContentsResource, "group"); ok {
				t.Fatalf("group content labelled %q without the group API", v)
			}
			if n := len(tc.discovery.Actions()); n != 1 {
				t.Fatalf("discovery asked %d times, want once", n)
			}
		})
	}
}

func waitLabel(t *testing.T, client *dynamicfake.FakeDynamicClient, r schema.GroupVersionResource, name string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if v, ok := labelIn(t, client, r, name); ok {
			if v != node {
				t.Fatalf("%s %s: label = %q, want %q", r.Resource, name, v, node)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s %s was never labelled", r.Resource, name)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
