package harness

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"

	"github.com/poolcsi/poolcsi/test/k8s/chart"
)

// The chart's default pool paths: the node is prepared as an administrator would, with a
// filesystem mounted at each, so the chart runs with image overrides only.
const (
	localPoolPath  = "/var/lib/poolcsi/pools/local"
	sharedPoolPath = "/mnt/poolcsi-shared"
	busyboxImage   = localImagePrefix + "busybox:1"
	poolcsiImage   = localImagePrefix + "poolcsi"
	poolcsiTag     = "test"
)

// kubeletEnv is a one-node cluster running the chart as pods.
type kubeletEnv struct {
	c       *Cluster
	node    *Node
	poolcsi string // host binary (pool init, inspection)
}

// startKubeletEnv brings up the control plane, a real node and the chart, rendered with
// image overrides only and applied as it is; it returns once both drivers are registered
// with kubelet.
func startKubeletEnv(t *testing.T) *kubeletEnv {
	t.Helper()
	requireNode(t)
	requireCommands(t, "mkfs.xfs", "mkfs.ext4", "mkfs.btrfs")
	for _, p := range []string{localPoolPath, sharedPoolPath} {
		if entries, err := os.ReadDir(p); err == nil && len(entries) > 0 {
			t.Fatalf("%s exists and is not empty: the kubelet test lays out the chart's default pools there", p)
		}
	}
	total := time.Now()
	dir := t.TempDir()
	ip := NodeIP(t)
	c := StartClusterWith(t, dir, ClusterOptions{NodeIP: ip})
	installSnapshotCRDs(t, c)
	c.Start(t, "snapshot-controller", snapshotControllerTool.Path(t), nil, "--kubeconfig="+c.AdminKube,
		"--retry-interval-max=5s", "--v=2").mustRun(t)

	bin := buildPoolcsi(t, dir)
	pause := buildPause(t, dir)
	images := []Image{
		BinaryImage(pauseImage, pause),
		BusyboxImage(t, busyboxImage),
		PoolcsiImage(t, poolcsiImage+":"+poolcsiTag, bin),
	}
	overrides := map[string]any{"image": map[string]any{"repository": poolcsiImage, "tag": poolcsiTag}}
	sidecars := map[string]any{}
	for key, tl := range map[string]Tool{"provisioner": provisionerTool, "attacher": attacherTool, "resizer": resizerTool, "snapshotter": snapshotterTool} {
		ref := localImagePrefix + tl.Name + ":" + tl.Version
		images = append(images, BinaryImage(ref, tl.Path(t)))
		sidecars[key] = map[string]any{"image": ref}
	}
	overrides["sidecars"] = sidecars

	// Pools: xfs for the local one, btrfs for the shared one (dir volumes get btrfs quota
	// groups); the shared pool is laid out once with `poolcsi pool init`, as docs/pools.md
	// tells an administrator.
	mountPoolFS(t, localPoolPath, "xfs", 6<<30)
	mountPoolFS(t, sharedPoolPath, "btrfs", 4<<30)
	if out, err := exec.Command(bin, "pool", "init", "--path", sharedPoolPath, "--name", "shared").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}

	node := StartNode(t, c, ip, images)
	t.Logf("node %s Ready after %s", node.Name, time.Since(total).Round(time.Second))
	env := &kubeletEnv{c: c, node: node, poolcsi: bin}

	docs, err := chart.Render(chart.ChartDir(), "", overrides)
	if err != nil {
		t.Fatal(err)
	}
	ap := c.Applier()
	ctx := context.Background()
	// helm install --create-namespace
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chart.Namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		objs, err := ParseObjects([]byte(d.YAML))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if o.GetNamespace() == "" && o.GetKind() != "Namespace" && isNamespaced(o) {
				o.SetNamespace(chart.Namespace)
			}
			if err := ap.Apply(ctx, o, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Graceful teardown first (runs before the node stops): claims deleted, pods gone, the
	// driver has unpublished, unstaged and deleted every volume.
	t.Cleanup(func() { env.deleteAll(t) })
	env.waitChartReady(t)
	t.Logf("chart running as pods after %s", time.Since(total).Round(time.Second))
	return env
}

