package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// TestUpgradeToCentral is the move of an installed chart from the per-node layout
// (localController.central false: the local driver's csi-provisioner, csi-resizer and
// csi-snapshotter in every node pod) to the central one, the chart's default (design
// §8, docs/upgrade.md "Moving an installed chart to the central local controller"). The
// release is this tree's chart installed with localController.central=false and local
// snapshots (snapshots.local, the snapshot-controller distributed); the per-node sidecars
// make a local claim a pod writes to all along, a local snapshot of it and an Immediate
// claim. The upgrade is helm upgrade's to the chart's defaults, in two steps: the node
// DaemonSet held from rolling (OnDelete) while everything else is applied, which is how
// a node the roll has not reached yet stands (the mixed window: the central controller
// runs, the node its per-node sidecars), and an Immediate claim made then goes to that
// node's own provisioner alone; then the chart as it renders, and the DaemonSet rolls.
// Afterwards: the writer ran through (no failed write, no restart, the same mount and
// loop device: no remount), the node pod runs no csi-* container and has its PoolNode, an
// Immediate claim is provisioned (the window ended), and the per-node volumes are served
// by the central controller: the writer's claim grows online, its snapshot restores bit
// for bit and is deleted, a new snapshot is taken, the Immediate claim is deleted, and a
// new claim is mounted on the node. Not in make test (a cluster of its own, ~2 min):
// docs/testing.md.
func TestUpgradeToCentral(t *testing.T) {
	start := time.Now()
	env := startEnv(t, cluster.EnvOptions{Values: map[string]any{
		"localController": map[string]any{"central": false},
		"snapshots":       map[string]any{"enabled": true, "local": true},
		"snapshotClass":   map[string]any{"create": true},
	}})
	installed := time.Now()
	ctx := context.Background()
	client := env.Cluster.Client
	dyn := dynamic.NewForConfigOrDie(env.Cluster.Config)
	env.storageClasses(t)
	ns := env.Namespace(t, "move")
	node := env.Node.Name

	// The per-node layout's volumes: the writer's claim, a snapshot of it, an Immediate
	// claim no pod uses.
	env.Claim(t, ns, cluster.ClaimSpec{Name: "data", Class: "local-xfs", Size: "256Mi"})
	env.Claim(t, ns, cluster.ClaimSpec{Name: "spare", Class: "local-immediate", Size: "64Mi"})
	w := cluster.PodObject(ns, cluster.PodSpec{Name: "writer", Claims: []string{"data"}})
	w.Spec.RestartPolicy = corev1.RestartPolicyNever
	w.Spec.Containers[0].Command = []string{"sh", "-c", upgradeWriter, "writer", "/data"}
	if _, err := client.CoreV1().Pods(ns).Create(ctx, w, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w = env.WaitRunning(t, ns, "writer")
	blob := strings.TrimSpace(env.MustExec(t, ns, "writer", "dd if=/dev/urandom of=/data/blob bs=1M count=4 2>/dev/null && sync && md5sum /data/blob | cut -d' ' -f1"))
	count := func() int {
		t.Helper()
		return checkCounter(t, env.MustExec(t, ns, "writer", "cat /data/log"), "/data")
	}
	cluster.WaitFor(t, 30*time.Second, "the writer's first records", func() error {
		if n := count(); n < 10 {
			return fmt.Errorf("%d records", n)
		}
		return nil
	})
	restoreSize := takeSnapshot(t, env, dyn, ns, "before", "data")
	spare := env.VolumeHandle(t, ns, "spare")
	dataPV := env.PVC(t, ns, "data").Spec.VolumeName
	mountBefore := publishMount(t, string(w.UID), dataPV)
	loopsBefore := sortedKeys(cluster.OurLoops(cluster.KubeletDir, cluster.LocalPoolPath))
	if len(loopsBefore) != 1 {
		t.Fatalf("loop devices of the local pool before the upgrade: %v, want 1 (the writer's)", loopsBefore)
	}
	nodeBefore, err := env.NodePodName(t)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("per-node layout: writer running, snapshot taken, Immediate claim %s bound, %s after the start", spare, time.Since(start).Round(time.Second))

	// helm upgrade to the chart's defaults: the move.
	up := time.Now()
	oldDocs, err := chart.Render(chart.ChartDir(), "", env.Overrides())
	if err != nil {
		t.Fatal(err)
	}
	newValues := env.Overrides()
	delete(newValues, "localController")
	newDocs, err := chart.Render(chart.ChartDir(), "", newValues)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range droppedObjects(t, oldDocs, newDocs) {
		t.Logf("upgrade: deleting %s %s, which the new chart no longer has", o.GetKind(), o.GetName())
		env.deleteObject(t, o)
	}

	// The mixed window, held open: everything applied, the node DaemonSet with OnDelete.
	env.ApplyChart(t, holdDaemonSets(t, newDocs))
	env.waitLocalController(t)
	if now, err := env.NodePodName(t); err != nil || now != nodeBefore {
		t.Fatalf("node pod %s (%v) while the roll is held, was %s", now, err, nodeBefore)
	}
	volumesBefore := len(poolVolumes(t, cluster.LocalPoolPath))
	env.Claim(t, ns, cluster.ClaimSpec{Name: "mixed", Class: "local-immediate", Size: "64Mi"})
	env.VolumeHandle(t, ns, "mixed")
	// The node's own provisioner took it (distributed immediate binding sets the selected
	// node; the central one places a claim without it) and made the one volume.
	if sel := env.PVC(t, ns, "mixed").Annotations["volume.kubernetes.io/selected-node"]; sel != node {
		t.Fatalf("Immediate claim in the mixed window: selected node %q, want %q (the per-node provisioner's)", sel, node)
	}
	time.Sleep(3 * time.Second) // a central create, were one to get through, would be done by now
	if n := len(poolVolumes(t, cluster.LocalPoolPath)); n != volumesBefore+1 {
		t.Fatalf("volumes in the local pool: %d before the Immediate claim of the mixed window, %d after, want one more", volumesBefore, n)
	}
	t.Logf("mixed window: the Immediate claim provisioned by the unrolled node; its events: %s", env.Events(ns, "mixed"))

	// The roll: the chart as it renders.
	env.ApplyChart(t, newDocs)
	env.waitNodeReplaced(t, nodeBefore)
	t.Logf("upgraded: the node pod replaced %s after the upgrade began", time.Since(up).Round(time.Second))

	// The node pod runs poolcsi alone, and the node has its PoolNode.
	nodePod, err := env.NodePodName(t)
	if err != nil {
		t.Fatal(err)
	}
	p, err := client.CoreV1().Pods(chart.Namespace).Get(ctx, nodePod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var containers []string
	for _, c := range p.Spec.Containers {
		containers = append(containers, c.Name)
	}
	if !slices.Equal(containers, []string{"poolcsi", "poolcsi-local"}) {
		t.Fatalf("node pod %s runs %v, want poolcsi and poolcsi-local alone", nodePod, containers)
	}
	cluster.WaitFor(t, 60*time.Second, "the PoolNode of "+node, func() error {
		_, err := dyn.Resource(poolNodeGVR).Namespace(chart.Namespace).Get(ctx, node, metav1.GetOptions{})
		return err
	})

	// The writer ran through: no failed write, no restart, the same mount and loop device.
	after := count()
	cluster.WaitFor(t, 30*time.Second, "writes after the upgrade", func() error {
		if n := count(); n <= after+10 {
			return fmt.Errorf("%d records, %d when the upgrade finished", n, after)
		}
		return nil
	})
	w, err = client.CoreV1().Pods(ns).Get(ctx, "writer", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if w.Status.Phase != corev1.PodRunning || len(w.Status.ContainerStatuses) != 1 || w.Status.ContainerStatuses[0].RestartCount != 0 ||
		w.Status.ContainerStatuses[0].State.Running == nil {
		t.Fatalf("the writer did not run through the upgrade: %s", cluster.PodSummary(w))
	}
	if m := publishMount(t, string(w.UID), dataPV); m != mountBefore {
		t.Fatalf("the writer's volume mount: %s before the upgrade, %s after", mountBefore, m)
	}
	if l := sortedKeys(cluster.OurLoops(cluster.KubeletDir, cluster.LocalPoolPath)); !slices.Equal(l, loopsBefore) {
		t.Fatalf("loop devices of the local pool: %v before the upgrade, %v after", loopsBefore, l)
	}

	// The window ended: an Immediate claim is provisioned, by the central controller.
	env.Claim(t, ns, cluster.ClaimSpec{Name: "late", Class: "local-immediate", Size: "64Mi"})
	env.VolumeHandle(t, ns, "late")

	// The per-node provisioner's volume grows online through the central resizer.
	before := env.DfBytes(t, ns, "writer", "/data")
	env.Resize(t, ns, "data", "512Mi")
	env.WaitCapacity(t, ns, "data", "512Mi", 150*time.Second)
	cluster.WaitFor(t, 60*time.Second, "the writer's filesystem grown", func() error {
		if n := env.DfBytes(t, ns, "writer", "/data"); n < before+200<<20 {
			return fmt.Errorf("df %d bytes, was %d", n, before)
		}
		return nil
	})
	// The per-node snapshotter's snapshot restores, then is deleted, through the central one.
	env.Claim(t, ns, cluster.ClaimSpec{Name: "restored", Class: "local-xfs", Size: restoreSize, DataSource: "before"})
	env.Pod(t, ns, cluster.PodSpec{Name: "reader", Claims: []string{"restored"}})
	if got := strings.TrimSpace(env.MustExec(t, ns, "reader", "md5sum /data/blob | cut -d' ' -f1")); got != blob {
		t.Fatalf("claim restored from the per-node snapshot reads %s, the source had %s", got, blob)
	}
	deleteSnapshot(t, env, dyn, ns, "before")
	takeSnapshot(t, env, dyn, ns, "after", "data")
	deleteSnapshot(t, env, dyn, ns, "after")
	// The per-node provisioner's Immediate claims are deleted by the central controller.
	for _, c := range []string{"spare", "mixed"} {
		env.deleteClaimAndPV(t, ns, c)
	}
	// A new claim on the node.
	env.Claim(t, ns, cluster.ClaimSpec{Name: "new", Class: "local-xfs", Size: "64Mi"})
	env.Pod(t, ns, cluster.PodSpec{Name: "newpod", Claims: []string{"new"}})
	env.MustExec(t, ns, "newpod", "echo hello > /data/x && sync")

	if out, err := exec.Command(env.Poolcsi, "pool", "check", "--path", cluster.LocalPoolPath).CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool check --path %s: %v\n%s", cluster.LocalPoolPath, err, out)
	}
	if n := checkCounter(t, env.MustExec(t, ns, "writer", "cat /data/log"), "/data"); n <= after {
		t.Fatalf("the writer stopped at %d records", n)
	}
	t.Logf("move to the central layout: %s in all, %s of it after the install, %s after the upgrade began",
		time.Since(start).Round(time.Second), time.Since(installed).Round(time.Second), time.Since(up).Round(time.Second))
}

// holdDaemonSets is docs with every DaemonSet's update strategy OnDelete: applied, the
// DaemonSet keeps its pods, as a node that a roll has not reached yet does.
func holdDaemonSets(t testing.TB, docs []chart.Doc) []chart.Doc {
	t.Helper()
	var out []chart.Doc
	for _, d := range docs {
		if d.Kind == "DaemonSet" {
			objs, err := cluster.ParseObjects([]byte(d.YAML))
			if err != nil {
				t.Fatal(err)
			}
			var yamls []string
			for _, o := range objs {
				if err := unstructured.SetNestedMap(o.Object, map[string]any{"type": "OnDelete"}, "spec", "updateStrategy"); err != nil {
					t.Fatal(err)
				}
				b, err := o.MarshalJSON()
				if err != nil {
					t.Fatal(err)
				}
				yamls = append(yamls, string(b)) // JSON is YAML
			}
			d.YAML = strings.Join(yamls, "\n---\n")
		}
		out = append(out, d)
	}
	return out
}

// waitLocalController waits for the local controller's Deployment to have a ready pod.
func (e *kubeletEnv) waitLocalController(t testing.TB) {
	t.Helper()
	cluster.WaitFor(t, 180*time.Second, "the local controller ready", func() error {
		d, err := e.Cluster.Client.AppsV1().Deployments(chart.Namespace).Get(context.Background(), "poolcsi-local-controller", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if d.Status.ReadyReplicas < 1 {
			return fmt.Errorf("%d ready replicas", d.Status.ReadyReplicas)
		}
		return nil
	})
}

// waitNodeReplaced waits until the node pod old is gone and its successor is ready, and
// then for the chart to be ready.
func (e *kubeletEnv) waitNodeReplaced(t testing.TB, old string) {
	t.Helper()
	ctx := context.Background()
	cluster.WaitFor(t, 240*time.Second, "node pod "+old+" replaced", func() error {
		pods, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, p := range pods.Items {
			if p.Name == old {
				return fmt.Errorf("pod %s still there: %s", p.Name, cluster.PodSummary(&p))
			}
			if p.DeletionTimestamp != nil || !cluster.PodReady(&p) {
				return fmt.Errorf("pod %s: %s", p.Name, cluster.PodSummary(&p))
			}
		}
		return nil
	})
	e.WaitChartReady(t)
}

// publishMount is the mount ID and device of the pod's publish mount of pv, as this
// machine's mountinfo has it: the same after an upgrade means no remount.
func publishMount(t testing.TB, podUID, pv string) string {
	t.Helper()
	target := filepath.Join(cluster.KubeletDir, "pods", podUID, "volumes", "kubernetes.io~csi", pv, "mount")
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && f[4] == target {
			found = append(found, f[0]+" "+f[2])
		}
	}
	if len(found) != 1 {
		t.Fatalf("mounts at %s: %v, want one", target, found)
	}
	return found[0]
}

// takeSnapshot makes VolumeSnapshot name of claim in ns with the chart's local class,
// waits for it to be ready and returns its restore size.
func takeSnapshot(t testing.TB, env *kubeletEnv, dyn dynamic.Interface, ns, name, claim string) string {
	t.Helper()
	ctx := context.Background()
	snap := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": map[string]any{"name": name, "namespace": ns},
		"spec":     map[string]any{"volumeSnapshotClassName": "poolcsi-local", "source": map[string]any{"persistentVolumeClaimName": claim}}}}
	if err := env.Cluster.Applier().Apply(ctx, snap, false); err != nil {
		t.Fatal(err)
	}
	var size string
	cluster.WaitFor(t, 2*time.Minute, "VolumeSnapshot "+ns+"/"+name+" ready", func() error {
		got, err := dyn.Resource(vsGVR).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		size, _, _ = unstructured.NestedString(got.Object, "status", "restoreSize")
		if ready, _, _ := unstructured.NestedBool(got.Object, "status", "readyToUse"); !ready || size == "" {
			st, _, _ := unstructured.NestedMap(got.Object, "status")
			return fmt.Errorf("status %v; events: %s", st, env.Events(ns, name))
		}
		return nil
	})
	return size
}

