package harness

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// localOnB is a local claim "c" (xfs, in namespace local-b) of the pool of the node that
// does not run the local controller, with its pod "p" there, for TestTwoNodes's subtests of
// the central controller: each call about the volume (modify, expand, snapshot) goes from
// the controller on node-a to node's agent through a PoolCall. The first subtest that needs
// them makes them, so each subtest also runs alone (-run).
type localOnB struct {
	env  *kubeletEnv
	node string
	ns   string
	pod  *corev1.Pod
	blob string // the md5 of /data/blob, written when the pod started
	made bool   // making them was tried
}

// ensure makes the claim, of class local-slow (a VolumeAttributesClass given at creation),
// and its pod on b.node, and writes the blob.
func (b *localOnB) ensure(t *testing.T) {
	t.Helper()
	switch {
	case b.pod != nil:
		return
	case b.made:
		t.Fatal("the node-b local claim and pod could not be made (an earlier subtest failed making them)")
	}
	b.made = true
	env := b.env
	env.volumeAttributesClass(t, "local-slow", cluster.LocalDriver, map[string]string{"writeBytesPerSecond": "4Mi", "readIOPS": "300"})
	env.volumeAttributesClass(t, "local-fast", cluster.LocalDriver, map[string]string{"writeBytesPerSecond": "16Mi", "readIOPS": "0"})
	b.ns = env.Namespace(t, "local-b")
	pvc := cluster.ClaimObject(b.ns, cluster.ClaimSpec{Name: "c", Class: "local-xfs", Size: "300Mi"})
	slow := "local-slow"
	pvc.Spec.VolumeAttributesClassName = &slow
	if _, err := env.Cluster.Client.CoreV1().PersistentVolumeClaims(b.ns).Create(context.Background(), pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := env.Pod(t, b.ns, cluster.PodSpec{Name: "p", Claims: []string{"c"}, Node: b.node})
	pv, err := env.Cluster.Client.CoreV1().PersistentVolumes().Get(context.Background(), env.PVC(t, b.ns, "c").Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pvNodes(pv); len(got) != 1 || got[0] != b.node {
		t.Fatalf("PV %s node affinity %v, want %s", pv.Name, got, b.node)
	}
	b.blob = strings.TrimSpace(env.MustExec(t, b.ns, "p", writeBlob))
	b.pod = pod
}

// modify: the class given at creation holds the pod's I/O, and a change of class (csi-resizer
// in the local controller, ControllerModifyVolume on node-b's agent) reaches the same
// running pod.
func (b *localOnB) modify(t *testing.T) {
	b.ensure(t)
	env, ns, p := b.env, b.ns, b.pod
	env.waitThrottle(t, p, "blkio.throttle.write_bps_device", 4<<20)
	env.waitThrottle(t, p, "blkio.throttle.read_iops_device", 300)
	env.patchClaim(t, ns, "c", `{"spec":{"volumeAttributesClassName":"local-fast"}}`)
	cluster.WaitFor(t, 2*time.Minute, "claim "+ns+"/c modified to local-fast", func() error {
		got := env.PVC(t, ns, "c")
		if cur := got.Status.CurrentVolumeAttributesClassName; cur == nil || *cur != "local-fast" {
			return fmt.Errorf("current class %v, modify status %+v; events: %s", cur, got.Status.ModifyVolumeStatus, env.Events(ns, "c"))
		}
		return nil
	})
	env.waitThrottle(t, p, "blkio.throttle.write_bps_device", 16<<20)
	env.waitThrottle(t, p, "blkio.throttle.read_iops_device", 0)
	if got := env.PVC(t, ns, "c"); got.Status.ModifyVolumeStatus != nil {
		t.Fatalf("modify status left on the claim: %+v", got.Status.ModifyVolumeStatus)
	}
}

// expand: the claim grows while its pod runs (ControllerExpandVolume on node-b's agent,
// then kubelet's NodeExpandVolume grows the image and the filesystem), its data intact.
func (b *localOnB) expand(t *testing.T) {
	b.ensure(t)
	env, ns := b.env, b.ns
	before := env.DfBytes(t, ns, "p", "/data")
	env.Resize(t, ns, "c", "600Mi")
	env.WaitCapacity(t, ns, "c", "600Mi", 150*time.Second)
	cluster.WaitFor(t, 60*time.Second, "the pod's filesystem grown", func() error {
		if after := env.DfBytes(t, ns, "p", "/data"); after < before+250<<20 {
			return fmt.Errorf("df %d bytes, was %d", after, before)
		}
		return nil
	})
	if got := sum(t, env, ns, "p", "/data/blob"); got != b.blob {
		t.Fatalf("data after growth: %s, wrote %s", got, b.blob)
	}
}

// snapshot: a VolumeSnapshot of the claim (the chart's local class, the local controller's
// csi-snapshotter, CreateSnapshot on node-b's agent) restored into a new claim on node-b,
// where the snapshot lives, holds the blob bit for bit and nothing written after it.
func (b *localOnB) snapshot(t *testing.T) {
	b.ensure(t)
	env, ns := b.env, b.ns
	ctx := context.Background()
	snap := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": map[string]any{"name": "snap", "namespace": ns},
		"spec":     map[string]any{"volumeSnapshotClassName": "poolcsi-local", "source": map[string]any{"persistentVolumeClaimName": "c"}}}}
	if err := env.Cluster.Applier().Apply(ctx, snap, false); err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(env.Cluster.Config)
	var size string
	cluster.WaitFor(t, 2*time.Minute, "VolumeSnapshot "+ns+"/snap ready", func() error {
		got, err := dyn.Resource(vsGVR).Namespace(ns).Get(ctx, "snap", metav1.GetOptions{})
		if err != nil {
			return err
		}
		size, _, _ = unstructured.NestedString(got.Object, "status", "restoreSize")
		if ready, _, _ := unstructured.NestedBool(got.Object, "status", "readyToUse"); !ready || size == "" {
			st, _, _ := unstructured.NestedMap(got.Object, "status")
			return fmt.Errorf("status %v; events: %s", st, env.Events(ns, "snap"))
		}
		return nil
	})
	// Written after the snapshot: the restored claim must not have it.
	env.MustExec(t, ns, "p", "echo after > /data/after && sync")
	env.Claim(t, ns, cluster.ClaimSpec{Name: "restored", Class: "local-xfs", Size: size, DataSource: "snap"})
	env.Pod(t, ns, cluster.PodSpec{Name: "q", Claims: []string{"restored"}, Node: b.node})
	if got := sum(t, env, ns, "q", "/data/blob"); got != b.blob {
		t.Fatalf("restored claim reads %s, the source had %s", got, b.blob)
	}
	if out, err := env.Exec(t, ns, "q", "cat /data/after"); err == nil {
		t.Fatalf("the restored claim has a file written after the snapshot: %q", out)
	}
	t.Logf("snapshot of %s (restoreSize %s) restored on %s", env.VolumeHandle(t, ns, "c"), size, b.node)
}
