package harness

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// twoNodeLease is the lease timing of the two-node cluster: the production timeline
// (docs/fencing.md) scaled down, so that a partition test does not wait 90 s for it.
var twoNodeLease = map[string]any{"leaseDuration": "6s", "renewInterval": "1s", "margin": "3s"}

// TestTwoNodes drives the flows where a shared-storage driver loses data, through two
// real kubelets, the attach/detach controller and the chart as it is, on both kinds of
// shared pool: a ReadWriteOnce image claim moved from node to node (cordon and delete;
// drain while it is written), an RWX dir claim written from both nodes and expanded while
// in use, and a node partitioned while its pod writes, taken over through the
// out-of-service taint (its pool covered on the CephFS; on btrfs its pool's mount
// vanishes, and again with its node plugin restarted while the pool is gone). On btrfs
// also: a local claim that keeps its pod on its node (the shared pool plays no part) and
// a node powered off and back (on this machine a powered-off node's ceph-fuse client
// would live on, holding its capabilities, which no real power cut does).
func TestTwoNodes(t *testing.T) {
	t.Run("btrfs", func(t *testing.T) { testTwoNodes(t, false) })
	t.Run("cephfs", func(t *testing.T) { testTwoNodes(t, true) })
}

func testTwoNodes(t *testing.T, cephFS bool) {
	values := map[string]any{
		"fencing": twoNodeLease,
		// The controller stays on node-a: the partition test cuts node-b off the pool
		// and the API server, and a controller cut off both would hold its leader lease
		// until it ran out, as on a real cluster, only slower. The local controller
		// (btrfs) takes the controller's nodeSelector: it stays on node-a too.
		"controller": map[string]any{"nodeSelector": map[string]any{"kubernetes.io/hostname": "node-a"}},
	}
	if !cephFS {
		// The local driver's central controller (docs/design/central-controller.md), the
		// chart's default layout: its csi-snapshotter takes the local snapshots, with the
		// chart's local classes.
		values["snapshotClass"] = map[string]any{"create": true}
		values["groupSnapshotClass"] = map[string]any{"create": true}
	} else {
		// The CephFS run has no local subtest: it keeps the per-node layout, which the
		// btrfs run no longer covers.
		values["localController"] = map[string]any{"central": false}
	}
	env := startEnv(t, cluster.EnvOptions{Nodes: 2, CephFS: cephFS, Values: values})
	env.storageClasses(t)
	nodeA, nodeB := env.Nodes[0], env.Nodes[1]

	t.Run("RWO image claim moves to the other node", func(t *testing.T) { env.moveRWO(t) })
	t.Run("RWX dir claim on both nodes, expanded while in use", func(t *testing.T) { env.rwxTwoNodes(t, !cephFS) })
	t.Run("ROX image claim read on both nodes", func(t *testing.T) { env.roxTwoNodes(t) })
	if !cephFS {
		t.Run("local claim keeps its pod on its node", func(t *testing.T) { env.localStays(t) })
		// What the central controller reaches on the node that does not run it, through
		// PoolCalls to node-b's agent; one claim and pod serve the first three.
		b := &localOnB{env: env, node: nodeB.Name}
		t.Run("node-b local claim: VolumeAttributesClass change reaches its running pod", func(t *testing.T) { b.modify(t) })
		t.Run("node-b local claim: expanded while its pod runs", func(t *testing.T) { b.expand(t) })
		t.Run("node-b local claim: snapshot restored into a new claim", func(t *testing.T) { b.snapshot(t) })
		t.Run("node-b local claims: group snapshot restored to one instant", func(t *testing.T) {
			groupSnapshotOneInstant(t, env, groupCase{driver: cluster.LocalDriver, class: "poolcsi-local-group",
				data: "local-xfs", wal: "local-ext4", node: nodeB.Name, chartClass: true})
		})
		t.Run("local claims on both nodes: group snapshot restored to one instant", func(t *testing.T) {
			groupAcrossNodes(t, env, nodeA.Name, nodeB.Name)
		})
	}
	if cephFS {
		t.Run("partitioned node taken over through the out-of-service taint", func(t *testing.T) {
			env.partitionTakeover(t, nodeB, nodeA)
		})
	} else {
		// The same partition, its pool lost another way: the mount vanishes instead of
		// being covered (a covered one is the CephFS run's, and every way on both
		// filesystems is test/shared's TestLostPoolNeverWritesLate).
		t.Run("partitioned node whose pool vanished taken over through the out-of-service taint", func(t *testing.T) {
			env.lostPoolTakeover(t, nodeB, nodeA, false)
		})
		t.Run("node whose pool vanished and whose node plugin restarted taken over", func(t *testing.T) {
			env.lostPoolTakeover(t, nodeB, nodeA, true)
		})
		t.Run("powered-off node taken over, then back", func(t *testing.T) {
			env.powerOffTakeover(t, nodeB, nodeA)
		})
	}
}

