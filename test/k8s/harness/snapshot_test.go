package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

var (
	vsGVR      = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshots"}
	vscGVR     = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotcontents"}
	snapIDRE   = regexp.MustCompile(`^([a-z0-9][a-z0-9_-]*)@([0-9a-f]{32})$`)
	managedBy  = "snapshot.storage.kubernetes.io/managed-by"
	snapValues = map[string]any{
		"snapshots":     map[string]any{"enabled": true, "local": true},
		"snapshotClass": map[string]any{"create": true},
	}
)

// perNodeValues is values with the local pools' central controller off.
func perNodeValues(values map[string]any) map[string]any {
	values["localController"] = map[string]any{"central": false}
	return values
}

// snapshotVariant renders the chart as the plain YAML is in the per-node layout
// (TestKubernetes's), plus the shared pool, local snapshots (csi-snapshotter-local) and the
// VolumeSnapshotClasses, which the plain YAML leaves out (they need the CRDs).
func snapshotVariant(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	values := perNodeValues(chart.SharedPoolValues()) // the shared driver's VolumeSnapshotClass needs its pool
	for k, v := range snapValues {
		values[k] = v
	}
	docs, err := chart.Render(chart.ChartDir(), chart.RenderedValues(), values)
	if err != nil {
		t.Fatal(err)
	}
	var out []*unstructured.Unstructured
	for _, d := range docs {
		objs, err := cluster.ParseObjects([]byte(d.YAML))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, objs...)
	}
	return out
}

// snapshotCase is one VolumeSnapshot round trip: source claim, snapshot, restored claim,
// deletion.
type snapshotCase struct {
	driver       *driver
	driverName   string
	storageClass string
	snapClass    string
	node         string // selected node (local driver), "" for an Immediate class
	poolDir      string
	snapshotter  *cluster.Proc
	provisioner  *cluster.Proc
}

