package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// kubeletEnv is the environment of cluster.StartEnv with the scenarios' own helpers.
type kubeletEnv struct{ *cluster.Env }

// startKubeletEnv brings up the control plane, a real node and the chart, rendered with
// image overrides only and applied as it is; it returns once both drivers are registered
// with kubelet.
func startKubeletEnv(t testing.TB) *kubeletEnv {
	t.Helper()
	return startKubeletEnvWith(t, nil, nil)
}

// startKubeletEnvWith is startKubeletEnv with more images to import and chart values set
// beside the image overrides (top-level keys).
func startKubeletEnvWith(t testing.TB, extra func(testing.TB) []cluster.Image, values map[string]any) *kubeletEnv {
	t.Helper()
	return startEnv(t, cluster.EnvOptions{Extra: extra, Values: values})
}

// startEnv is startKubeletEnv with options.
func startEnv(t testing.TB, opts cluster.EnvOptions) *kubeletEnv {
	t.Helper()
	return &kubeletEnv{cluster.StartEnv(t, opts)}
}

// storageClasses are what a user of the chart writes: one per filesystem for the local
// driver, dir and image layouts for the shared one.
func (e *kubeletEnv) storageClasses(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	wffc, immediate := storagev1.VolumeBindingWaitForFirstConsumer, storagev1.VolumeBindingImmediate
	expand, del := true, corev1.PersistentVolumeReclaimDelete
	for _, sc := range []storagev1.StorageClass{
		{ObjectMeta: metav1.ObjectMeta{Name: "local-xfs"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-btrfs"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "btrfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-ext4"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "ext4"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-immediate"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-dir"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "dir"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "share-bind"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"shareType": "bind", "shareSource": cluster.ShareSource, "layout": "dir"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-xfs"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-ext4"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "image", "csi.storage.k8s.io/fstype": "ext4"}},
	} {
		sc.AllowVolumeExpansion, sc.ReclaimPolicy = &expand, &del
		if _, err := e.Cluster.Client.StorageV1().StorageClasses().Create(ctx, &sc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	vsc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
		"metadata": map[string]any{"name": "shared"}, "driver": cluster.SharedDriver, "deletionPolicy": "Delete"}}
	if err := e.Cluster.Applier().Apply(ctx, vsc, false); err != nil {
		t.Fatal(err)
	}
}

type claimSpec struct {
	name, class, size string
	block, rwx        bool
	dataSource        string // a VolumeSnapshot to restore
	clone             string // a claim to clone
	rox               bool   // ReadOnlyMany
}

func (e *kubeletEnv) claim(t testing.TB, ns string, c claimSpec) {
	t.Helper()
	if _, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), claimObject(ns, c), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func claimObject(ns string, c claimSpec) *corev1.PersistentVolumeClaim {
	mode := corev1.PersistentVolumeFilesystem
	if c.block {
		mode = corev1.PersistentVolumeBlock
	}
	access := corev1.ReadWriteOnce
	if c.rwx {
		access = corev1.ReadWriteMany
	}
	if c.rox {
		access = corev1.ReadOnlyMany
	}
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: c.name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &c.class, VolumeMode: &mode,
			AccessModes: []corev1.PersistentVolumeAccessMode{access},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(c.size)}},
		}}
	if c.clone != "" {
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: c.clone}
	}
	if c.dataSource != "" {
		group := "snapshot.storage.k8s.io"
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: c.dataSource}
	}
	return pvc
}

type podSpec struct {
	name     string
	claims   []string // mounted at /data, /data2...; block claims appear at /dev/xvda...
	block    bool
	readOnly bool
	hostPath string // a hostPath volume at /data instead
	node     string // the node it must run on (its kubernetes.io/hostname)
}