// moveRWO: a StatefulSet pod with a ReadWriteOnce image claim of the shared pool moves to
// the other node when its node is cordoned and the pod deleted, and back when that node is
// drained while the pod writes: not a line lost or torn.
func (env *kubeletEnv) moveRWO(t *testing.T) {
	ns := env.Namespace(t, "move")
	env.statefulSet(t, ns, "db", "shared-ext4", "")
	from := env.WaitPodOn(t, ns, "db-0", "", "")
	blob := strings.TrimSpace(env.MustExec(t, ns, "db-0", writeBlob))

	// Cordon and delete: the StatefulSet brings the pod back on the other node.
	env.cordon(t, from.Spec.NodeName, true)
	if err := env.Cluster.Client.CoreV1().Pods(ns).Delete(context.Background(), "db-0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	to := env.WaitPodOn(t, ns, "db-0", string(from.UID), other(from.Spec.NodeName))
	env.cordon(t, from.Spec.NodeName, false)
	if got := sum(t, env, ns, "db-0", "/data/blob"); got != blob {
		t.Fatalf("after the move from %s to %s: wrote %s, read %s", from.Spec.NodeName, to.Spec.NodeName, blob, got)
	}

	// kubectl drain while the pod writes: cordon, then evict through the Eviction API.
	env.MustExec(t, ns, "db-0", "echo "+to.Spec.NodeName+" > /data/writer")
	var before int
	cluster.WaitFor(t, 60*time.Second, "the writer's first 2000 lines", func() error {
		before = lineCount(t, env, ns, "db-0", "/data/seq")
		if before < 2000 {
			return fmt.Errorf("%d lines", before)
		}
		return nil
	})
	env.cordon(t, to.Spec.NodeName, true)
	env.evict(t, ns, "db-0")
	back := env.WaitPodOn(t, ns, "db-0", string(to.UID), from.Spec.NodeName)
	env.cordon(t, to.Spec.NodeName, false)
	n := checkSequence(t, env, ns, "db-0", "/data/seq")
	if n < before {
		t.Fatalf("the writer had written %d lines before the drain; %d on the volume after it", before, n)
	}
	if got := sum(t, env, ns, "db-0", "/data/blob"); got != blob {
		t.Fatalf("after the drain: wrote %s, read %s", blob, got)
	}
	t.Logf("moved %s -> %s (cordon, delete) -> %s (drain while writing: %d lines, none lost or torn)",
		from.Spec.NodeName, to.Spec.NodeName, back.Spec.NodeName, n)
}

// rwxTwoNodes: an RWX dir claim mounted on both nodes, written from both, expanded while
// both use it; quota: the pool enforces dir volume sizes (btrfs quota groups).
func (env *kubeletEnv) rwxTwoNodes(t *testing.T, quota bool) {
	nodeA, nodeB := env.Nodes[0], env.Nodes[1]
	ns := env.Namespace(t, "rwx2")
	env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "shared-dir", Size: "64Mi", RWX: true})
	env.Pod(t, ns, cluster.PodSpec{Name: "a", Claims: []string{"c"}, Node: nodeA.Name})
	env.Pod(t, ns, cluster.PodSpec{Name: "b", Claims: []string{"c"}, Node: nodeB.Name})
	sumA := strings.TrimSpace(env.MustExec(t, ns, "a", "dd if=/dev/urandom of=/data/a bs=1M count=4 2>/dev/null && sync && md5sum /data/a | cut -d' ' -f1"))
	sumB := strings.TrimSpace(env.MustExec(t, ns, "b", "dd if=/dev/urandom of=/data/b bs=1M count=4 2>/dev/null && sync && md5sum /data/b | cut -d' ' -f1"))
	if got := sum(t, env, ns, "b", "/data/a"); got != sumA {
		t.Fatalf("node-a wrote %s, node-b reads %s", sumA, got)
	}
	if got := sum(t, env, ns, "a", "/data/b"); got != sumB {
		t.Fatalf("node-b wrote %s, node-a reads %s", sumB, got)
	}
	// 64 MiB is the limit (btrfs quota): 80 MiB more does not fit before the
	// expansion, and does after it.
	if quota {
		if out, err := env.Exec(t, ns, "b", "dd if=/dev/zero of=/data/big bs=1M count=80 conv=fsync 2>&1"); err == nil {
			t.Fatalf("80 MiB written into a 64 MiB dir volume: %s", out)
		}
		env.MustExec(t, ns, "b", "rm -f /data/big && sync")
	}
	env.Resize(t, ns, "c", "256Mi")
	env.WaitCapacity(t, ns, "c", "256Mi", 120*time.Second)
	env.MustExec(t, ns, "a", "dd if=/dev/zero of=/data/big bs=1M count=80 conv=fsync 2>/dev/null")
	if got := sum(t, env, ns, "b", "/data/a"); got != sumA {
		t.Fatalf("after the expansion node-b reads %s of node-a's file, wrote %s", got, sumA)
	}
	if got := strings.TrimSpace(env.MustExec(t, ns, "b", "ls -l /data/big | awk '{print $5}'")); got != strconv.Itoa(80<<20) {
		t.Fatalf("node-b sees node-a's 80 MiB file as %s bytes", got)
	}
}