func isNamespaced(o *unstructured.Unstructured) bool {
	switch o.GetKind() {
	case "ClusterRole", "ClusterRoleBinding", "CSIDriver", "StorageClass", "VolumeSnapshotClass", "Namespace", "PriorityClass":
		return false
	}
	return true
}

// mountPoolFS formats a sparse image and mounts it at path (loop, autoclear), undone when
// the test ends.
func mountPoolFS(t *testing.T, path, fsType string, size int64) {
	t.Helper()
	img := filepath.Join(t.TempDir(), "pool-"+fsType+".img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	args := []string{"-q", img}
	if fsType == "ext4" {
		args = []string{"-q", "-F", img}
	}
	if out, err := exec.Command("mkfs."+fsType, args...).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.%s: %v\n%s", fsType, err, out)
	}
	created := false
	if _, err := os.Stat(path); os.IsNotExist(err) {
		created = true
	}
	if err := os.MkdirAll(path, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, path).CombinedOutput(); err != nil {
		t.Fatalf("mount %s: %v\n%s", path, err, out)
	}
	// The chart mounts pools into its containers with HostToContainer or Bidirectional
	// propagation, which containerd refuses on a private mount ("is mounted on ... but it
	// is not a shared or slave mount"). systemd makes every mount shared; this machine's
	// init does not.
	if out, err := exec.Command("mount", "--make-shared", path).CombinedOutput(); err != nil {
		t.Fatalf("mount --make-shared %s: %v\n%s", path, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", path).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v %s (still in use: a volume of the test was left behind)", path, err, out)
			_ = exec.Command("umount", "-l", path).Run()
		}
		if created {
			_ = os.Remove(path)
			_ = os.Remove(filepath.Dir(path)) // /var/lib/poolcsi/pools, if empty
			_ = os.Remove(filepath.Dir(filepath.Dir(path)))
		}
	})
}

func buildPause(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "pause")
	cmd := niceCmd(goBin(), "build", "-o", bin, "./cmd/pause")
	cmd.Dir = filepath.Join(chart.RepoRoot(), "test", "k8s")
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/pause: %v\n%s", err, out)
	}
	return bin
}

// waitChartReady waits for every pod of the release to be Ready and for kubelet to list
// both drivers in the node's CSINode, registered by poolcsi itself.
func (e *kubeletEnv) waitChartReady(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	waitFor(t, 180*time.Second, "the chart's pods Ready", func() error {
		pods, err := e.c.Client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(pods.Items) < 3 { // the node DaemonSet's pod and two controller replicas
			return fmt.Errorf("%d pods", len(pods.Items))
		}
		for _, p := range pods.Items {
			if !podReady(&p) {
				return fmt.Errorf("pod %s not ready: %s", p.Name, podSummary(&p))
			}
		}
		return nil
	})
	waitFor(t, 60*time.Second, "CSINode with both drivers", func() error {
		cn, err := e.c.Client.StorageV1().CSINodes().Get(ctx, e.node.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		found := map[string]bool{}
		for _, d := range cn.Spec.Drivers {
			if len(d.TopologyKeys) != 1 || d.TopologyKeys[0] != topoKey || d.NodeID != e.node.Name {
				return fmt.Errorf("driver %s registered as node %q with topology keys %v", d.Name, d.NodeID, d.TopologyKeys)
			}
			found[d.Name] = true
		}
		if !found[localDriver] || !found[sharedDrv] {
			return fmt.Errorf("CSINode lists %v", cn.Spec.Drivers)
		}
		return nil
	})
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func podSummary(p *corev1.Pod) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s", p.Status.Phase)
	for _, c := range p.Status.Conditions {
		if c.Status != corev1.ConditionTrue && c.Message != "" {
			fmt.Fprintf(&b, "; %s: %s", c.Type, c.Message)
		}
	}
	for _, cs := range p.Status.ContainerStatuses {
		switch {
		case cs.State.Waiting != nil:
			fmt.Fprintf(&b, "; %s waiting: %s %s", cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
		case cs.State.Terminated != nil:
			fmt.Fprintf(&b, "; %s terminated: %s %s", cs.Name, cs.State.Terminated.Reason, cs.State.Terminated.Message)
		}
	}
	return b.String()
}

// deleteAll deletes every test namespace's pods and claims and waits until no PV is left.
func (e *kubeletEnv) deleteAll(t *testing.T) {
	ctx := context.Background()
	nss, err := e.c.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{LabelSelector: "poolcsi-test=true"})
	if err != nil {
		t.Logf("list namespaces: %v", err)
		return
	}
	for _, ns := range nss.Items {
		_ = e.c.Client.CoreV1().Namespaces().Delete(ctx, ns.Name, metav1.DeleteOptions{})
	}
	deadline := time.Now().Add(120 * time.Second)
	for time.Now().Before(deadline) {
		pvs, err := e.c.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err == nil && len(pvs.Items) == 0 {
			return
		}
		time.Sleep(time.Second)
	}
	t.Errorf("PersistentVolumes left 120 s after their claims were deleted")
}

// namespace creates a test namespace, deleted with everything in it by deleteAll.
func (e *kubeletEnv) namespace(t *testing.T, name string) string {
	t.Helper()
	_, err := e.c.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: name, Labels: map[string]string{"poolcsi-test": "true"}}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	return name
}