// testVolumeSnapshot: a VolumeSnapshot of a Bound claim becomes ReadyToUse through the
// real snapshot-controller and csi-snapshotter; its content's snapshotHandle is a snapshot
// poolcsi lists; a claim with that VolumeSnapshot as dataSource is provisioned by the real
// csi-provisioner (CreateVolume with a snapshot content source) and Binds; deleting the
// VolumeSnapshot (deletionPolicy Delete) deletes the snapshot from the pool.
func testVolumeSnapshot(t *testing.T, c *cluster.Cluster, sc snapshotCase) {
	ctx := context.Background()
	dyn := dynamic.NewForConfigOrDie(c.Config)
	prefix := strings.ReplaceAll(sc.snapClass, "poolcsi-", "")

	src := newPVC(prefix+"-snap-source", sc.storageClass, resource.MustParse("96Mi"), corev1.ReadWriteOnce)
	if sc.node != "" {
		src.Annotations = map[string]string{"volume.kubernetes.io/selected-node": sc.node}
	}
	srcPV := provision(t, c, src)
	t.Cleanup(func() { deleteClaim(t, c, src.Name, srcPV.Name) })
	srcHandle := srcPV.Spec.CSI.VolumeHandle

	vsName := prefix + "-snap"
	vs := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": map[string]any{"name": vsName, "namespace": "default"},
		"spec": map[string]any{
			"volumeSnapshotClassName": sc.snapClass,
			"source":                  map[string]any{"persistentVolumeClaimName": src.Name},
		},
	}}
	if _, err := dyn.Resource(vsGVR).Namespace("default").Create(ctx, vs, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating VolumeSnapshot %s: %v", vsName, err)
	}
	vsDeleted := false
	t.Cleanup(func() {
		if !vsDeleted {
			_ = dyn.Resource(vsGVR).Namespace("default").Delete(context.Background(), vsName, metav1.DeleteOptions{})
		}
	})
	contentName := waitSnapshotReady(t, c, vsName)
	content, err := dyn.Resource(vscGVR).Get(ctx, contentName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	handle, _, _ := unstructured.NestedString(content.Object, "status", "snapshotHandle")
	drv, _, _ := unstructured.NestedString(content.Object, "spec", "driver")
	policy, _, _ := unstructured.NestedString(content.Object, "spec", "deletionPolicy")
	srcVol, _, _ := unstructured.NestedString(content.Object, "spec", "source", "volumeHandle")
	restoreSize, _, _ := unstructured.NestedInt64(content.Object, "status", "restoreSize")
	if drv != sc.driverName || policy != "Delete" || srcVol != srcHandle {
		t.Errorf("VolumeSnapshotContent %s: driver %q, deletionPolicy %q, source %q; want %s, Delete, %s", contentName, drv, policy, srcVol, sc.driverName, srcHandle)
	}
	if sc.node != "" {
		// Distributed snapshotting: the snapshot-controller hands the content to the source
		// volume's node.
		if l := content.GetLabels()[managedBy]; l != sc.node {
			t.Errorf("VolumeSnapshotContent %s label %s=%q, want %q", contentName, managedBy, l, sc.node)
		}
	}
	m := snapIDRE.FindStringSubmatch(handle)
	if m == nil {
		t.Fatalf("VolumeSnapshotContent %s snapshotHandle %q is not <pool>@<32 hex>", contentName, handle)
	}
	snap := listSnapshot(t, sc.driver, handle)
	if snap == nil {
		t.Fatalf("poolcsi ListSnapshots does not know the snapshotHandle %s", handle)
	}
	if snap.GetSourceVolumeId() != srcHandle || !snap.GetReadyToUse() || snap.GetSizeBytes() != restoreSize {
		t.Errorf("ListSnapshots entry %+v; want source %s, ready, size %d (the content's restoreSize)", snap, srcHandle, restoreSize)
	}
	snapDir := filepath.Join(sc.poolDir, "snapshots", m[2])
	if _, err := os.Stat(filepath.Join(snapDir, "snapshot.json")); err != nil {
		t.Errorf("snapshot %s in the pool: %v", handle, err)
	}
	t.Logf("VolumeSnapshot %s ReadyToUse: content %s, snapshotHandle %s (ListSnapshots: source %s, %d bytes), restoreSize %d",
		vsName, contentName, handle, snap.GetSourceVolumeId(), snap.GetSizeBytes(), restoreSize)

	// Restore through the real csi-provisioner.
	restored := newPVC(prefix+"-snap-restore", sc.storageClass, srcPV.Spec.Capacity[corev1.ResourceStorage], corev1.ReadWriteOnce)
	apiGroup := "snapshot.storage.k8s.io"
	restored.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &apiGroup, Kind: "VolumeSnapshot", Name: vsName}
	restored.Spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: &apiGroup, Kind: "VolumeSnapshot", Name: vsName}
	if sc.node != "" {
		// A local snapshot lives in its node's pool: the claim must be scheduled there.
		restored.Annotations = map[string]string{"volume.kubernetes.io/selected-node": sc.node}
	}
	rPV := provision(t, c, restored)
	t.Cleanup(func() { deleteClaim(t, c, restored.Name, rPV.Name) })
	rHandle := rPV.Spec.CSI.VolumeHandle
	if rHandle == srcHandle || handleRE.FindStringSubmatch(rHandle) == nil {
		t.Fatalf("restored PV %s has volume handle %q (source %s)", rPV.Name, rHandle, srcHandle)
	}
	vol := listVolume(t, sc.driver, rHandle)
	if vol == nil {
		t.Fatalf("ListVolumes does not know the restored volume %s", rHandle)
	}
	if got := vol.GetContentSource().GetSnapshot().GetSnapshotId(); got != handle {
		t.Errorf("restored volume %s: ListVolumes content source snapshot %q, want %s", rHandle, got, handle)
	}
	if calls := logLines(t, sc.driver.proc, "/csi.v1.Controller/CreateVolume"); len(calls) == 0 {
		t.Errorf("no CreateVolume in poolcsi's log")
	}
	t.Logf("claim %s restored from %s: PV %s, handle %s, content source %s", restored.Name, vsName, rPV.Name, rHandle, handle)

	if sc.node != "" {
		testPreProvisionedLocalSnapshot(t, c, sc, handle, vsName+"-pre")
	}

	// Deleting the VolumeSnapshot deletes the content (deletionPolicy Delete), which
	// csi-snapshotter deletes from the pool.
	if err := dyn.Resource(vsGVR).Namespace("default").Delete(ctx, vsName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	vsDeleted = true
	waitSnapshotGone(t, c, vsName, contentName)
	if listSnapshot(t, sc.driver, handle) != nil {
		t.Errorf("VolumeSnapshot deleted, but ListSnapshots still has %s", handle)
	}
	if calls := logLines(t, sc.driver.proc, "/csi.v1.Controller/DeleteSnapshot"); len(calls) == 0 {
		t.Errorf("no DeleteSnapshot in poolcsi's log")
	}
	if _, err := os.Stat(snapDir); !os.IsNotExist(err) {
		t.Errorf("VolumeSnapshot deleted, but %s is still in the pool (%v)", snapDir, err)
	}
	t.Logf("VolumeSnapshot %s deleted: content gone, %s gone from ListSnapshots and the pool", vsName, handle)
	// The restored volume is independent of the snapshot.
	if listVolume(t, sc.driver, rHandle) == nil {
		t.Errorf("restored volume %s vanished with its snapshot", rHandle)
	}
	checkNoForbidden(t, sc.snapshotter)
	checkNoForbidden(t, sc.provisioner)
}