// pod runs busybox sleeping, with the claims, and waits until it is Running.
func (e *kubeletEnv) pod(t testing.TB, ns string, p podSpec) *corev1.Pod {
	t.Helper()
	if _, err := e.Cluster.Client.CoreV1().Pods(ns).Create(context.Background(), podObject(ns, p), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return e.waitRunning(t, ns, p.name)
}

func podObject(ns string, p podSpec) *corev1.Pod {
	grace := int64(1)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: ns},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "c", Image: cluster.BusyboxRef, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sleep", "100000"}}},
		}}
	if p.node != "" {
		pod.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": p.node}
	}
	c := &pod.Spec.Containers[0]
	if p.hostPath != "" {
		dirOrCreate := corev1.HostPathDirectoryOrCreate
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "h", VolumeSource: corev1.VolumeSource{
			HostPath: &corev1.HostPathVolumeSource{Path: p.hostPath, Type: &dirOrCreate}}})
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "h", MountPath: "/data"})
	}
	for i, cl := range p.claims {
		vol := fmt.Sprintf("v%d", i)
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: vol, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: cl, ReadOnly: p.readOnly}}})
		if p.block {
			c.VolumeDevices = append(c.VolumeDevices, corev1.VolumeDevice{Name: vol, DevicePath: fmt.Sprintf("/dev/xvd%c", 'a'+i)})
			continue
		}
		path := "/data"
		if i > 0 {
			path = fmt.Sprintf("/data%d", i+1)
		}
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: vol, MountPath: path, ReadOnly: p.readOnly})
	}
	return pod
}

func (e *kubeletEnv) waitRunning(t testing.TB, ns, name string) *corev1.Pod {
	t.Helper()
	return e.waitPodOn(t, ns, name, "", "")
}

func (e *kubeletEnv) pvc(t testing.TB, ns, name string) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

// resize asks for a bigger claim.
func (e *kubeletEnv) resize(t testing.TB, ns, name, size string) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size)
	if _, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitCapacity waits for the claim's status.capacity to reach size.
func (e *kubeletEnv) waitCapacity(t testing.TB, ns, name, size string, timeout time.Duration) {
	t.Helper()
	want := resource.MustParse(size)
	cluster.WaitFor(t, timeout, "claim "+ns+"/"+name+" status.capacity "+size, func() error {
		pvc := e.pvc(t, ns, name)
		got := pvc.Status.Capacity[corev1.ResourceStorage]
		if got.Cmp(want) < 0 {
			return fmt.Errorf("capacity %s, conditions %+v", got.String(), pvc.Status.Conditions)
		}
		return nil
	})
}

// dfBytes is the size in bytes of the filesystem at path in the pod.
func (e *kubeletEnv) dfBytes(t testing.TB, ns, pod, path string) int64 {
	t.Helper()
	out := e.MustExec(t, ns, pod, "df -k "+path+" | tail -1")
	f := strings.Fields(out)
	if len(f) < 2 {
		t.Fatalf("df -k %s: %q", path, out)
	}
	kb, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		t.Fatalf("df -k %s: %q", path, out)
	}
	return kb << 10
}

// kubeletMetrics reads kubelet's /metrics through the API server's node proxy.
func (e *kubeletEnv) kubeletMetrics(t testing.TB) string {
	t.Helper()
	b, err := e.Cluster.Client.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes/" + e.Node.Name + "/proxy/metrics").DoRaw(context.Background())
	if err != nil {
		t.Fatalf("kubelet /metrics: %v", err)
	}
	return string(b)
}

// volumeMetric returns a kubelet_volume_stats_* sample for a claim, or false.
func volumeMetric(metrics, name, ns, claim string) (float64, bool) {
	for _, line := range strings.Split(metrics, "\n") {
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		if !strings.Contains(line, `namespace="`+ns+`"`) || !strings.Contains(line, `persistentvolumeclaim="`+claim+`"`) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, false
		}
		return v, true
	}
	return 0, false
}

const writeBlob = "dd if=/dev/urandom of=/data/blob bs=1M count=4 2>/dev/null && sync && md5sum /data/blob | cut -d' ' -f1"

// blobPod creates the namespace name with the claims, starts pod "p" with them all (the
// first at /data) and writes writeBlob there: how the cases that check data survive
// something begin. It returns the namespace and the blob's md5 sum.
func (e *kubeletEnv) blobPod(t testing.TB, name string, claims ...claimSpec) (ns, written string) {
	t.Helper()
	ns = e.Namespace(t, name)
	var names []string
	for _, c := range claims {
		e.claim(t, ns, c)
		names = append(names, c.name)
	}
	e.pod(t, ns, podSpec{name: "p", claims: names})
	return ns, strings.TrimSpace(e.MustExec(t, ns, "p", writeBlob))
}