// exec runs a shell command in a pod's first container through the API server and
// kubelet's streaming server, as kubectl exec does.
func (e *kubeletEnv) exec(t *testing.T, ns, pod, script string) (string, error) {
	t.Helper()
	req := e.c.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Command: []string{"sh", "-c", script}, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ex, err := remotecommand.NewSPDYExecutor(e.c.Config, "POST", req.URL())
	if err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err = ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})
	if err != nil {
		return stdout.String(), fmt.Errorf("%w: %s", err, stderr.String())
	}
	return stdout.String(), nil
}

func (e *kubeletEnv) mustExec(t *testing.T, ns, pod, script string) string {
	t.Helper()
	out, err := e.exec(t, ns, pod, script)
	if err != nil {
		t.Fatalf("exec in %s/%s: %q: %v\n%s", ns, pod, script, err, out)
	}
	return out
}

// storageClasses are what a user of the chart writes: one per filesystem for the local
// driver, dir and image layouts for the shared one.
func (e *kubeletEnv) storageClasses(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	wffc, immediate := storagev1.VolumeBindingWaitForFirstConsumer, storagev1.VolumeBindingImmediate
	expand, del := true, corev1.PersistentVolumeReclaimDelete
	for _, sc := range []storagev1.StorageClass{
		{ObjectMeta: metav1.ObjectMeta{Name: "local-xfs"}, Provisioner: localDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-btrfs"}, Provisioner: localDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "btrfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-ext4"}, Provisioner: localDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "ext4"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-dir"}, Provisioner: sharedDrv, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "dir"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-xfs"}, Provisioner: sharedDrv, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
	} {
		sc.AllowVolumeExpansion, sc.ReclaimPolicy = &expand, &del
		if _, err := e.c.Client.StorageV1().StorageClasses().Create(ctx, &sc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	vsc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
		"metadata": map[string]any{"name": "shared"}, "driver": sharedDrv, "deletionPolicy": "Delete"}}
	if err := e.c.Applier().Apply(ctx, vsc, false); err != nil {
		t.Fatal(err)
	}
}

type claimSpec struct {
	name, class, size string
	block, rwx        bool
	dataSource        string // a VolumeSnapshot to restore
}

func (e *kubeletEnv) claim(t *testing.T, ns string, c claimSpec) {
	t.Helper()
	mode := corev1.PersistentVolumeFilesystem
	if c.block {
		mode = corev1.PersistentVolumeBlock
	}
	access := corev1.ReadWriteOnce
	if c.rwx {
		access = corev1.ReadWriteMany
	}
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: c.name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &c.class, VolumeMode: &mode,
			AccessModes: []corev1.PersistentVolumeAccessMode{access},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(c.size)}},
		}}
	if c.dataSource != "" {
		group := "snapshot.storage.k8s.io"
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: c.dataSource}
	}
	if _, err := e.c.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

type podSpec struct {
	name     string
	claims   []string // mounted at /data, /data2...; block claims appear at /dev/xvda...
	block    bool
	readOnly bool
}

