package harness

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"

	"github.com/poolcsi/poolcsi/hack/release/chart"
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

// groupAcrossNodes: a VolumeGroupSnapshot of two local claims on two nodes ("a" of class
// local-xfs on nodeA, "b" of local-ext4 on nodeB) is taken at one instant across the nodes
// (docs/design/central-controller.md §7.1: every node holds its members frozen until all
// have answered, then each copies its part). The two pods play ping-pong through a host
// directory both nodes see: a appends an odd n to its log only after b's log ends at n-1,
// and b appends an even n only after a's ends at n-1. At any one instant the two logs end
// one apart; snapshots of the two taken at different instants end further apart, or b's
// ahead of what a had written when it answered.
func groupAcrossNodes(t *testing.T, env *kubeletEnv, nodeA, nodeB string) {
	ctx := context.Background()
	ns := env.Namespace(t, "group-across")
	// Not t.TempDir: the players write into it until their pods are gone, which the
	// cleanup below waits for before it removes the directory.
	chanDir, err := os.MkdirTemp("", "pingpong-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, name := range []string{"a", "b"} {
			stopPod(env, ns, name)
		}
		if err := os.RemoveAll(chanDir); err != nil {
			t.Errorf("remove the players' directory: %v", err)
		}
	})
	players := []struct{ name, class, node, script string }{
		// Each waits (polling a shell builtin, no process per turn) for the other's turn,
		// appends its n to its own volume's log, then publishes n in the shared directory.
		{"a", "local-xfs", nodeA, `n=1; while :; do echo $n >> /data/log; echo $n > /chan/a.tmp; mv /chan/a.tmp /chan/a; ` +
			`while :; do { read m < /chan/b; } 2>/dev/null; [ "$m" = $((n+1)) ] && break; usleep 500; done; n=$((n+2)); done`},
		{"b", "local-ext4", nodeB, `n=2; while :; do while :; do { read m < /chan/a; } 2>/dev/null; [ "$m" = $((n-1)) ] && break; usleep 500; done; ` +
			`echo $n >> /data/log; echo $n > /chan/b.tmp; mv /chan/b.tmp /chan/b; n=$((n+2)); done`},
	}
	// The scheduler places a WaitForFirstConsumer claim by the capacity the central
	// provisioner publishes per node: on a cluster just started it may not have
	// published a node's yet.
	for _, p := range players {
		waitLocalCapacity(t, env, p.class, p.node, 300<<20)
	}
	for _, p := range players {
		pvc := cluster.ClaimObject(ns, cluster.ClaimSpec{Name: p.name, Class: p.class, Size: "300Mi"})
		pvc.Labels = map[string]string{"app": "pingpong"}
		if _, err := env.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pod := cluster.PodObject(ns, cluster.PodSpec{Name: p.name, Claims: []string{p.name}, Node: p.node})
		dir := corev1.HostPathDirectory
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "chan", VolumeSource: corev1.VolumeSource{
			HostPath: &corev1.HostPathVolumeSource{Path: chanDir, Type: &dir}}})
		c := &pod.Spec.Containers[0]
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "chan", MountPath: "/chan"})
		c.Command = []string{"sh", "-c", p.script}
		if _, err := env.Cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range players {
		env.WaitRunning(t, ns, p.name)
	}
	cluster.WaitFor(t, 60*time.Second, "the players' first 200 turns", func() error {
		out, err := env.Exec(t, ns, "b", "tail -n1 /data/log")
		if err != nil {
			return err
		}
		if n, _ := strconv.Atoi(strings.TrimSpace(out)); n < 200 {
			return fmt.Errorf("b's log ends at %q", out)
		}
		return nil
	})
	vgs := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshot",
		"metadata": map[string]any{"name": "pingpong", "namespace": ns},
		"spec": map[string]any{"volumeGroupSnapshotClassName": "poolcsi-local-group",
			"source": map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "pingpong"}}}}}}
	if err := env.Cluster.Applier().Apply(ctx, vgs, false); err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(env.Cluster.Config)
	var uid string
	cluster.WaitFor(t, 3*time.Minute, "VolumeGroupSnapshot "+ns+"/pingpong ready", func() error {
		got, err := dyn.Resource(vgsGVR).Namespace(ns).Get(ctx, "pingpong", metav1.GetOptions{})
		if err != nil {
			return err
		}
		uid = string(got.GetUID())
		if ready, _, _ := unstructured.NestedBool(got.Object, "status", "readyToUse"); !ready {
			st, _, _ := unstructured.NestedMap(got.Object, "status")
			return fmt.Errorf("status %v; events: %s", st, env.Events(ns, "pingpong"))
		}
		return nil
	})
	// The players stop: the checks below read the restored claims only.
	for _, p := range players {
		stopPod(env, ns, p.name)
	}
	// Each member restores on the node that holds it.
	last := map[string]int{}
	for _, p := range players {
		member := fmt.Sprintf("snapshot-%x", sha256.Sum256([]byte(uid+env.VolumeHandle(t, ns, p.name))))
		env.Claim(t, ns, cluster.ClaimSpec{Name: p.name + "-restored", Class: p.class, Size: "300Mi", DataSource: member})
		env.Pod(t, ns, cluster.PodSpec{Name: p.name + "-check", Claims: []string{p.name + "-restored"}, Node: p.node})
		out := env.MustExec(t, ns, p.name+"-check", "tail -c 64 /data/log | tail -n1; tail -c1 /data/log | od -An -c")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 2 || strings.TrimSpace(lines[1]) != `\n` {
			t.Fatalf("%s's restored log does not end with a whole line: %q", p.name, out)
		}
		n, err := strconv.Atoi(strings.TrimSpace(lines[0]))
		if err != nil {
			t.Fatalf("%s's restored log: last line %q", p.name, lines[0])
		}
		last[p.name] = n
	}
	t.Logf("restored: a's log (on %s) ends at %d, b's (on %s) at %d", nodeA, last["a"], nodeB, last["b"])
	if d := last["a"] - last["b"]; d != 1 && d != -1 {
		t.Fatalf("the restored pair is no single instant across the nodes: a ends at %d, b at %d (want them one apart)", last["a"], last["b"])
	}
}