// deleteSnapshot deletes VolumeSnapshot name in ns and waits for it and its content
// (deletionPolicy Delete: the driver's DeleteSnapshot) to be gone.
func deleteSnapshot(t testing.TB, env *kubeletEnv, dyn dynamic.Interface, ns, name string) {
	t.Helper()
	ctx := context.Background()
	got, err := dyn.Resource(vsGVR).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	content, _, _ := unstructured.NestedString(got.Object, "status", "boundVolumeSnapshotContentName")
	if err := dyn.Resource(vsGVR).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster.WaitFor(t, 90*time.Second, "VolumeSnapshot "+ns+"/"+name+" and content "+content+" gone", func() error {
		if _, err := dyn.Resource(vsGVR).Namespace(ns).Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("VolumeSnapshot still there (%w)", err)
		}
		if _, err := dyn.Resource(vscGVR).Get(ctx, content, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("content still there (%w); events: %s", err, env.Events("", content))
		}
		return nil
	})
}

// deleteClaimAndPV deletes a claim no pod uses and waits for its PV (reclaim Delete: the
// driver's DeleteVolume) to be gone.
func (e *kubeletEnv) deleteClaimAndPV(t testing.TB, ns, name string) {
	t.Helper()
	ctx := context.Background()
	pv := e.PVC(t, ns, name).Spec.VolumeName
	if err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster.WaitFor(t, 90*time.Second, "PV "+pv+" of "+ns+"/"+name+" deleted", func() error {
		if _, err := e.Cluster.Client.CoreV1().PersistentVolumes().Get(ctx, pv, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("still there (%w); events: %s", err, e.Events(ns, name))
		}
		return nil
	})
}
