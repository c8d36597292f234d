package main

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/snapclaim"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	discoveryfake "k8s.io/client-go/discovery/fake"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	clienttesting "k8s.io/client-go/testing"
)

// On real devices (root): a group cut from an xfs volume staged through a real loop device
// and mount, and the claim, with the lookups --claim-local-snapshots wires, labels the
// group's VolumeGroupSnapshotContent and the member VolumeSnapshotContents the
// snapshot-controller makes of it, and none of another node's group. The API server is
// client-go's fake: what is real here is the driver the lookups ask.
func TestClaimGroupOnRealDevices(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.xfs", "blkid", "mount", "umount", "losetup")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root) // registered first: runs after every other cleanup
	p, err := pool.Initialise(pool.Config{Name: "local", Path: filepath.Join(root, "pool")})
	if err != nil {
		t.Fatal(err)
	}
	d, err := driver.New(driver.Options{Name: "local.test", Version: "v-test", NodeID: "node-1", Mode: driver.ModeAll, Pools: []*pool.Pool{p}})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(serveInTest(t, d, root), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ctrl, nodeSvc, groups := csi.NewControllerClient(conn), csi.NewNodeClient(conn), csi.NewGroupControllerClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)

	vc := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	var vols []string
	for _, name := range []string{"data", "wal"} {
		resp, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 300 * pool.MiB},
			VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: map[string]string{driver.ParamPool: "local"},
		})
		if err != nil {
			t.Fatalf("CreateVolume %s: %v", name, err)
		}
		id := resp.GetVolume().GetVolumeId()
		vols = append(vols, id)
		t.Cleanup(func() {
			if _, err := ctrl.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Errorf("DeleteVolume %s: %v", id, err)
			}
		})
	}
	// Staged read-write: the group freezes its filesystem, so the group is cut as it would
	// be under a pod.
	staging := filepath.Join(root, "staging", "data")
	t.Cleanup(func() {
		if _, err := nodeSvc.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: vols[0], StagingTargetPath: staging}); err != nil {
			t.Errorf("NodeUnstageVolume: %v", err)
		}
	})
	if _, err := nodeSvc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vols[0], StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	g, err := groups.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: vols})
	if err != nil {
		t.Fatalf("CreateVolumeGroupSnapshot: %v", err)
	}
	group := g.GetGroupSnapshot().GetGroupSnapshotId()
	var members []any
	for _, s := range g.GetGroupSnapshot().GetSnapshots() {
		members = append(members, s.GetSnapshotId())
	}
	t.Cleanup(func() {
		ids := make([]string, len(members))
		for i, m := range members {
			ids[i] = m.(string)
		}
		if _, err := groups.DeleteVolumeGroupSnapshot(context.Background(), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: group, SnapshotIds: ids}); err != nil {
			t.Errorf("DeleteVolumeGroupSnapshot: %v", err)
		}
	})

	groupContent := func(name string, source map[string]any) *unstructured.Unstructured {
		return &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshotContent",
			"metadata": map[string]any{"name": name},
			"spec":     map[string]any{"driver": "local.test", "deletionPolicy": "Delete", "source": source},
		}}
	}
	member := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
		"metadata": map[string]any{"name": "member", "annotations": map[string]any{snapclaim.GroupHandleAnnotation: group}},
		"spec":     map[string]any{"driver": "local.test", "deletionPolicy": "Delete", "source": map[string]any{"volumeHandle": vols[0]}},
		"status":   map[string]any{"snapshotHandle": members[0], "volumeGroupSnapshotHandle": group},
	}}
	objs := []runtime.Object{
		groupContent("dynamic", map[string]any{"volumeHandles": []any{vols[0], vols[1]}}),
		groupContent("pre-provisioned", map[string]any{"groupSnapshotHandles": map[string]any{"volumeGroupSnapshotHandle": group, "volumeSnapshotHandles": members}}),
		groupContent("elsewhere", map[string]any{"volumeHandles": []any{vols[0], "local.ffffffffffffffffffffffffffffffff"}}),
		member,
	}
	client := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		snapclaim.ContentsResource: "VolumeSnapshotContentList", snapclaim.GroupContentsResource: "VolumeGroupSnapshotContentList",
	}, objs...)
	disc := &discoveryfake.FakeDiscovery{Fake: &clienttesting.Fake{}}
	disc.Resources = []*metav1.APIResourceList{{
		GroupVersion: snapclaim.GroupContentsResource.GroupVersion().String(),
		APIResources: []metav1.APIResource{{Name: snapclaim.GroupContentsResource.Resource}},
	}}
	c := &snapclaim.Claimer{Client: client, Discovery: disc, Driver: "local.test", Node: "node-1",
		Holds: snapshotHere(d), HoldsVolume: volumeHere(d), HoldsGroup: groupHere(d)}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); c.Run(runCtx, time.Minute) }()
	t.Cleanup(func() { stop(); <-done })

	for _, want := range []struct {
		r    schema.GroupVersionResource
		name string
	}{{snapclaim.GroupContentsResource, "dynamic"}, {snapclaim.GroupContentsResource, "pre-provisioned"}, {snapclaim.ContentsResource, "member"}} {
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			u, err := client.Resource(want.r).Get(ctx, want.name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if v, ok := u.GetLabels()[snapclaim.ManagedByLabel]; ok {
				if v != "node-1" {
					t.Fatalf("%s: label %q, want node-1", want.name, v)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s %s was never labelled", want.r.Resource, want.name)
			}
		}
	}
	// The informer's order of adds is the fake's (a map's): look at the group with a volume
	// that is not here directly, then check nothing labelled it.
	u, err := client.Resource(snapclaim.GroupContentsResource).Get(ctx, "elsewhere", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if c.ClaimGroup(ctx, u) {
		t.Fatal("claimed a group with a volume that is not here")
	}
	if u, err = client.Resource(snapclaim.GroupContentsResource).Get(ctx, "elsewhere", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	if v, ok := u.GetLabels()[snapclaim.ManagedByLabel]; ok {
		t.Fatalf("a group with a volume elsewhere was labelled %q", v)
	}
}
