package harness

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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
	"github.com/poolcsi/poolcsi/test/k8s/tools"
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

// kubeletEnv is a cluster of real nodes on this machine running the chart as pods.
type kubeletEnv struct {
	c       *Cluster
	node    *Node   // the first node
	nodes   []*Node // every node
	poolcsi string  // host binary (pool init, inspection)
	log     *envLog // what the environment made, for the next run to reclaim if this one is killed
	// localOnly: the chart runs the local driver only (no shared pool: no controller, no
	// shared driver to register)
	localOnly bool
	// overrides are the chart values the environment renders this tree's chart with
	overrides func() map[string]any
}

// imageOverrides are the chart values that set the images: poolcsi's and the sidecars'
// (key: the chart's sidecars key), the ones imported into the nodes.
func imageOverrides(sidecars map[string]string) map[string]any {
	sc := map[string]any{}
	for k, ref := range sidecars {
		sc[k] = map[string]any{"image": ref}
	}
	return map[string]any{"image": map[string]any{"repository": poolcsiImage, "tag": poolcsiTag}, "sidecars": sc}
}

// envOptions change the environment startEnv brings up.
type envOptions struct {
	// extra images to import on every node
	extra func(testing.TB) []Image
	// values are chart values set beside the image overrides (top-level keys)
	values map[string]any
	// nodes: two nodes, node-a and node-b, each with its own mount namespace (kubelet's
	// root, its local pool and its shares), cgroup root and pod network; the shared pool
	// is one filesystem both mount. Zero: this machine is the one node.
	nodes int
	// cephFS, with nodes: the shared pool is a directory of test/support/cephfs's CephFS, each
	// node mounting it through a ceph-fuse client of its own; else a btrfs filesystem.
	cephFS bool
	// defaults: the chart with its default values, only the images set (this machine has
	// no registry), on a node prepared with nothing, as docs/install.md promises: no
	// shared pool, no shares, the local pool a directory the chart makes on the node's
	// disk. values, nodes and cephFS are ignored.
	defaults bool
	// prev installs an earlier release instead of this tree's chart and image (see
	// TestUpgrade); the environment's overrides are still this tree's, for the upgrade.
	prev *prevRelease
}

// startKubeletEnv brings up the control plane, a real node and the chart, rendered with
// image overrides only and applied as it is; it returns once both drivers are registered
// with kubelet.
func startKubeletEnv(t testing.TB) *kubeletEnv {
	t.Helper()
	return startKubeletEnvWith(t, nil, nil)
}

// startKubeletEnvWith is startKubeletEnv with more images to import and chart values set
// beside the image overrides (top-level keys).
func startKubeletEnvWith(t testing.TB, extra func(testing.TB) []Image, values map[string]any) *kubeletEnv {
	t.Helper()
	return startEnv(t, envOptions{extra: extra, values: values})
}