// roxTwoNodes: an image claim written on one node and cloned into a ReadOnlyMany claim is
// read, bit for bit, by pods on both nodes at once, which cannot write to it.
func (env *kubeletEnv) roxTwoNodes(t *testing.T) {
	nodeA, nodeB := env.Nodes[0], env.Nodes[1]
	ns := env.Namespace(t, "rox2")
	env.Claim(t, ns, cluster.ClaimSpec{Name: "src", Class: "shared-ext4", Size: "64Mi"})
	env.Pod(t, ns, cluster.PodSpec{Name: "writer", Claims: []string{"src"}, Node: nodeA.Name})
	blob := strings.TrimSpace(env.MustExec(t, ns, "writer", writeBlob))
	env.DeletePod(t, ns, "writer")
	env.Claim(t, ns, cluster.ClaimSpec{Name: "ro", Class: "shared-ext4", Size: "64Mi", ROX: true, Clone: "src"})
	for _, n := range []*cluster.Node{nodeA, nodeB} {
		name := "reader-" + n.Name
		env.Pod(t, ns, cluster.PodSpec{Name: name, Claims: []string{"ro"}, ReadOnly: true, Node: n.Name})
		if got := sum(t, env, ns, name, "/data/blob"); got != blob {
			t.Fatalf("%s reads %s of the ROX claim, %s was written", n.Name, got, blob)
		}
		if out, err := env.Exec(t, ns, name, "echo x > /data/x"); err == nil {
			t.Fatalf("%s wrote to a ReadOnlyMany claim: %s", n.Name, out)
		}
	}
	// Both at once: the first reader still reads, after the second node staged.
	if got := strings.TrimSpace(env.MustExec(t, ns, "reader-"+nodeA.Name, "echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; md5sum /data/blob | cut -d' ' -f1")); got != blob {
		t.Fatalf("%s reads %s of the ROX claim once %s has it too, %s was written", nodeA.Name, got, nodeB.Name, blob)
	}
}