// TestKubelet drives poolcsi through a real kubelet, with the chart running as pods.
func TestKubelet(t *testing.T) {
	// Local snapshots on (the chart's opt-in snapshots.local; the environment's
	// snapshot-controller is distributed): the local group snapshot case needs them.
	env := startKubeletEnvWith(t, nil, map[string]any{"snapshots": map[string]any{"enabled": true, "local": true}})
	env.storageClasses(t)

	// Both driver names of the chart: data written in one pod is there, bit for bit, in
	// the next one.
	for _, tc := range []struct{ driver, class string }{{cluster.LocalDriver, "local-xfs"}, {cluster.SharedDriver, "shared-dir"}} {
		t.Run("data survives the pod/"+tc.driver, func(t *testing.T) {
			ns := env.Namespace(t, "data-"+tc.class)
			env.claim(t, ns, claimSpec{name: "c", class: tc.class, size: "300Mi"})
			env.pod(t, ns, podSpec{name: "writer", claims: []string{"c"}})
			sum := strings.TrimSpace(env.MustExec(t, ns, "writer", writeBlob))
			env.DeletePod(t, ns, "writer")
			env.pod(t, ns, podSpec{name: "reader", claims: []string{"c"}})
			if got := strings.TrimSpace(env.MustExec(t, ns, "reader", "md5sum /data/blob | cut -d' ' -f1")); got != sum {
				t.Fatalf("data changed between pods: wrote %s, read %s", sum, got)
			}
		})
	}
	kubeletCases(t, env)
	kubeletFeatures(t, env)
}

// volumeHandle returns the CSI volume handle of a bound claim.
func (e *kubeletEnv) volumeHandle(t testing.TB, ns, claim string) string {
	t.Helper()
	var handle string
	cluster.WaitFor(t, 60*time.Second, "claim "+ns+"/"+claim+" bound", func() error {
		pvc := e.pvc(t, ns, claim)
		if pvc.Spec.VolumeName == "" {
			return fmt.Errorf("not bound")
		}
		pv, err := e.Cluster.Client.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		handle = pv.Spec.CSI.VolumeHandle
		return nil
	})
	return handle
}

// imagePath is the backing image of an image volume in a pool on this machine.
func imagePath(t testing.TB, poolPath, handle string) string {
	t.Helper()
	m := handleRE.FindStringSubmatch(handle)
	if m == nil {
		t.Fatalf("volume handle %q", handle)
	}
	hits, _ := filepath.Glob(filepath.Join(poolPath, "volumes", "*"+m[2]+"*", "disk.img"))
	if len(hits) != 1 {
		t.Fatalf("image of %s in %s: %v", handle, poolPath, hits)
	}
	return hits[0]
}

// waitMetric waits until kubelet exports want for the claim.
func (e *kubeletEnv) waitMetric(t testing.TB, name, ns, claim string, timeout time.Duration, ok func(float64) bool) float64 {
	t.Helper()
	var v float64
	cluster.WaitFor(t, timeout, name+" of "+ns+"/"+claim, func() error {
		var found bool
		v, found = volumeMetric(e.kubeletMetrics(t), name, ns, claim)
		if !found {
			return fmt.Errorf("not exported")
		}
		if !ok(v) {
			return fmt.Errorf("value %v", v)
		}
		return nil
	})
	return v
}

// waitEvent waits for an event of that reason on the object (kind, name).
func (e *kubeletEnv) waitEvent(t testing.TB, ns, kind, name, reason string, timeout time.Duration) string {
	t.Helper()
	var msg string
	cluster.WaitFor(t, timeout, reason+" event on "+kind+" "+ns+"/"+name, func() error {
		evs, err := e.Cluster.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{
			FieldSelector: "involvedObject.kind=" + kind + ",involvedObject.name=" + name})
		if err != nil {
			return err
		}
		for _, ev := range evs.Items {
			if ev.Reason == reason {
				msg = ev.Type + ": " + ev.Message
				return nil
			}
		}
		return fmt.Errorf("none among %d events", len(evs.Items))
	})
	return msg
}