// startEnv is startKubeletEnv with options.
func startEnv(t testing.TB, opts envOptions) *kubeletEnv {
	t.Helper()
	extra, values := opts.extra, opts.values
	requireCommands(t, "mkfs.xfs", "mkfs.ext4", "mkfs.btrfs")
	if opts.nodes > 1 {
		requireCommands(t, "unshare", "nsenter")
	}
	// The lock first: it reclaims what a killed environment left, which requireNode would
	// otherwise refuse.
	log := lockKubeletEnv(t)
	requireNode(t)
	for _, p := range []string{localPoolPath, sharedPoolPath} {
		if entries, err := os.ReadDir(p); err == nil && len(entries) > 0 {
			t.Fatalf("%s exists and is not empty: the kubelet test lays out the chart's default pools there", p)
		}
	}
	log.note(t, recKubelet, KubeletDir)
	total := time.Now()
	dir := t.TempDir()
	// The root of every t.TempDir of this test: pool images, PKI, etcd.
	log.note(t, recTmp, filepath.Dir(dir))
	ip := NodeIP(t)
	c := StartClusterWith(t, dir, ClusterOptions{NodeIP: ip})
	c.OnHostPath = func(kind, path string) { log.note(t, kind, path) }
	installSnapshotCRDs(t, c)
	// Distributed snapshotting, for a chart with snapshots.local (the e2e run's): local volumes
	// are snapshotted by their node's csi-snapshotter, which only sees contents labelled with
	// its node.
	c.Start(t, "snapshot-controller", tools.SnapshotController.Path(t), nil, "--kubeconfig="+c.AdminKube,
		"--enable-distributed-snapshotting", "--retry-interval-max=5s", "--v=2").mustRun(t)

	bin := buildPoolcsi(t, dir)
	pause := buildPause(t, dir)
	images := []Image{
		BinaryImage(pauseImage, pause),
		BinaryImage("poolcsi.test/pause:3.10.2", pause), // e2e.test's own pause image
		BusyboxImage(t, busyboxImage),
		PoolcsiImage(t, poolcsiImage+":"+poolcsiTag, bin),
	}
	if extra != nil {
		images = append(images, extra(t)...)
	}
	sidecars := map[string]string{}
	for key, tl := range map[string]tools.Tool{"provisioner": tools.Provisioner, "attacher": tools.Attacher, "resizer": tools.Resizer, "snapshotter": tools.Snapshotter} {
		ref := localImagePrefix + tl.Name + ":" + tl.Version
		images = append(images, BinaryImage(ref, tl.Path(t)))
		sidecars[key] = ref
	}
	if opts.defaults {
		return startDefaultEnv(t, c, log, ip, bin, images, imageOverrides(sidecars), total)
	}
	if opts.prev != nil {
		images = append(images, PoolcsiImage(t, poolcsiImage+":"+opts.prev.tag(), opts.prev.bin))
	}
	// The chart values of this environment, fresh each call.
	envOverrides := func() map[string]any {
		overrides := imageOverrides(sidecars)
		// The shared pool the node is prepared with: opt-in since the chart's defaults install
		// the local pool only (values may set pools of their own). Its share key comes from a
		// Secret made before the chart is applied, as docs/install.md tells an operator.
		for k, v := range chart.SharedPoolValues() {
			overrides[k] = v
		}
		for k, v := range values {
			overrides[k] = v
		}
		// bind is the one share type this machine can mount (no NFS or CephFS kernel client):
		// the share test names a directory of the shared pool's filesystem, which both the
		// controller and the node plugin see.
		overrides["shares"] = map[string]any{"enabled": true, "hostDir": sharesDir,
			"types": []any{"bind", "nfs", "nfs4", "ceph", "fuse.ceph"}}
		return overrides
	}
	overrides, chartDir := envOverrides(), chart.ChartDir()
	if opts.prev != nil {
		overrides, chartDir = opts.prev.values(envOverrides()), opts.prev.chartDir()
	}

	// Pools: xfs for the local one, btrfs for the shared one (dir volumes get btrfs quota
	// groups); the shared pool is laid out once with `poolcsi pool init`, as docs/pools.md
	// tells an administrator. Both are sparse files of 16 GiB: poolcsi admits a volume against
	// what it has promised, not what is written, and the storage e2e suite runs three specs at
	// once, each growing 1 GiB claims to 2 GiB (a 4 GiB shared pool refused the third with
	// RESOURCE_EXHAUSTED, rightly).
	if opts.nodes <= 1 {
		log.noteMount(t, localPoolPath)
		mountPoolFS(t, nil, localPoolPath, "xfs", 16<<30)
	}
	var sharedSrc []string // each node's mount of the shared pool, when it is not sharedPoolPath
	if opts.cephFS {
		mounts := startCephFS(t)
		for _, m := range mounts {
			sharedSrc = append(sharedSrc, filepath.Join(m, "pool"))
		}
		if err := os.Mkdir(sharedSrc[0], 0o755); err != nil {
			t.Fatal(err)
		}
		// The pool is a directory of the filesystem, each node's bind mount of it its
		// mount point.
		if out, err := exec.Command(bin, "pool", "init", "--path", sharedSrc[0], "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
			t.Fatalf("poolcsi pool init: %v\n%s", err, out)
		}
	} else {
		log.noteMount(t, sharedPoolPath)
		mountPoolFS(t, nil, sharedPoolPath, "btrfs", 16<<30)
		// Dir volumes get a size limit only where the administrator turned quota on
		// (docs/pools.md, "Quota is the admin's decision").
		if out, err := exec.Command("btrfs", "quota", "enable", sharedPoolPath).CombinedOutput(); err != nil {
			t.Fatalf("btrfs quota enable: %v\n%s", err, out)
		}
		initBin := bin // an upgrade starts from the pool the earlier release laid out
		if opts.prev != nil {
			initBin = opts.prev.bin
		}
		if out, err := exec.Command(initBin, "pool", "init", "--path", sharedPoolPath, "--name", "shared").CombinedOutput(); err != nil {
			t.Fatalf("poolcsi pool init: %v\n%s", err, out)
		}
	}

	if opts.nodes <= 1 {
		log.noteMount(t, sharesDir)
		sharedBindMount(t, nil, sharesDir, "")
	}

	// Last resort, after the node is gone and before the pools are unmounted: a loop device
	// the test run left (a failure before the claims were deleted) keeps a pool busy.
	t.Cleanup(func() {
		for dev, line := range ourLoops(KubeletDir, localPoolPath, sharedPoolPath) {
			t.Errorf("detaching a loop device left behind: %s", line)
			_, _ = detachLoop(dev)
		}
	})
	var nodes []*Node
	if opts.nodes <= 1 {
		nodes = []*Node{StartNode(t, c, ip, images)}
	} else {
		nodes = startNodes(t, c, log, ip, images, sharedSrc)
	}
	for _, n := range nodes {
		t.Logf("node %s Ready after %s", n.Name, time.Since(total).Round(time.Second))
	}
	env := &kubeletEnv{c: c, node: nodes[0], nodes: nodes, poolcsi: bin, log: log, overrides: envOverrides}

	docs, err := chart.Render(chartDir, "", overrides)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// helm install --create-namespace
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chart.Namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// kubectl create secret generic poolcsi-share-key --from-literal=key=...
	shareKey := make([]byte, 36)
	if _, err := rand.Read(shareKey); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Secrets(chart.Namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: chart.ShareKeySecret},
		Data:       map[string][]byte{"key": []byte(base64.StdEncoding.EncodeToString(shareKey))},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	env.applyChart(t, docs)
	// Graceful teardown first (runs before the node stops): claims deleted, pods gone, the
	// driver has unpublished, unstaged and deleted every volume.
	t.Cleanup(func() { env.deleteAll(t) })
	env.waitChartReady(t)
	t.Logf("chart running as pods after %s", time.Since(total).Round(time.Second))
	return env
}