// testPreProvisionedLocalSnapshot: a VolumeSnapshotContent written by hand for an existing
// local snapshot (no source volume, so snapshot-controller gives it no managed-by label) is
// labelled for its node by that node's poolcsi (--claim-local-snapshots), whose
// csi-snapshotter then makes its VolumeSnapshot ready. Retain: deleting both leaves the
// snapshot in the pool.
func testPreProvisionedLocalSnapshot(t *testing.T, c *cluster.Cluster, sc snapshotCase, handle, name string) {
	ctx := context.Background()
	dyn := dynamic.NewForConfigOrDie(c.Config)
	content := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
		"metadata": map[string]any{"name": name},
		"spec": map[string]any{
			"driver": sc.driverName, "deletionPolicy": "Retain",
			"source":            map[string]any{"snapshotHandle": handle},
			"volumeSnapshotRef": map[string]any{"name": name, "namespace": "default"},
		},
	}}
	vs := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": map[string]any{"name": name, "namespace": "default"},
		"spec":     map[string]any{"source": map[string]any{"volumeSnapshotContentName": name}},
	}}
	if _, err := dyn.Resource(vscGVR).Create(ctx, content, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating VolumeSnapshotContent %s: %v", name, err)
	}
	if _, err := dyn.Resource(vsGVR).Namespace("default").Create(ctx, vs, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating VolumeSnapshot %s: %v", name, err)
	}
	cleanup := func() {
		_ = dyn.Resource(vsGVR).Namespace("default").Delete(context.Background(), name, metav1.DeleteOptions{})
		_ = dyn.Resource(vscGVR).Delete(context.Background(), name, metav1.DeleteOptions{})
	}
	t.Cleanup(cleanup)
	waitSnapshotReady(t, c, name)
	got, err := dyn.Resource(vscGVR).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if l := got.GetLabels()[managedBy]; l != sc.node {
		t.Errorf("pre-provisioned VolumeSnapshotContent %s label %s=%q, want %q", name, managedBy, l, sc.node)
	}
	claimed := false
	for _, l := range logLines(t, sc.driver.proc, "Claimed a content for this node's snapshotter") {
		claimed = claimed || strings.Contains(l, `content="`+name+`"`)
	}
	if !claimed {
		t.Errorf("no claim of the pre-provisioned content %s in poolcsi's log", name)
	}
	cleanup()
	waitSnapshotGone(t, c, name, name)
	if listSnapshot(t, sc.driver, handle) == nil {
		t.Errorf("deleting a Retain pre-provisioned content took snapshot %s with it", handle)
	}
	t.Logf("pre-provisioned VolumeSnapshot %s of %s: labelled %s=%s by poolcsi, ReadyToUse, deleted (snapshot kept)", name, handle, managedBy, sc.node)
}

// waitSnapshotReady waits for a VolumeSnapshot in default to be ReadyToUse and returns the
// name of the content it is bound to.
func waitSnapshotReady(t *testing.T, c *cluster.Cluster, name string) string {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(c.Config)
	var content string
	cluster.WaitFor(t, 120*time.Second, "VolumeSnapshot "+name+" ReadyToUse", func() error {
		got, err := dyn.Resource(vsGVR).Namespace("default").Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		ready, _, _ := unstructured.NestedBool(got.Object, "status", "readyToUse")
		content, _, _ = unstructured.NestedString(got.Object, "status", "boundVolumeSnapshotContentName")
		if !ready || content == "" {
			st, _, _ := unstructured.NestedMap(got.Object, "status")
			return fmt.Errorf("status %v; %s", st, lastEvent(c, name))
		}
		return nil
	})
	return content
}

// waitSnapshotGone waits for a deleted VolumeSnapshot in default and its content to be gone.
func waitSnapshotGone(t *testing.T, c *cluster.Cluster, name, content string) {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(c.Config)
	ctx := context.Background()
	cluster.WaitFor(t, 90*time.Second, "VolumeSnapshot "+name+" and content "+content+" gone", func() error {
		if _, err := dyn.Resource(vsGVR).Namespace("default").Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("VolumeSnapshot still there (%w)", err)
		}
		if got, err := dyn.Resource(vscGVR).Get(ctx, content, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			var fin []string
			if got != nil {
				fin = got.GetFinalizers()
			}
			return fmt.Errorf("content still there (%w), finalizers %v", err, fin)
		}
		return nil
	})
}

func listSnapshot(t *testing.T, d *driver, id string) *csi.Snapshot {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := d.controller().ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: id})
	if err != nil {
		t.Fatalf("ListSnapshots %s: %v", id, err)
	}
	for _, e := range resp.GetEntries() {
		if e.GetSnapshot().GetSnapshotId() == id {
			return e.GetSnapshot()
		}
	}
	return nil
}