// stopPod deletes a pod, if it is there, and waits up to a minute for it to be gone.
func stopPod(env *kubeletEnv, ns, name string) {
	ctx := context.Background()
	pods := env.Cluster.Client.CoreV1().Pods(ns)
	if err := pods.Delete(ctx, name, metav1.DeleteOptions{}); apierrors.IsNotFound(err) {
		return
	}
	_ = wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := pods.Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
}

// waitLocalCapacity waits until a CSIStorageCapacity of class for node (a topology
// label whose value is the node's name) says at least bytes are free; if none does in
// time, it fails with the node's PoolNode and its local node plugin's last log lines.
func waitLocalCapacity(t *testing.T, env *kubeletEnv, class, node string, bytes int64) {
	t.Helper()
	ctx := context.Background()
	var seen []string
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := env.Cluster.Client.StorageV1().CSIStorageCapacities("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		seen = nil
		for _, c := range list.Items {
			if c.StorageClassName != class || c.NodeTopology == nil || c.Capacity == nil {
				continue
			}
			for _, v := range c.NodeTopology.MatchLabels {
				if v == node {
					if c.Capacity.Value() >= bytes {
						return true, nil
					}
					seen = append(seen, c.Capacity.String())
				}
			}
		}
		return false, nil
	})
	if err == nil {
		return
	}
	pn, perr := dynamic.NewForConfigOrDie(env.Cluster.Config).Resource(poolNodeGVR).Namespace(chart.Namespace).Get(ctx, node, metav1.GetOptions{})
	status := fmt.Sprint(perr)
	if perr == nil {
		st, _, _ := unstructured.NestedMap(pn.Object, "status")
		status = fmt.Sprint(st)
	}
	logs := "(no log)"
	for _, c := range []string{"poolcsi-local", "poolcsi"} {
		p := env.nodePlugin(t, node)
		tail := int64(40)
		if b, err := env.Cluster.Client.CoreV1().Pods(chart.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: c, TailLines: &tail}).DoRaw(ctx); err == nil {
			logs = c + ":\n" + string(b)
			break
		}
	}
	t.Fatalf("no capacity of class %s published for %s after 3m (published: %v); its PoolNode's status: %s; %s", class, node, seen, status, logs)
}