// localStays: a local claim's volume is on the node of its first pod, and the claim's next
// pod goes nowhere else (Pending, saying why, while that node is cordoned).
func (env *kubeletEnv) localStays(t *testing.T) {
	ns := env.Namespace(t, "local2")
	env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "local-xfs", Size: "64Mi"})
	first := env.Pod(t, ns, cluster.PodSpec{Name: "p1", Claims: []string{"c"}})
	home := first.Spec.NodeName
	pv, err := env.Cluster.Client.CoreV1().PersistentVolumes().Get(context.Background(), env.PVC(t, ns, "c").Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pvNodes(pv); len(got) != 1 || got[0] != home {
		t.Fatalf("PV %s node affinity %v, want the node of its first pod, %s", pv.Name, got, home)
	}
	blob := strings.TrimSpace(env.MustExec(t, ns, "p1", writeBlob))
	env.DeletePod(t, ns, "p1")
	// Its node cordoned, the claim's next pod has nowhere to go, and says why.
	env.cordon(t, home, true)
	if _, err := env.Cluster.Client.CoreV1().Pods(ns).Create(context.Background(), cluster.PodObject(ns, cluster.PodSpec{Name: "p2", Claims: []string{"c"}}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	msg := env.WaitEvent(t, ns, "Pod", "p2", "FailedScheduling", 60*time.Second)
	if !strings.Contains(msg, "didn't match PersistentVolume's node affinity") {
		t.Errorf("p2's FailedScheduling event does not name the volume's node affinity: %s", msg)
	}
	if p := env.GetPod(t, ns, "p2"); p.Spec.NodeName != "" {
		t.Fatalf("p2 scheduled to %s while its volume's node %s is cordoned", p.Spec.NodeName, home)
	}
	env.cordon(t, home, false)
	second := env.WaitRunning(t, ns, "p2")
	if second.Spec.NodeName != home {
		t.Fatalf("p2 on %s, its volume on %s", second.Spec.NodeName, home)
	}
	if got := sum(t, env, ns, "p2", "/data/blob"); got != blob {
		t.Fatalf("wrote %s, read %s", blob, got)
	}
	t.Logf("local volume on %s: Pending with %q while it was cordoned", home, msg)
}

// other is the name of the other node of the two.
func other(node string) string {
	if node == "node-a" {
		return "node-b"
	}
	return "node-a"
}

func lineCount(t testing.TB, env *kubeletEnv, ns, pod, path string) int {
	t.Helper()
	out, err := env.Exec(t, ns, pod, "wc -l < "+path)
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(out))
	return n
}

// checkSequence checks that the file holds the lines 0, 1, 2, ... and nothing else, and
// returns how many.
func checkSequence(t testing.TB, env *kubeletEnv, ns, pod, path string) int {
	t.Helper()
	out := env.MustExec(t, ns, pod, "cat "+path)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	for i, l := range lines {
		if l != strconv.Itoa(i) {
			t.Fatalf("%s line %d is %q, want %d (of %d lines)", path, i+1, l, i, len(lines))
		}
	}
	return len(lines)
}

func pvNodes(pv *corev1.PersistentVolume) []string {
	var out []string
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return nil
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range term.MatchExpressions {
			out = append(out, e.Values...)
		}
	}
	return out
}