// applyChart applies a rendered chart as helm install or helm upgrade does: each object
// server-side applied into the release's namespace.
func (e *kubeletEnv) applyChart(t testing.TB, docs []chart.Doc) {
	t.Helper()
	ap := e.c.Applier()
	for _, d := range docs {
		objs, err := ParseObjects([]byte(d.YAML))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if o.GetNamespace() == "" && o.GetKind() != "Namespace" && isNamespaced(o) {
				o.SetNamespace(chart.Namespace)
			}
			if err := ap.Apply(context.Background(), o, false); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func isNamespaced(o *unstructured.Unstructured) bool {
	switch o.GetKind() {
	case "ClusterRole", "ClusterRoleBinding", "CSIDriver", "StorageClass", "VolumeSnapshotClass", "Namespace", "PriorityClass":
		return false
	}
	return true
}

// mountPoolFS formats a sparse image and mounts it at path (loop, autoclear) on node n (nil:
// this machine), undone when the test ends.
func mountPoolFS(t testing.TB, n *Node, path, fsType string, size int64) {
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
	if out, err := n.command("mount", "-o", "loop", img, path).CombinedOutput(); err != nil {
		t.Fatalf("mount %s: %v\n%s", path, err, out)
	}
	// The chart mounts pools into its containers with HostToContainer or Bidirectional
	// propagation, which containerd refuses on a private mount ("is mounted on ... but it
	// is not a shared or slave mount"). systemd makes every mount shared; this machine's
	// init does not.
	if out, err := n.command("mount", "--make-shared", path).CombinedOutput(); err != nil {
		t.Fatalf("mount --make-shared %s: %v\n%s", path, err, out)
	}
	t.Cleanup(func() {
		if out, err := n.command("umount", path).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v %s (still in use: a volume of the test was left behind)", path, err, out)
			_ = n.command("umount", "-l", path).Run()
		}
		// On a node, the mount point is every node's: startNodes removes it.
		if created && n == nil {
			_ = os.Remove(path)
			_ = os.Remove(filepath.Dir(path)) // /var/lib/poolcsi/pools, if empty
			_ = os.Remove(filepath.Dir(filepath.Dir(path)))
		}
	})
}

// shareSource is the share the share-bind StorageClass names.
const shareSource = sharedPoolPath + "/share-src"

// sharesDir is the chart's shares.hostDir, where the shared driver's node plugin mounts the
// shares StorageClasses name.
const sharesDir = "/var/lib/poolcsi/shares"

// sharedBindMount makes path a mount point of its own with shared propagation on node n
// (nil: this machine): the chart mounts it into the node plugin with Bidirectional
// propagation, which containerd refuses below a private mount, and this machine's / is
// private (systemd makes it shared). src, if set, is the directory mounted there instead
// of path itself (a node's own, on a node with OwnMounts).
func sharedBindMount(t testing.TB, n *Node, path, src string) {
	t.Helper()
	created := false
	if _, err := os.Stat(path); os.IsNotExist(err) {
		created = true
	}
	if err := os.MkdirAll(path, 0o755); err != nil {
		t.Fatal(err)
	}
	if src == "" {
		src = path
	}
	for _, args := range [][]string{{"--bind", src, path}, {"--make-shared", path}} {
		if out, err := n.command("mount", args...).CombinedOutput(); err != nil {
			t.Fatalf("mount %v: %v\n%s", args, err, out)
		}
	}
	t.Cleanup(func() {
		if out, err := n.command("umount", "-R", path).CombinedOutput(); err != nil {
			t.Errorf("umount -R %s: %v %s", path, err, out)
			_ = n.command("umount", "-R", "-l", path).Run()
		}
		if src != path {
			return // the node's own directory goes with the node's
		}
		// The bind mount is the directory itself, so what the driver wrote there (a
		// mount point and a record per share) stays on the host's disk: remove it, once
		// nothing is mounted below it any more.
		if left := mountsUnder(path); len(left) > 0 {
			t.Errorf("still mounted under %s: %v", path, left)
			return
		}
		if created {
			if err := os.RemoveAll(path); err != nil {
				t.Errorf("removing %s: %v", path, err)
			}
			_ = os.Remove(filepath.Dir(path)) // /var/lib/poolcsi, if empty
		}
	})
}

func buildPause(t testing.TB, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "pause")
	cmd := tools.Nice(t.Context(), goBin(), "build", "-o", bin, "./cmd/pause")
	cmd.Dir = filepath.Join(chart.RepoRoot(), "test", "k8s")
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/pause: %v\n%s", err, out)
	}
	return bin
}