// pod runs busybox sleeping, with the claims, and waits until it is Running.
func (e *kubeletEnv) pod(t *testing.T, ns string, p podSpec) *corev1.Pod {
	t.Helper()
	grace := int64(1)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: ns},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "c", Image: busyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sleep", "100000"}}},
		}}
	c := &pod.Spec.Containers[0]
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
	ctx := context.Background()
	if _, err := e.c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return e.waitRunning(t, ns, p.name)
}

func (e *kubeletEnv) waitRunning(t *testing.T, ns, name string) *corev1.Pod {
	t.Helper()
	var got *corev1.Pod
	waitFor(t, 120*time.Second, "pod "+ns+"/"+name+" Running", func() error {
		var err error
		got, err = e.c.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if got.Status.Phase != corev1.PodRunning || !podReady(got) {
			return fmt.Errorf("%s%s", podSummary(got), e.events(ns, name))
		}
		return nil
	})
	return got
}

// events lists the events of one object, one per line.
func (e *kubeletEnv) events(ns, name string) string {
	evs, err := e.c.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return ""
	}
	var b strings.Builder
	for _, ev := range evs.Items {
		fmt.Fprintf(&b, "\n  event %s %s: %s", ev.Type, ev.Reason, ev.Message)
	}
	return b.String()
}

// deletePod deletes a pod and waits until it is gone: kubelet has unpublished its volumes.
func (e *kubeletEnv) deletePod(t *testing.T, ns, name string) {
	t.Helper()
	ctx := context.Background()
	if err := e.c.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 120*time.Second, "pod "+ns+"/"+name+" gone", func() error {
		_, err := e.c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("still there (%v)", err)
	})
}

func (e *kubeletEnv) pvc(t *testing.T, ns, name string) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc, err := e.c.Client.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

// resize asks for a bigger claim.
func (e *kubeletEnv) resize(t *testing.T, ns, name, size string) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size)
	if _, err := e.c.Client.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitCapacity waits for the claim's status.capacity to reach size.
func (e *kubeletEnv) waitCapacity(t *testing.T, ns, name, size string, timeout time.Duration) {
	t.Helper()
	want := resource.MustParse(size)
	waitFor(t, timeout, "claim "+ns+"/"+name+" status.capacity "+size, func() error {
		pvc := e.pvc(t, ns, name)
		got := pvc.Status.Capacity[corev1.ResourceStorage]
		if got.Cmp(want) < 0 {
			return fmt.Errorf("capacity %s, conditions %+v", got.String(), pvc.Status.Conditions)
		}
		return nil
	})
}

// dfBytes is the size in bytes of the filesystem at path in the pod.
func (e *kubeletEnv) dfBytes(t *testing.T, ns, pod, path string) int64 {
	t.Helper()
	out := e.mustExec(t, ns, pod, "df -k "+path+" | tail -1")
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
func (e *kubeletEnv) kubeletMetrics(t *testing.T) string {
	t.Helper()
	b, err := e.c.Client.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes/" + e.node.Name + "/proxy/metrics").DoRaw(context.Background())
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

// TestKubelet drives poolcsi through a real kubelet, with the chart running as pods.
func TestKubelet(t *testing.T) {
	env := startKubeletEnv(t)
	env.storageClasses(t)

	// Both driver names of the chart: data written in one pod is there, bit for bit, in
	// the next one.
	for _, tc := range []struct{ driver, class string }{{localDriver, "local-xfs"}, {sharedDrv, "shared-dir"}} {
		t.Run("data survives the pod/"+tc.driver, func(t *testing.T) {
			ns := env.namespace(t, "data-"+tc.class)
			env.claim(t, ns, claimSpec{name: "c", class: tc.class, size: "300Mi"})
			env.pod(t, ns, podSpec{name: "writer", claims: []string{"c"}})
			sum := strings.TrimSpace(env.mustExec(t, ns, "writer", writeBlob))
			env.deletePod(t, ns, "writer")
			env.pod(t, ns, podSpec{name: "reader", claims: []string{"c"}})
			if got := strings.TrimSpace(env.mustExec(t, ns, "reader", "md5sum /data/blob | cut -d' ' -f1")); got != sum {
				t.Fatalf("data changed between pods: wrote %s, read %s", sum, got)
			}
		})
	}
}