// statefulSet creates a StatefulSet of one busybox pod running seqWriter, with one claim
// from class mounted at /data; node, if set, is where the pod must run.
func (e *kubeletEnv) statefulSet(t testing.TB, ns, name, class, node string) {
	t.Helper()
	one, grace := int32(1), int64(1)
	labels := map[string]string{"app": name}
	mode := corev1.PersistentVolumeFilesystem
	spec := cluster.PodObject(ns, cluster.PodSpec{Name: name, Node: node}).Spec
	spec.TerminationGracePeriodSeconds = &grace
	spec.Containers[0].Command = []string{"sh", "-c", seqWriter}
	spec.Containers[0].Env = []corev1.EnvVar{{Name: "NODE_NAME", ValueFrom: &corev1.EnvVarSource{
		FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}}}
	spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	sts := &appsv1.StatefulSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.StatefulSetSpec{
			Replicas: &one, ServiceName: name,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: spec},
			VolumeClaimTemplates: []corev1.PersistentVolumeClaim{{ObjectMeta: metav1.ObjectMeta{Name: "data"},
				Spec: corev1.PersistentVolumeClaimSpec{
					StorageClassName: &class, VolumeMode: &mode,
					AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
					Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("200Mi")}},
				}}},
		}}
	if _, err := e.Cluster.Client.AppsV1().StatefulSets(ns).Create(context.Background(), sts, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// scale sets a StatefulSet's replicas.
func (e *kubeletEnv) scale(t testing.TB, ns, name string, replicas int) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"replicas":%d}}`, replicas)
	if _, err := e.Cluster.Client.AppsV1().StatefulSets(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// cordon marks a node (un)schedulable, as kubectl cordon and uncordon do; a node cordoned
// is uncordoned when the test ends, whatever happened, for the tests after it.
func (e *kubeletEnv) cordon(t testing.TB, node string, on bool) {
	t.Helper()
	set := func(on bool) error {
		patch := fmt.Sprintf(`{"spec":{"unschedulable":%t}}`, on)
		_, err := e.Cluster.Client.CoreV1().Nodes().Patch(context.Background(), node, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{})
		return err
	}
	if err := set(on); err != nil {
		t.Fatal(err)
	}
	if on {
		t.Cleanup(func() {
			if err := set(false); err != nil {
				t.Errorf("uncordon %s: %v", node, err)
			}
		})
	}
}

// evict asks the Eviction API to move a pod off its node, as kubectl drain does.
func (e *kubeletEnv) evict(t testing.TB, ns, name string) {
	t.Helper()
	ev := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}
	if err := e.Cluster.Client.PolicyV1().Evictions(ns).Evict(context.Background(), ev); err != nil {
		t.Fatal(err)
	}
}

// taint adds (on) or removes a NoExecute taint of a node.
func (e *kubeletEnv) taint(t testing.TB, node, key, value string, on bool) {
	t.Helper()
	ctx := context.Background()
	cluster.WaitFor(t, 30*time.Second, "taint "+key+" on "+node, func() error {
		n, err := e.Cluster.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		var taints []corev1.Taint
		for _, tt := range n.Spec.Taints {
			if tt.Key != key {
				taints = append(taints, tt)
			}
		}
		if on {
			taints = append(taints, corev1.Taint{Key: key, Value: value, Effect: corev1.TaintEffectNoExecute})
		}
		n.Spec.Taints = taints
		_, err = e.Cluster.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
}

// waitNodeReady waits until the node's Ready condition is ready (true) or not.
func (e *kubeletEnv) waitNodeReady(t testing.TB, node string, ready bool, timeout time.Duration) {
	t.Helper()
	cluster.WaitFor(t, timeout, fmt.Sprintf("node %s Ready=%t", node, ready), func() error {
		n, err := e.Cluster.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady {
				if (c.Status == corev1.ConditionTrue) == ready {
					return nil
				}
				return fmt.Errorf("%s %s", c.Status, c.Reason)
			}
		}
		return fmt.Errorf("no Ready condition")
	})
}

// driverLog is the log of the shared driver's node plugin on node.
func (e *kubeletEnv) driverLog(t testing.TB, node string) string {
	t.Helper()
	return e.driverLogOf(t, node, false)
}

// driverLogOf is driverLog, or, previous, the log of the node plugin's container before
// its last restart.
func (e *kubeletEnv) driverLogOf(t testing.TB, node string, previous bool) string {
	t.Helper()
	p := e.nodePlugin(t, node)
	b, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: "poolcsi", Previous: previous}).DoRaw(context.Background())
	if err != nil {
		t.Fatalf("log of %s (previous %t): %v", p.Name, previous, err)
	}
	return string(b)
}

// nodePlugin is the shared driver's node plugin pod on node.
func (e *kubeletEnv) nodePlugin(t testing.TB, node string) *corev1.Pod {
	t.Helper()
	pods, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).List(context.Background(), metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/component=node", FieldSelector: "spec.nodeName=" + node})
	if err != nil || len(pods.Items) == 0 {
		t.Fatalf("the node plugin on %s: %v", node, err)
	}
	return &pods.Items[0]
}

// pluginStatus is the status of the shared driver's container ("poolcsi") of a node
// plugin pod.
func pluginStatus(p *corev1.Pod) (corev1.ContainerStatus, bool) {
	for _, st := range p.Status.ContainerStatuses {
		if st.Name == "poolcsi" {
			return st, true
		}
	}
	return corev1.ContainerStatus{}, false
}

// restartNodePlugin SIGKILLs the shared driver's node plugin on n and waits until kubelet
// (which must run) has started it again: a new container of the same pod.
func (e *kubeletEnv) restartNodePlugin(t testing.TB, n *cluster.Node) {
	t.Helper()
	p := e.nodePlugin(t, n.Name)
	before, ok := pluginStatus(p)
	if !ok || before.State.Running == nil {
		t.Fatalf("the node plugin on %s is not running: %s", n.Name, cluster.PodSummary(p))
	}
	n.KillContainer(t, strings.TrimPrefix(before.ContainerID, "containerd://"))
	cluster.WaitFor(t, 90*time.Second, "the node plugin on "+n.Name+" started again", func() error {
		p, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).Get(context.Background(), p.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		st, _ := pluginStatus(p)
		if st.ContainerID == before.ContainerID || st.State.Running == nil {
			if last := st.LastTerminationState.Terminated; last != nil && last.ContainerID != before.ContainerID {
				return fmt.Errorf("%s; its last container: %s (exit %d) %s", cluster.PodSummary(p), last.Reason, last.ExitCode, last.Message)
			}
			return fmt.Errorf("%s", cluster.PodSummary(p))
		}
		return nil
	})
}

// seqWriter is the StatefulSets' pods' command: once /data/writer names the pod's node,
// it appends the next numbers of /data/seq (0, 1, 2, ...), each line fsynced before the
// next, so that what is on the volume is a prefix of what the writer was told was written.
// A process an exec starts in the background does not outlive the exec (containerd kills
// what is left of it): the writer is the pod's own.
const seqWriter = `while [ "$(cat /data/writer 2>/dev/null)" != "$NODE_NAME" ]; do sleep 0.2; done
i=$(cat /data/seq 2>/dev/null | wc -l)
while :; do echo $i >> /data/seq && sync /data/seq; i=$((i+1)); done`

// outOfService is the non-graceful node shutdown taint (kubectl taint nodes NODE
// node.kubernetes.io/out-of-service=nodeshutdown:NoExecute).
const outOfService = "node.kubernetes.io/out-of-service"

// takeover is a pod of a StatefulSet, writing with seqWriter on one node, taken over by
// the other through the out-of-service taint after the first node failed.
type takeover struct {
	ns, pvName, handle string
	seen               string // /data/seq as the survivor found it
	sum                string // md5 of what the survivor wrote
	survivor           *corev1.Pod
}

// failAndTakeOver starts the writer on victim, fails victim with fail, waits until the node
// is NotReady, taints it out of service, and waits for the pod on survivor; there it
// reads what the victim left and writes its own data.
func (e *kubeletEnv) failAndTakeOver(t *testing.T, name string, victim, survivor *cluster.Node, fail func()) *takeover {
	t.Helper()
	ns := e.Namespace(t, name)
	e.cordon(t, survivor.Name, true)
	e.statefulSet(t, ns, "w", "shared-ext4", "")
	first := e.WaitPodOn(t, ns, "w-0", "", victim.Name)
	e.cordon(t, survivor.Name, false)
	tk := &takeover{ns: ns, pvName: e.PVC(t, ns, "data-w-0").Spec.VolumeName, handle: e.VolumeHandle(t, ns, "data-w-0")}
	e.MustExec(t, ns, "w-0", "echo "+victim.Name+" > /data/writer")
	cluster.WaitFor(t, 60*time.Second, "the writer's first 100 lines", func() error {
		if n := lineCount(t, e, ns, "w-0", "/data/seq"); n < 100 {
			return fmt.Errorf("%d lines", n)
		}
		return nil
	})
	start := time.Now()
	fail()
	e.waitNodeReady(t, victim.Name, false, 120*time.Second)
	notReady := time.Since(start)
	e.taint(t, victim.Name, outOfService, "nodeshutdown", true)
	tk.survivor = e.WaitPodOn(t, ns, "w-0", string(first.UID), survivor.Name)
	t.Logf("%s: %s NotReady %s after it failed; the pod Running on %s %s after that (taint, pod deleted, force-detach after the lease, attach, stage)",
		name, victim.Name, notReady.Round(time.Second), survivor.Name, (time.Since(start) - notReady).Round(time.Second))
	tk.seen = e.MustExec(t, ns, "w-0", "cat /data/seq")
	n := checkSequence(t, e, ns, "w-0", "/data/seq")
	t.Logf("%s: %d lines of the writer on %s found by %s", name, n, victim.Name, survivor.Name)
	// No pod of the test writes the sequence any more: what changes it from here on came
	// from the victim.
	tk.sum = strings.TrimSpace(e.MustExec(t, ns, "w-0", "echo nobody > /data/writer && dd if=/dev/urandom of=/data/survivor bs=1M count=4 2>/dev/null && sync && md5sum /data/survivor | cut -d' ' -f1"))
	return tk
}

// rejoined waits until victim, back, has nothing of the volume left (kubelet unpublished
// and unstaged what it held), then checks, from a fresh stage of the volume, that it holds
// exactly what the survivor found and wrote: nothing of the victim's came late.
func (e *kubeletEnv) rejoined(t *testing.T, tk *takeover, victim *cluster.Node) {
	t.Helper()
	e.taint(t, victim.Name, outOfService, "", false)
	e.waitNodeReady(t, victim.Name, true, 120*time.Second)
	// kubelet's global mount of a CSI volume is named by the SHA-256 of its handle.
	global := fmt.Sprintf("%x", sha256.Sum256([]byte(tk.handle)))
	cluster.WaitFor(t, 180*time.Second, "node "+victim.Name+" letting go of "+tk.pvName, func() error {
		var left []string
		for _, m := range victim.MountsUnder(cluster.KubeletDir) {
			if strings.Contains(m, tk.pvName) || strings.Contains(m, global) {
				left = append(left, m)
			}
		}
		if len(left) > 0 {
			return fmt.Errorf("still mounted: %v", left)
		}
		// The image's only loop device is the survivor's: the victim's, fenced or
		// not, went with its unstage.
		if devs := imageLoops(tk.handle); len(devs) != 1 {
			return fmt.Errorf("loop devices of the image: %v", devs)
		}
		return nil
	})
	// A fresh stage reads the volume from the pool, not from the survivor's page cache.
	e.scale(t, tk.ns, "w", 0)
	cluster.WaitFor(t, 120*time.Second, "the StatefulSet scaled to 0", func() error {
		pods, err := e.Cluster.Client.CoreV1().Pods(tk.ns).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(pods.Items) > 0 {
			return fmt.Errorf("%d pods", len(pods.Items))
		}
		return nil
	})
	e.scale(t, tk.ns, "w", 1)
	p := e.WaitPodOn(t, tk.ns, "w-0", string(tk.survivor.UID), "")
	if got := e.MustExec(t, tk.ns, "w-0", "cat /data/seq"); got != tk.seen {
		t.Errorf("/data/seq changed after %s took the volume over: %d bytes then, %d now (a late write of %s's)",
			tk.survivor.Spec.NodeName, len(tk.seen), len(got), victim.Name)
	}
	if got := sum(t, e, tk.ns, "w-0", "/data/survivor"); got != tk.sum {
		t.Errorf("the survivor's data: wrote %s, read %s", tk.sum, got)
	}
	t.Logf("%s back; the volume, staged again on %s, holds what %s found and wrote", victim.Name, p.Spec.NodeName, tk.survivor.Spec.NodeName)
}

// partitionTakeover: a pod writes on victim; victim is partitioned (kubelet frozen, its
// pods off the network, its pool gone) while its pod and driver keep running; it is
// tainted out of service; the pod comes up on survivor with the volume. The victim's
// driver fenced its loop device when its lease ran out, before the controller let the
// volume go; back, it lets go of its stale stage without writing anything.
func (e *kubeletEnv) partitionTakeover(t *testing.T, victim, survivor *cluster.Node) {
	var heal func()
	tk := e.failAndTakeOver(t, "partition", victim, survivor, func() { heal = victim.Partition(t, cluster.SharedPoolPath) })
	heal()
	e.rejoined(t, tk, victim)
	if log := e.driverLog(t, victim.Name); !strings.Contains(log, "Fencing this node off the pool") {
		t.Errorf("the node plugin on %s never fenced itself; its log ends:\n%s", victim.Name, cluster.Tail(log, 20))
	}
}

// lostPoolTakeover: as partitionTakeover, but victim's pool vanishes instead of being
// covered (Node.Vanish: a lazy unmount, on the node and in its node plugin's mount
// namespace; the pod's loop device keeps the image open under no path) and, with
// restart, its node plugin is then SIGKILLed and started again by kubelet, without the
// pool, before the partition stops kubelet: the plugin that fences is a new process,
// which knows its devices only from its node-local records. The node plugin that fenced
// must have fenced a device (before the node-local records, the fence found none and the
// writer wrote on). Healed, the pool is mounted on the node again (and the node plugin
// that lost its mount restarted, to see it).
func (e *kubeletEnv) lostPoolTakeover(t *testing.T, victim, survivor *cluster.Node, restart bool) {
	name := "vanish"
	if restart {
		name = "vanish-restart"
	}
	var healPool, healPartition func()
	tk := e.failAndTakeOver(t, name, victim, survivor, func() {
		healPool = victim.Vanish(t, cluster.SharedPoolPath)
		if restart {
			e.restartNodePlugin(t, victim)
		}
		healPartition = victim.Partition(t, "")
	})
	healPartition()
	healPool()
	if !restart {
		// Its container lost its mount of the pool for good; the one started while
		// the pool was gone (restart) gets it back with the node.
		e.restartNodePlugin(t, victim)
	}
	// The container that fenced: the one before the restart that healed, or the
	// one started while the pool was gone.
	log := e.driverLogOf(t, victim.Name, !restart)
	if !strings.Contains(log, "Fenced a loop device") {
		t.Errorf("%s: the node plugin on %s fenced no loop device; its log ends:\n%s", name, victim.Name, cluster.Tail(log, 20))
	}
	if strings.Contains(log, "FENCE FAILED CLOSED") {
		t.Errorf("%s: the node plugin on %s did not find its devices by its records (it failed closed); its log ends:\n%s", name, victim.Name, cluster.Tail(log, 20))
	}
	e.rejoined(t, tk, victim)
}

// powerOffTakeover: as partitionTakeover, but victim is powered off (kubelet, containerd,
// its pods and its driver killed at once, its mounts left as they were) and later powered
// on: its kubelet and a new driver find the stale stage and let go of it, and the volume
// that survivor took over gets nothing of the victim's.
//
// Beside it, a pod with a claim of victim's local pool: its volume cannot follow it, so
// once the taint has deleted it, its replacement is Pending, and says why, until victim is
// back, where it runs again on what it had written.
func (e *kubeletEnv) powerOffTakeover(t *testing.T, victim, survivor *cluster.Node) {
	local := e.Namespace(t, "poweroff-local")
	e.cordon(t, survivor.Name, true)
	e.statefulSet(t, local, "l", "local-xfs", "")
	first := e.WaitPodOn(t, local, "l-0", "", victim.Name)
	e.cordon(t, survivor.Name, false)
	e.MustExec(t, local, "l-0", "echo "+victim.Name+" > /data/writer")
	cluster.WaitFor(t, 60*time.Second, "the local writer's first 100 lines", func() error {
		if n := lineCount(t, e, local, "l-0", "/data/seq"); n < 100 {
			return fmt.Errorf("%d lines", n)
		}
		return nil
	})

	tk := e.failAndTakeOver(t, "poweroff", victim, survivor, func() { victim.PowerOff(t) })
	// The taint deleted the local pod too; its replacement has no node to go to.
	var replaced types.UID
	cluster.WaitFor(t, 60*time.Second, "the local pod replaced", func() error {
		p, err := e.Cluster.Client.CoreV1().Pods(local).Get(context.Background(), "l-0", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.UID == first.UID {
			return errors.New("still the pod of before the power-off")
		}
		replaced = p.UID
		return nil
	})
	// The replacement's own event: the first pod may have had one of its own (with the
	// central controller, node-b's capacity is 0 from the earlier tests' failures until the
	// provisioner's next poll).
	msg := e.WaitEventOf(t, local, "Pod", "l-0", string(replaced), "FailedScheduling", 60*time.Second)
	for _, want := range []string{"didn't match PersistentVolume's node affinity", "untolerated taint"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the local pod's FailedScheduling event does not say %q: %s", want, msg)
		}
	}
	if p := e.GetPod(t, local, "l-0"); p.Spec.NodeName != "" {
		t.Errorf("the local pod was scheduled to %s while its volume's node %s was off", p.Spec.NodeName, victim.Name)
	}
	t.Logf("poweroff: the local pod Pending while %s was off: %q", victim.Name, msg)

	victim.PowerOn(t)
	e.rejoined(t, tk, victim)
	e.WaitPodOn(t, local, "l-0", string(first.UID), victim.Name)
	n := checkSequence(t, e, local, "l-0", "/data/seq")
	t.Logf("poweroff: the local pod back on %s with its %d lines", victim.Name, n)
	// The old stage's device was fenced before anything of it could reach the image: by
	// the node plugin that came back, before its unmount (two machines), or, here, where
	// both nodes share one kernel, by the survivor's stage, which found the victim's
	// device attached to the image and would otherwise have reused it.
	victimLog, survivorLog := e.driverLog(t, victim.Name), e.driverLog(t, survivor.Name)
	if !strings.Contains(victimLog, "Fencing the loop device of a volume this node no longer holds") &&
		!strings.Contains(victimLog, "was attached on this node before this stage claimed it") &&
		!strings.Contains(survivorLog, "was attached on this node before this stage claimed it") {
		t.Errorf("nobody fenced the old stage's device; the log of the node plugin on %s ends:\n%s", victim.Name, cluster.Tail(victimLog, 20))
	}
}

// imageLoops lists the loop devices, fenced or not, whose backing file is the image of
// the volume with this handle (losetup -l: "NAME SIZELIMIT BACK-FILE").
func imageLoops(handle string) []string {
	m := handleRE.FindStringSubmatch(handle)
	if m == nil {
		return nil
	}
	out, _ := exec.Command("losetup", "-l", "-n", "-O", "NAME,SIZELIMIT,BACK-FILE").Output()
	var devs []string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, m[2]) {
			f := strings.Fields(line)
			devs = append(devs, f[0]+" (sizelimit "+f[1]+")")
		}
	}
	return devs
}