// waitChartReady waits for every pod of the release to be Ready and for kubelet to list
// both drivers in the node's CSINode, registered by poolcsi itself.
func (e *kubeletEnv) waitChartReady(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	waitFor(t, 180*time.Second, "the chart's pods Ready", func() error {
		pods, err := e.c.Client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		want := 2 + len(e.nodes) // the node DaemonSet's pods and two controller replicas
		if e.localOnly {
			want = len(e.nodes)
		}
		if len(pods.Items) < want {
			return fmt.Errorf("%d pods", len(pods.Items))
		}
		for _, p := range pods.Items {
			if !podReady(&p) {
				return fmt.Errorf("pod %s not ready: %s", p.Name, podSummary(&p))
			}
		}
		return nil
	})
	for _, n := range e.nodes {
		waitFor(t, 60*time.Second, "CSINode of "+n.Name+" with both drivers", func() error {
			cn, err := e.c.Client.StorageV1().CSINodes().Get(ctx, n.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			found := map[string]bool{}
			for _, d := range cn.Spec.Drivers {
				if len(d.TopologyKeys) != 1 || d.TopologyKeys[0] != topoKey || d.NodeID != n.Name {
					return fmt.Errorf("driver %s registered as node %q with topology keys %v", d.Name, d.NodeID, d.TopologyKeys)
				}
				found[d.Name] = true
			}
			if !found[localDriver] || (!found[sharedDrv] && !e.localOnly) {
				return fmt.Errorf("CSINode lists %v", cn.Spec.Drivers)
			}
			return nil
		})
	}
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
func (e *kubeletEnv) deleteAll(t testing.TB) {
	ctx := context.Background()
	nss, err := e.c.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Logf("list namespaces: %v", err)
		return
	}
	// Every namespace the tests made: this package's (labelled poolcsi-test) and those an
	// interrupted e2e.test left behind. Only the cluster's own and the chart's stay, so
	// the driver is still there to delete the volumes.
	for _, ns := range nss.Items {
		if ns.Name == "default" || ns.Name == chart.Namespace || strings.HasPrefix(ns.Name, "kube-") {
			continue
		}
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
func (e *kubeletEnv) namespace(t testing.TB, name string) string {
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
func (e *kubeletEnv) exec(t testing.TB, ns, pod, script string) (string, error) {
	t.Helper()
	return e.execIn(t, ns, pod, "", "sh", "-c", script)
}

// execIn runs a command in the named container ("": the first).
func (e *kubeletEnv) execIn(t testing.TB, ns, pod, container string, command ...string) (string, error) {
	t.Helper()
	req := e.c.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
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

func (e *kubeletEnv) mustExec(t testing.TB, ns, pod, script string) string {
	t.Helper()
	out, err := e.exec(t, ns, pod, script)
	if err != nil {
		t.Fatalf("exec in %s/%s: %q: %v\n%s", ns, pod, script, err, out)
	}
	return out
}

// storageClasses are what a user of the chart writes: one per filesystem for the local
// driver, dir and image layouts for the shared one.
func (e *kubeletEnv) storageClasses(t testing.TB) {
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
		{ObjectMeta: metav1.ObjectMeta{Name: "local-immediate"}, Provisioner: localDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-dir"}, Provisioner: sharedDrv, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "dir"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "share-bind"}, Provisioner: sharedDrv, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"shareType": "bind", "shareSource": shareSource, "layout": "dir"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-xfs"}, Provisioner: sharedDrv, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-ext4"}, Provisioner: sharedDrv, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "image", "csi.storage.k8s.io/fstype": "ext4"}},
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
	clone             string // a claim to clone
	rox               bool   // ReadOnlyMany
}

func (e *kubeletEnv) claim(t testing.TB, ns string, c claimSpec) {
	t.Helper()
	if _, err := e.c.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), claimObject(ns, c), metav1.CreateOptions{}); err != nil {
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
	if _, err := e.c.Client.CoreV1().Pods(ns).Create(context.Background(), podObject(ns, p), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return e.waitRunning(t, ns, p.name)
}

func podObject(ns string, p podSpec) *corev1.Pod {
	grace := int64(1)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: ns},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "c", Image: busyboxImage, ImagePullPolicy: corev1.PullNever,
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
func (e *kubeletEnv) deletePod(t testing.TB, ns, name string) {
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
		return fmt.Errorf("still there (%w)", err)
	})
}

func (e *kubeletEnv) pvc(t testing.TB, ns, name string) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc, err := e.c.Client.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

// resize asks for a bigger claim.
func (e *kubeletEnv) resize(t testing.TB, ns, name, size string) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size)
	if _, err := e.c.Client.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitCapacity waits for the claim's status.capacity to reach size.
func (e *kubeletEnv) waitCapacity(t testing.TB, ns, name, size string, timeout time.Duration) {
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
func (e *kubeletEnv) dfBytes(t testing.TB, ns, pod, path string) int64 {
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
func (e *kubeletEnv) kubeletMetrics(t testing.TB) string {
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
	// Local snapshots on (the chart's opt-in snapshots.local; the environment's
	// snapshot-controller is distributed): the local group snapshot case needs them.
	env := startKubeletEnvWith(t, nil, map[string]any{"snapshots": map[string]any{"enabled": true, "local": true}})
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
	kubeletCases(t, env)
	kubeletFeatures(t, env)
}

// volumeHandle returns the CSI volume handle of a bound claim.
func (e *kubeletEnv) volumeHandle(t testing.TB, ns, claim string) string {
	t.Helper()
	var handle string
	waitFor(t, 60*time.Second, "claim "+ns+"/"+claim+" bound", func() error {
		pvc := e.pvc(t, ns, claim)
		if pvc.Spec.VolumeName == "" {
			return fmt.Errorf("not bound")
		}
		pv, err := e.c.Client.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
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
	waitFor(t, timeout, name+" of "+ns+"/"+claim, func() error {
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
	waitFor(t, timeout, reason+" event on "+kind+" "+ns+"/"+name, func() error {
		evs, err := e.c.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{
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
	return strings.TrimSpace(env.mustExec(t, ns, pod, "md5sum "+path+" | cut -d' ' -f1"))
}

// nodePodName is the node DaemonSet's pod that is not being deleted.
func (e *kubeletEnv) nodePodName(t testing.TB) (string, error) {
	t.Helper()
	pods, err := e.c.Client.CoreV1().Pods(chart.Namespace).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=node"})
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
	if err := e.c.Client.CoreV1().Pods(chart.Namespace).Delete(context.Background(), old, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 120*time.Second, "a new node pod", func() error {
		n, err := e.nodePodName(t)
		if err == nil && n == old {
			return fmt.Errorf("still %s", n)
		}
		return err
	})
	e.waitChartReady(t)
}

// kubeletCases are the rest of the kubelet issue's cases, on the environment of TestKubelet.
func kubeletCases(t *testing.T, env *kubeletEnv) {
	ctx := context.Background()

	t.Run("RWX dir volume in two pods", func(t *testing.T) {
		ns := env.namespace(t, "rwx")
		env.claim(t, ns, claimSpec{name: "c", class: "shared-dir", size: "100Mi", rwx: true})
		env.pod(t, ns, podSpec{name: "a", claims: []string{"c"}})
		env.pod(t, ns, podSpec{name: "b", claims: []string{"c"}})
		env.mustExec(t, ns, "a", "echo from-a > /data/a")
		env.mustExec(t, ns, "b", "echo from-b > /data/b")
		if got := env.mustExec(t, ns, "b", "cat /data/a") + env.mustExec(t, ns, "a", "cat /data/b"); got != "from-a\nfrom-b\n" {
			t.Fatalf("the two pods do not see each other's writes: %q", got)
		}
	})

	t.Run("local claim of an Immediate class", func(t *testing.T) {
		// No pod yet: a node's provisioner takes the claim (csi-provisioner's distributed
		// immediate binding, after a random wait of up to its 20 s base delay), and the pod
		// then goes where the volume is.
		ns := env.namespace(t, "immediate")
		env.claim(t, ns, claimSpec{name: "c", class: "local-immediate", size: "300Mi"})
		waitFor(t, 2*time.Minute, "claim "+ns+"/c of an Immediate local class bound without a pod", func() error {
			if pvc := env.pvc(t, ns, "c"); pvc.Status.Phase != corev1.ClaimBound {
				return fmt.Errorf("phase %s; events: %s", pvc.Status.Phase, env.events(ns, "c"))
			}
			return nil
		})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"c"}})
		if got := env.mustExec(t, ns, "p", "echo ok > /data/x && cat /data/x"); got != "ok\n" {
			t.Fatalf("read back %q", got)
		}
	})

	t.Run("read-only pod mount", func(t *testing.T) {
		ns := env.namespace(t, "readonly")
		env.claim(t, ns, claimSpec{name: "c", class: "local-xfs", size: "300Mi"})
		env.pod(t, ns, podSpec{name: "w", claims: []string{"c"}})
		want := strings.TrimSpace(env.mustExec(t, ns, "w", writeBlob))
		env.deletePod(t, ns, "w")
		env.pod(t, ns, podSpec{name: "r", claims: []string{"c"}, readOnly: true})
		if got := sum(t, env, ns, "r", "/data/blob"); got != want {
			t.Fatalf("read-only pod reads %s, wrote %s", got, want)
		}
		if out, err := env.exec(t, ns, "r", "touch /data/x"); err == nil || !strings.Contains(err.Error()+out, "Read-only file system") {
			t.Fatalf("a write in a read-only pod mount: err %v, output %q", err, out)
		}
	})

	t.Run("block claim through volumeDevices", func(t *testing.T) {
		ns := env.namespace(t, "block")
		env.claim(t, ns, claimSpec{name: "c", class: "local-xfs", size: "64Mi", block: true})
		env.pod(t, ns, podSpec{name: "w", claims: []string{"c"}, block: true})
		size := strings.TrimSpace(env.mustExec(t, ns, "w", "blockdev --getsize64 /dev/xvda"))
		if size != strconv.Itoa(64<<20) {
			t.Fatalf("block device of a 64Mi claim is %s bytes", size)
		}
		want := strings.TrimSpace(env.mustExec(t, ns, "w", "dd if=/dev/urandom of=/tmp/b bs=1M count=8 2>/dev/null && dd if=/tmp/b of=/dev/xvda bs=1M conv=fsync 2>/dev/null && md5sum /tmp/b | cut -d' ' -f1"))
		env.deletePod(t, ns, "w")
		env.pod(t, ns, podSpec{name: "r", claims: []string{"c"}, block: true})
		if got := strings.TrimSpace(env.mustExec(t, ns, "r", "dd if=/dev/xvda bs=1M count=8 2>/dev/null | md5sum | cut -d' ' -f1")); got != want {
			t.Fatalf("block data: wrote %s, read %s", want, got)
		}
	})

	t.Run("kubelet_volume_stats", func(t *testing.T) {
		ns := env.namespace(t, "stats")
		env.claim(t, ns, claimSpec{name: "img", class: "local-xfs", size: "300Mi"})
		env.claim(t, ns, claimSpec{name: "dir", class: "shared-dir", size: "100Mi"})
		env.claim(t, ns, claimSpec{name: "blk", class: "local-xfs", size: "64Mi", block: true})
		env.pod(t, ns, podSpec{name: "fs", claims: []string{"img", "dir"}})
		env.pod(t, ns, podSpec{name: "bd", claims: []string{"blk"}, block: true})
		env.mustExec(t, ns, "fs", "dd if=/dev/zero of=/data/f bs=1M count=20 && dd if=/dev/zero of=/data2/f bs=1M count=10 && sync")
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
			ns := env.namespace(t, "grow-"+fs)
			env.claim(t, ns, claimSpec{name: "c", class: "local-" + fs, size: "300Mi"})
			env.pod(t, ns, podSpec{name: "p", claims: []string{"c"}})
			want := strings.TrimSpace(env.mustExec(t, ns, "p", writeBlob))
			before := env.dfBytes(t, ns, "p", "/data")
			env.resize(t, ns, "c", "600Mi")
			env.waitCapacity(t, ns, "c", "600Mi", 150*time.Second)
			waitFor(t, 60*time.Second, "the pod's filesystem grown", func() error {
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
		ns := env.namespace(t, "grow-ext4")
		env.claim(t, ns, claimSpec{name: "c", class: "shared-ext4", size: "200Mi"})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"c"}})
		want := strings.TrimSpace(env.mustExec(t, ns, "p", writeBlob))
		before := env.dfBytes(t, ns, "p", "/data")
		env.deletePod(t, ns, "p")
		env.resize(t, ns, "c", "400Mi")
		// The resizer grows the volume and leaves the filesystem to the next mount.
		waitFor(t, 120*time.Second, "the claim waiting for a pod to finish its growth", func() error {
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
		ns := env.namespace(t, "driver-restart")
		env.claim(t, ns, claimSpec{name: "c", class: "local-xfs", size: "300Mi"})
		env.claim(t, ns, claimSpec{name: "d", class: "shared-dir", size: "100Mi"})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"c", "d"}})
		want := strings.TrimSpace(env.mustExec(t, ns, "p", writeBlob))
		env.restartNodePod(t)
		if got := sum(t, env, ns, "p", "/data/blob"); got != want {
			t.Fatalf("after the driver restart the pod reads %s, wrote %s", got, want)
		}
		env.mustExec(t, ns, "p", "echo after > /data/after && echo after > /data2/after && sync")
		env.deletePod(t, ns, "p")
		env.pod(t, ns, podSpec{name: "q", claims: []string{"c", "d"}})
		if got := env.mustExec(t, ns, "q", "cat /data/after /data2/after"); got != "after\nafter\n" {
			t.Fatalf("writes after the restart: %q", got)
		}
	})

	t.Run("kubelet restarted under a running pod", func(t *testing.T) {
		ns := env.namespace(t, "kubelet-restart")
		env.claim(t, ns, claimSpec{name: "c", class: "local-xfs", size: "300Mi"})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"c"}})
		want := strings.TrimSpace(env.mustExec(t, ns, "p", writeBlob))
		env.node.RestartKubelet(t)
		time.Sleep(5 * time.Second)
		env.waitRunning(t, ns, "p")
		if got := sum(t, env, ns, "p", "/data/blob"); got != want {
			t.Fatalf("after the kubelet restart the pod reads %s, wrote %s", got, want)
		}
		env.deletePod(t, ns, "p")
		env.pod(t, ns, podSpec{name: "q", claims: []string{"c"}})
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("next pod reads %s, wrote %s", got, want)
		}
	})

	t.Run("snapshot restored into a new claim", func(t *testing.T) {
		ns := env.namespace(t, "snapshot")
		env.claim(t, ns, claimSpec{name: "src", class: "shared-xfs", size: "300Mi"})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"src"}})
		want := strings.TrimSpace(env.mustExec(t, ns, "p", writeBlob))
		snap := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
			"metadata": map[string]any{"name": "snap", "namespace": ns},
			"spec":     map[string]any{"volumeSnapshotClassName": "shared", "source": map[string]any{"persistentVolumeClaimName": "src"}}}}
		if err := env.c.Applier().Apply(ctx, snap, false); err != nil {
			t.Fatal(err)
		}
		env.claim(t, ns, claimSpec{name: "restored", class: "shared-xfs", size: "300Mi", dataSource: "snap"})
		env.pod(t, ns, podSpec{name: "q", claims: []string{"restored"}})
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("restored claim reads %s, source had %s", got, want)
		}
	})

	t.Run("volume health reaches kubelet and the claim", func(t *testing.T) {
		ns := env.namespace(t, "health")
		env.claim(t, ns, claimSpec{name: "c", class: "shared-xfs", size: "300Mi"})
		env.pod(t, ns, podSpec{name: "p", claims: []string{"c"}})
		handle := env.volumeHandle(t, ns, "c")
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })

		// Filled past the 90 % threshold: abnormal for kubelet, a Warning on the pod.
		out := env.mustExec(t, ns, "p", "set -e; s=$(df -k /data | tail -1); total=$(echo $s | cut -d' ' -f2); used=$(echo $s | cut -d' ' -f3); "+
			"n=$(( (total*93/100 - used) / 1024 )); dd if=/dev/zero of=/data/fill bs=1M count=$n 2>&1 | tail -1; sync; df -k /data | tail -1")
		t.Logf("filled: %s", strings.TrimSpace(out))
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 1 })
		t.Logf("pod event: %s", env.waitEvent(t, ns, "Pod", "p", "VolumeConditionAbnormal", 60*time.Second))
		env.mustExec(t, ns, "p", "rm /data/fill && sync")
		env.waitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })

		// The backing image cut short on the pool: the controller sees it and puts an event
		// on the claim; the node too. Grown back: normal again.
		img := imagePath(t, sharedPoolPath, handle)
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
		// No pool is configured for shareSource: the controller mounts it, lays out a pool
		// there at the first CreateVolume, and the node plugin mounts it on demand at
		// NodeStageVolume, under the chart's shares.hostDir.
		if err := os.MkdirAll(shareSource, 0o755); err != nil {
			t.Fatal(err)
		}
		ns := env.namespace(t, "share")
		env.claim(t, ns, claimSpec{name: "c", class: "share-bind", size: "100Mi", rwx: true})
		env.pod(t, ns, podSpec{name: "w", claims: []string{"c"}})
		want := strings.TrimSpace(env.mustExec(t, ns, "w", writeBlob))
		if _, err := os.Stat(filepath.Join(shareSource, "pool.json")); err != nil {
			t.Fatalf("the driver laid out no pool on the share: %v", err)
		}
		if len(mountsUnder(sharesDir)) < 2 { // sharesDir itself, and the share below it
			t.Errorf("the node plugin's mount of the share is not under %s on the host", sharesDir)
		}
		env.deletePod(t, ns, "w")
		env.pod(t, ns, podSpec{name: "r", claims: []string{"c"}})
		if got := sum(t, env, ns, "r", "/data/blob"); got != want {
			t.Fatalf("data on the share: wrote %s, read %s", want, got)
		}
	})

	t.Run("every claim deleted leaves nothing behind", func(t *testing.T) {
		env.deleteAll(t)
		for _, m := range mountsUnder(KubeletDir) {
			if strings.Contains(m, "kubernetes.io~csi") || strings.Contains(m, "/plugins/kubernetes.io/csi/") {
				t.Errorf("a CSI mount is left: %s", m)
			}
		}
		for _, line := range ourLoops(KubeletDir, localPoolPath, sharedPoolPath) {
			t.Errorf("a loop device is left: %s", line)
		}
		for _, p := range []string{localPoolPath, sharedPoolPath, shareSource} {
			entries, _ := os.ReadDir(filepath.Join(p, "volumes"))
			for _, e := range entries {
				t.Errorf("pool %s still holds volume %s", p, e.Name())
			}
		}
	})
}