func sum(t testing.TB, env *kubeletEnv, ns, pod, path string) string {
	t.Helper()
	return strings.TrimSpace(env.MustExec(t, ns, pod, "md5sum "+path+" | cut -d' ' -f1"))
}

// nodePodName is the node DaemonSet's pod that is not being deleted.
func (e *kubeletEnv) nodePodName(t testing.TB) (string, error) {
	t.Helper()
	pods, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=node"})
	if err != nil {
		return "", err
	}
	var names []string
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			names = append(names, p.Name)
		}
	}
	if len(names) != 1 {
		return "", fmt.Errorf("node pods %v", names)
	}
	return names[0], nil
}

// restartNodePod deletes the node DaemonSet's pod and waits until its replacement serves.
func (e *kubeletEnv) restartNodePod(t testing.TB) {
	t.Helper()
	old, err := e.nodePodName(t)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).Delete(context.Background(), old, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster.WaitFor(t, 120*time.Second, "a new node pod", func() error {
		n, err := e.nodePodName(t)
		if err == nil && n == old {
			return fmt.Errorf("still %s", n)
		}
		return err
	})
	e.WaitChartReady(t)
}

// kubeletCases are the rest of the kubelet issue's cases, on the environment of TestKubelet.
func kubeletCases(t *testing.T, env *kubeletEnv) {
	ctx := context.Background()

	t.Run("RWX dir volume in two pods", func(t *testing.T) {
		ns := env.Namespace(t, "rwx")
		env.claim(t, ns, claimSpec{name: "c", class: "shared-dir", size: "100Mi", rwx: true})
		env.pod(t, ns, podSpec{name: "a", claims: []string{"c"}})
		env.pod(t, ns, podSpec{name: "b", claims: []string{"c"}})
		env.MustExec(t, ns, "a", "echo from-a > /data/a")
		env.MustExec(t, ns, "b", "echo from-b > /data/b")
		if got := env.MustExec(t, ns, "b", "cat /data/a") + env.MustExec(t, ns, "a", "cat /data/b"); got != "from-a\nfrom-b\n" {
			t.Fatalf("the two pods do not see each other's writes: %q", got)
		}
	})

	t.Run("local claim of an Immediate class", func(t *testing.T) {
		// No pod yet: a node's provisioner takes the claim (csi-provisioner's distributed
		// immediate binding, after a random wait of up to its 20 s base delay), and the pod
		// then goes where the volume is.
		ns := env.Namespace(t, "immediate")
		env.claim(t, ns, claimSpec{name: "c", class: "local-immediate", size: "300Mi"})
		cluster.WaitFor(t, 2*time.Minute, "claim "+ns+"/c of an Immediate local class bound without a pod", func() error {
			if pvc := env.pvc(t, ns, "c"); pvc.Status.Phase != corev1.ClaimBound {
				return fmt.Errorf("phase %s; events: %s", pvc.Status.Phase, env.Events(ns, "c"))
			}
			return nil
		})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"c"}})
		if got := env.MustExec(t, ns, "p", "echo ok > /data/x && cat /data/x"); got != "ok\n" {
			t.Fatalf("read back %q", got)
		}
	})

	t.Run("read-only pod mount", func(t *testing.T) {
		ns := env.Namespace(t, "readonly")
		env.claim(t, ns, claimSpec{name: "c", class: "local-xfs", size: "300Mi"})
		env.pod(t, ns, podSpec{name: "w", claims: []string{"c"}})
		want := strings.TrimSpace(env.MustExec(t, ns, "w", writeBlob))
		env.DeletePod(t, ns, "w")
		env.pod(t, ns, podSpec{name: "r", claims: []string{"c"}, readOnly: true})
		if got := sum(t, env, ns, "r", "/data/blob"); got != want {
			t.Fatalf("read-only pod reads %s, wrote %s", got, want)
		}
		if out, err := env.Exec(t, ns, "r", "touch /data/x"); err == nil || !strings.Contains(err.Error()+out, "Read-only file system") {
			t.Fatalf("a write in a read-only pod mount: err %v, output %q", err, out)
		}
	})

	t.Run("block claim through volumeDevices", func(t *testing.T) {
		ns := env.Namespace(t, "block")
		env.claim(t, ns, claimSpec{name: "c", class: "local-xfs", size: "64Mi", block: true})
		env.pod(t, ns, podSpec{name: "w", claims: []string{"c"}, block: true})
		size := strings.TrimSpace(env.MustExec(t, ns, "w", "blockdev --getsize64 /dev/xvda"))
		if size != strconv.Itoa(64<<20) {
			t.Fatalf("block device of a 64Mi claim is %s bytes", size)
		}
		want := strings.TrimSpace(env.MustExec(t, ns, "w", "dd if=/dev/urandom of=/tmp/b bs=1M count=8 2>/dev/null && dd if=/tmp/b of=/dev/xvda bs=1M conv=fsync 2>/dev/null && md5sum /tmp/b | cut -d' ' -f1"))
		env.DeletePod(t, ns, "w")
		env.pod(t, ns, podSpec{name: "r", claims: []string{"c"}, block: true})
		if got := strings.TrimSpace(env.MustExec(t, ns, "r", "dd if=/dev/xvda bs=1M count=8 2>/dev/null | md5sum | cut -d' ' -f1")); got != want {
			t.Fatalf("block data: wrote %s, read %s", want, got)
		}
	})

	t.Run("kubelet_volume_stats", func(t *testing.T) {
		ns := env.Namespace(t, "stats")
		env.claim(t, ns, claimSpec{name: "img", class: "local-xfs", size: "300Mi"})
		env.claim(t, ns, claimSpec{name: "dir", class: "shared-dir", size: "100Mi"})
		env.claim(t, ns, claimSpec{name: "blk", class: "local-xfs", size: "64Mi", block: true})
		env.pod(t, ns, podSpec{name: "fs", claims: []string{"img", "dir"}})
		env.pod(t, ns, podSpec{name: "bd", claims: []string{"blk"}, block: true})
		env.MustExec(t, ns, "fs", "dd if=/dev/zero of=/data/f bs=1M count=20 && dd if=/dev/zero of=/data2/f bs=1M count=10 && sync")
		for _, c := range []struct{ claim, path string }{{"img", "/data"}, {"dir", "/data2"}} {
			df := env.dfBytes(t, ns, "fs", c.path)
			got := env.waitMetric(t, "kubelet_volume_stats_capacity_bytes", ns, c.claim, 90*time.Second, func(v float64) bool { return v > 0 })
			// df in the pod shows a btrfs dir volume's whole pool: statfs knows no qgroups.
			if c.claim == "img" && int64(got) != df {
				t.Errorf("%s: kubelet_volume_stats_capacity_bytes %v, df in the pod %d", c.claim, got, df)
			}
			used := env.waitMetric(t, "kubelet_volume_stats_used_bytes", ns, c.claim, 60*time.Second, func(v float64) bool { return v >= 10<<20 })
			t.Logf("%s: capacity %v bytes (df %d), used %v", c.claim, got, df, used)
		}
		// A dir volume's numbers are its quota's, not the pool filesystem's.
		if got, _ := volumeMetric(env.kubeletMetrics(t), "kubelet_volume_stats_capacity_bytes", ns, "dir"); got != 100<<20 {
			t.Errorf("dir: kubelet_volume_stats_capacity_bytes %v, want the claim's 100Mi", got)
		}
		got := env.waitMetric(t, "kubelet_volume_stats_capacity_bytes", ns, "blk", 90*time.Second, func(v float64) bool { return v > 0 })
		if got != 64<<20 {
			t.Errorf("blk: kubelet_volume_stats_capacity_bytes %v, want %d", got, 64<<20)
		}
	})

	for _, fs := range []string{"xfs", "btrfs"} {
		t.Run("online expansion/"+fs, func(t *testing.T) {
			ns, want := env.blobPod(t, "grow-"+fs, claimSpec{name: "c", class: "local-" + fs, size: "300Mi"})
			before := env.dfBytes(t, ns, "p", "/data")
			env.resize(t, ns, "c", "600Mi")
			env.waitCapacity(t, ns, "c", "600Mi", 150*time.Second)
			cluster.WaitFor(t, 60*time.Second, "the pod's filesystem grown", func() error {
				if after := env.dfBytes(t, ns, "p", "/data"); after < before+250<<20 {
					return fmt.Errorf("df %d bytes, was %d", after, before)
				}
				return nil
			})
			if got := sum(t, env, ns, "p", "/data/blob"); got != want {
				t.Fatalf("data after growth: %s, wrote %s", got, want)
			}
		})
	}

	// Offline: the claim grows while no pod uses it, and the filesystem grows at the next
	// stage, before it is mounted (e2fsck + resize2fs). The shared driver's controller grows
	// the image at once; the local driver (--expand-on-node) grows its image only in
	// NodeExpandVolume, which kubelet calls with the filesystem mounted, so a local ext4
	// claim always grows online, which needs CAP_SYS_RESOURCE (production nodes have it,
	// this machine does not: docs/testing.md).
	t.Run("offline expansion/ext4", func(t *testing.T) {
		ns, want := env.blobPod(t, "grow-ext4", claimSpec{name: "c", class: "shared-ext4", size: "200Mi"})
		before := env.dfBytes(t, ns, "p", "/data")
		env.DeletePod(t, ns, "p")
		env.resize(t, ns, "c", "400Mi")
		// The resizer grows the volume and leaves the filesystem to the next mount.
		cluster.WaitFor(t, 120*time.Second, "the claim waiting for a pod to finish its growth", func() error {
			pvc := env.pvc(t, ns, "c")
			for _, c := range pvc.Status.Conditions {
				if c.Type == corev1.PersistentVolumeClaimFileSystemResizePending {
					return nil
				}
			}
			return fmt.Errorf("conditions %+v, capacity %v", pvc.Status.Conditions, pvc.Status.Capacity)
		})
		env.pod(t, ns, podSpec{name: "q", claims: []string{"c"}})
		env.waitCapacity(t, ns, "c", "400Mi", 120*time.Second)
		if after := env.dfBytes(t, ns, "q", "/data"); after < before+150<<20 {
			t.Fatalf("df in the new pod %d bytes, before %d", after, before)
		}
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("data after growth: %s, wrote %s", got, want)
		}
	})

	t.Run("driver pod restarted under a running pod", func(t *testing.T) {
		ns, want := env.blobPod(t, "driver-restart", claimSpec{name: "c", class: "local-xfs", size: "300Mi"},
			claimSpec{name: "d", class: "shared-dir", size: "100Mi"})
		env.restartNodePod(t)
		if got := sum(t, env, ns, "p", "/data/blob"); got != want {
			t.Fatalf("after the driver restart the pod reads %s, wrote %s", got, want)
		}
		env.MustExec(t, ns, "p", "echo after > /data/after && echo after > /data2/after && sync")
		env.DeletePod(t, ns, "p")
		env.pod(t, ns, podSpec{name: "q", claims: []string{"c", "d"}})
		if got := env.MustExec(t, ns, "q", "cat /data/after /data2/after"); got != "after\nafter\n" {
			t.Fatalf("writes after the restart: %q", got)
		}
	})

	t.Run("kubelet restarted under a running pod", func(t *testing.T) {
		ns, want := env.blobPod(t, "kubelet-restart", claimSpec{name: "c", class: "local-xfs", size: "300Mi"})
		env.Node.RestartKubelet(t)
		time.Sleep(5 * time.Second)
		env.waitRunning(t, ns, "p")
		if got := sum(t, env, ns, "p", "/data/blob"); got != want {
			t.Fatalf("after the kubelet restart the pod reads %s, wrote %s", got, want)
		}
		env.DeletePod(t, ns, "p")
		env.pod(t, ns, podSpec{name: "q", claims: []string{"c"}})
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("next pod reads %s, wrote %s", got, want)
		}
	})

	t.Run("snapshot restored into a new claim", func(t *testing.T) {
		ns, want := env.blobPod(t, "snapshot", claimSpec{name: "src", class: "shared-xfs", size: "300Mi"})
		snap := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
			"metadata": map[string]any{"name": "snap", "namespace": ns},
			"spec":     map[string]any{"volumeSnapshotClassName": "shared", "source": map[string]any{"persistentVolumeClaimName": "src"}}}}
		if err := env.Cluster.Applier().Apply(ctx, snap, false); err != nil {
			t.Fatal(err)
		}
		env.claim(t, ns, claimSpec{name: "restored", class: "shared-xfs", size: "300Mi", dataSource: "snap"})
		env.pod(t, ns, podSpec{name: "q", claims: []string{"restored"}})
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("restored claim reads %s, source had %s", got, want)
		}
	})

	t.Run("volume health reaches kubelet and the claim", func(t *testing.T) {
		ns := env.Namespace(t, "health")
		env.claim(t, ns, claimSpec{name: "c", class: "shared-xfs", size: "300Mi"})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"c"}})
		handle := env.volumeHandle(t, ns, "c")
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })

		// Filled past the 90 % threshold: abnormal for kubelet, a Warning on the pod.
		out := env.MustExec(t, ns, "p", "set -e; s=$(df -k /data | tail -1); total=$(echo $s | cut -d' ' -f2); used=$(echo $s | cut -d' ' -f3); "+
			"n=$(( (total*93/100 - used) / 1024 )); dd if=/dev/zero of=/data/fill bs=1M count=$n 2>&1 | tail -1; sync; df -k /data | tail -1")
		t.Logf("filled: %s", strings.TrimSpace(out))
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 1 })
		t.Logf("pod event: %s", env.waitEvent(t, ns, "Pod", "p", "VolumeConditionAbnormal", 60*time.Second))
		env.MustExec(t, ns, "p", "rm /data/fill && sync")
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })

		// The backing image cut short on the pool: the controller sees it and puts an event
		// on the claim; the node too. Grown back: normal again.
		img := imagePath(t, cluster.SharedPoolPath, handle)
		st, err := os.Stat(img)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(img, st.Size()-(1<<20)); err != nil {
			t.Fatal(err)
		}
		t.Logf("claim event: %s", env.waitEvent(t, ns, "PersistentVolumeClaim", "c", "VolumeConditionAbnormal", 150*time.Second))
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 1 })
		if err := os.Truncate(img, st.Size()); err != nil {
			t.Fatal(err)
		}
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })
	})

	t.Run("StorageClass naming a share", func(t *testing.T) {
		// No pool is configured for the share source: the controller mounts it, lays out a pool
		// there at the first CreateVolume, and the node plugin mounts it on demand at
		// NodeStageVolume, under the chart's shares.hostDir.
		if err := os.MkdirAll(cluster.ShareSource, 0o755); err != nil {
			t.Fatal(err)
		}
		ns := env.Namespace(t, "share")
		env.claim(t, ns, claimSpec{name: "c", class: "share-bind", size: "100Mi", rwx: true})
		env.pod(t, ns, podSpec{name: "w", claims: []string{"c"}})
		want := strings.TrimSpace(env.MustExec(t, ns, "w", writeBlob))
		if _, err := os.Stat(filepath.Join(cluster.ShareSource, "pool.json")); err != nil {
			t.Fatalf("the driver laid out no pool on the share: %v", err)
		}
		if len(cluster.MountsUnder(cluster.SharesDir)) < 2 { // the shares directory itself, and the share below it
			t.Errorf("the node plugin's mount of the share is not under %s on the host", cluster.SharesDir)
		}
		env.DeletePod(t, ns, "w")
		env.pod(t, ns, podSpec{name: "r", claims: []string{"c"}})
		if got := sum(t, env, ns, "r", "/data/blob"); got != want {
			t.Fatalf("data on the share: wrote %s, read %s", want, got)
		}
	})

	t.Run("every claim deleted leaves nothing behind", func(t *testing.T) {
		env.DeleteAll(t)
		for _, m := range cluster.MountsUnder(cluster.KubeletDir) {
			if strings.Contains(m, "kubernetes.io~csi") || strings.Contains(m, "/plugins/kubernetes.io/csi/") {
				t.Errorf("a CSI mount is left: %s", m)
			}
		}
		for _, line := range cluster.OurLoops(cluster.KubeletDir, cluster.LocalPoolPath, cluster.SharedPoolPath) {
			t.Errorf("a loop device is left: %s", line)
		}
		for _, p := range []string{cluster.LocalPoolPath, cluster.SharedPoolPath, cluster.ShareSource} {
			entries, _ := os.ReadDir(filepath.Join(p, "volumes"))
			for _, e := range entries {
				t.Errorf("pool %s still holds volume %s", p, e.Name())
			}
		}
	})
}
