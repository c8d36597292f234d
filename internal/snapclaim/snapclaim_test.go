package snapclaim

import (
	"context"
	"errors"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
)

const (
	driver = "local.poolcsi.io"
	node   = "node-1"
	here   = "local-xfs@0123456789abcdef0123456789abcdef"
)

func content(name, drv string, source map[string]any, labels map[string]string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1",
		"kind":       "VolumeSnapshotContent",
		"metadata":   map[string]any{"name": name},
		"spec": map[string]any{
			"driver":         drv,
			"deletionPolicy": "Retain",
			"source":         source,
			"volumeSnapshotRef": map[string]any{
				"name": "snap", "namespace": "default",
			},
		},
	}}
	u.SetLabels(labels)
	return u
}

func newClaimer(t *testing.T, holds func(context.Context, string) (bool, error), objs ...runtime.Object) (*Claimer, *dynamicfake.FakeDynamicClient) {
	t.Helper()
	client := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{ContentsResource: "VolumeSnapshotContentList"}, objs...)
	return &Claimer{Client: client, Driver: driver, Node: node, Holds: holds}, client
}

func holdsHere(_ context.Context, h string) (bool, error) { return h == here, nil }

func labelOf(t *testing.T, c *dynamicfake.FakeDynamicClient, name string) (string, bool) {
	t.Helper()
	u, err := c.Resource(ContentsResource).Get(context.Background(), name, metav1.GetOptions{})
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