// ourLoops maps each loop device a node with kubelet's root at kubeletDir and the given
// pools may have attached to its losetup -a line: those backed by a volume image of one of
// the pools, and kubelet's own for block volumes (backed by a device file under its
// directory). Other tests on this machine have loop devices of their own, which are not
// ours to judge or detach. poolcsi attaches images through /proc/<pid>/fd paths inside its
// container, and once the container is gone the name is relative to the pool's
// filesystem, so the backing file's name does not show the pool: its device and inode
// numbers do (on btrfs each volume is a subvolume, with a device number of its own).
func ourLoops(kubeletDir string, pools ...string) map[string]string {
	images := map[string]bool{}
	for _, p := range pools {
		hits, _ := filepath.Glob(filepath.Join(p, "volumes", "*", "*.img"))
		for _, h := range hits {
			var st syscall.Stat_t
			if err := syscall.Stat(h, &st); err == nil {
				images[losetupFile(st.Dev, st.Ino)] = true
			}
		}
	}
	out, _ := exec.Command("losetup", "-a").Output()
	type loop struct{ dev, file, backing, line string }
	var loops []loop
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if dev, rest, ok := strings.Cut(line, ":"); ok {
			rest = strings.TrimSpace(rest)
			file, _, _ := strings.Cut(rest, " ")
			loops = append(loops, loop{dev, file, rest, line})
		}
	}
	m := map[string]string{}
	for _, l := range loops {
		mine := images[l.file]
		if kubeletDir != "" {
			mine = mine || strings.Contains(l.backing, "("+kubeletDir+"/")
		}
		if mine {
			m[l.dev] = l.line
		}
	}
	// Kubelet holds every block volume it maps with a loop device of its own over the
	// volume's device node. Once kubelet's bind mount of that node is gone, losetup shows
	// its backing file as "/" on /dev's filesystem: it is known by the device and inode of
	// one of ours.
	held := map[string]bool{}
	for dev := range m {
		var st syscall.Stat_t
		if err := syscall.Stat(dev, &st); err == nil {
			held[losetupFile(st.Dev, st.Ino)] = true
		}
	}
	for _, l := range loops {
		if held[l.file] {
			m[l.dev] = l.line
		}
	}
	return m
}

// losetupFile is how losetup -a names a backing file's filesystem device (the old way:
// major<<8 | minor) and, if ino is not 0, the file: "[0006]:99".
func losetupFile(dev, ino uint64) string {
	s := fmt.Sprintf("[%04d]:", unix.Major(dev)<<8|unix.Minor(dev))
	if ino != 0 {
		s += strconv.FormatUint(ino, 10)
	}
	return s
}
