package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

// The chart's default pool paths: the node is prepared as an administrator would, with a
// filesystem mounted at each, so the chart runs with image overrides only.
const (
	LocalPoolPath  = "/var/lib/poolcsi/pools/local"
	SharedPoolPath = "/mnt/poolcsi-shared"
	BusyboxRef     = LocalImagePrefix + "busybox:1"
	PoolcsiRef     = LocalImagePrefix + "poolcsi"
	PoolcsiTag     = "test"
)

// The chart's driver names and the topology key both register.
const (
	LocalDriver  = "local.poolcsi.io"
	SharedDriver = "poolcsi.io"
	TopologyKey  = "topology.poolcsi.io/node"
)

// Env is a cluster of real nodes on this machine running the chart as pods.
type Env struct {
	Cluster *Cluster
	Node    *Node   // the first node
	Nodes   []*Node // every node
	Poolcsi string  // host binary (pool init, inspection)
	Log     *EnvLog // what the environment made, for the next run to reclaim if this one is killed
	// LocalOnly: the chart runs the local driver only (no shared pool: no controller, no
	// shared driver to register)
	LocalOnly bool
	// Overrides are the chart values the environment renders this tree's chart with
	Overrides func() map[string]any
}

// ImageOverrides are the chart values that set the images: poolcsi's and the sidecars'
// (key: the chart's sidecars key), the ones imported into the nodes.
func ImageOverrides(sidecars map[string]string) map[string]any {
	sc := map[string]any{}
	for k, ref := range sidecars {
		sc[k] = map[string]any{"image": ref}
	}
	return map[string]any{"image": map[string]any{"repository": PoolcsiRef, "tag": PoolcsiTag}, "sidecars": sc}
}

// Release is an earlier release of poolcsi, built, that an environment installs instead of
// this tree's chart and image.
type Release struct {
	Tag      string // its image's tag (PoolcsiRef:Tag, imported on every node)
	Bin      string // its poolcsi, which also lays out the shared pool
	ChartDir string // its chart
	// Values turns this tree's environment values into the values of its chart.
	Values func(map[string]any) map[string]any
}

// EnvOptions change the environment StartEnv brings up.
type EnvOptions struct {
	// Extra images to import on every node
	Extra func(testing.TB) []Image
	// Values are chart values set beside the image overrides (top-level keys)
	Values map[string]any
	// Nodes: two nodes, node-a and node-b, each with its own mount namespace (kubelet's
	// root, its local pool and its shares), cgroup root and pod network; the shared pool
	// is one filesystem both mount. Zero: this machine is the one node.
	Nodes int
	// CephFS, with Nodes: the shared pool is a directory of test/support/cephfs's CephFS, each
	// node mounting it through a ceph-fuse client of its own; else a btrfs filesystem.
	CephFS bool
	// Defaults: the chart with its default values, only the images set (this machine has
	// no registry), on a node prepared with nothing, as docs/install.md promises: no
	// shared pool, no shares, the local pool a directory the chart makes on the node's
	// disk. Values, Nodes and CephFS are ignored.
	Defaults bool
	// Prev installs an earlier release instead of this tree's chart and image (see
	// TestUpgrade); the environment's overrides are still this tree's, for the upgrade.
	Prev *Release
}

// PerNodeLayout reports whether chart values turn the local pools' central controller off
// (localController.central false): the local driver's sidecars then run in every node pod.
func PerNodeLayout(values map[string]any) bool {
	lc, _ := values["localController"].(map[string]any)
	central, ok := lc["central"].(bool)
	return ok && !central
}

// snapshotControllerArgs: the cluster's snapshot-controller as it comes, for the chart's
// default layout, the local pools' central controller, whose csi-snapshotter takes every
// local snapshot. Only the per-node layout (localController.central false, or an earlier
// release that has it) needs distributed snapshotting: each node's csi-snapshotter-local
// sees only the contents labelled with its node.
func snapshotControllerArgs(c *Cluster, opts EnvOptions) []string {
	args := []string{"--kubeconfig=" + c.AdminKube, "--retry-interval-max=5s", "--v=2"}
	if opts.Prev != nil || (!opts.Defaults && PerNodeLayout(opts.Values)) {
		args = append(args, "--enable-distributed-snapshotting")
	}
	return args
}

// StartEnv brings up the control plane, its nodes (a real kubelet each) and the chart,
// rendered with image overrides and opts's values, applied as it is; it returns once the
// drivers are registered with kubelet on every node. It holds the environment lock
// (LockKubeletEnv) until its last cleanup, and undoes everything when the test ends.
func StartEnv(t testing.TB, opts EnvOptions) *Env {
	t.Helper()
	extra, values := opts.Extra, opts.Values
	RequireCommands(t, "mkfs.xfs", "mkfs.ext4", "mkfs.btrfs")
	if opts.Nodes > 1 {
		RequireCommands(t, "unshare", "nsenter")
	}
	// The lock first: it reclaims what a killed environment left, which requireNode would
	// otherwise refuse.
	log := LockKubeletEnv(t)
	requireNode(t)
	for _, p := range []string{LocalPoolPath, SharedPoolPath} {
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
	InstallSnapshotCRDs(t, c)
	c.Start(t, "snapshot-controller", tools.SnapshotController.Path(t), nil, snapshotControllerArgs(c, opts)...).MustRun(t)

	bin := BuildPoolcsi(t, dir)
	pause := buildPause(t, dir)
	images := []Image{
		BinaryImage(pauseImage, pause),
		BinaryImage("poolcsi.test/pause:3.10.2", pause), // e2e.test's own pause image
		BusyboxImage(t, BusyboxRef),
		PoolcsiImage(t, PoolcsiRef+":"+PoolcsiTag, bin),
	}
	if extra != nil {
		images = append(images, extra(t)...)
	}
	sidecars := map[string]string{}
	for key, tl := range map[string]tools.Tool{"provisioner": tools.Provisioner, "attacher": tools.Attacher, "resizer": tools.Resizer, "snapshotter": tools.Snapshotter} {
		ref := LocalImagePrefix + tl.Name + ":" + tl.Version
		images = append(images, BinaryImage(ref, tl.Path(t)))
		sidecars[key] = ref
	}
	if opts.Defaults {
		return startDefaultEnv(t, c, log, ip, bin, images, ImageOverrides(sidecars), total)
	}
	if opts.Prev != nil {
		images = append(images, PoolcsiImage(t, PoolcsiRef+":"+opts.Prev.Tag, opts.Prev.Bin))
	}
	// The chart values of this environment, fresh each call.
	envOverrides := func() map[string]any {
		overrides := ImageOverrides(sidecars)
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
		overrides["shares"] = map[string]any{"enabled": true, "hostDir": SharesDir,
			"types": []any{"bind", "nfs", "nfs4", "ceph", "fuse.ceph"}}
		return overrides
	}
	overrides, chartDir := envOverrides(), chart.ChartDir()
	if opts.Prev != nil {
		overrides, chartDir = opts.Prev.Values(envOverrides()), opts.Prev.ChartDir
	}

	// Pools: xfs for the local one, btrfs for the shared one (dir volumes get btrfs quota
	// groups); the shared pool is laid out once with `poolcsi pool init`, as docs/pools.md
	// tells an administrator. Both are sparse files of 16 GiB: poolcsi admits a volume against
	// what it has promised, not what is written, and the storage e2e suite runs three specs at
	// once, each growing 1 GiB claims to 2 GiB (a 4 GiB shared pool refused the third with
	// RESOURCE_EXHAUSTED, rightly).
	if opts.Nodes <= 1 {
		log.NoteMount(t, LocalPoolPath)
		MountPoolFS(t, nil, LocalPoolPath, "xfs", 16<<30)
	}
	var sharedSrc []string // each node's mount of the shared pool, when it is not SharedPoolPath
	if opts.CephFS {
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
		log.NoteMount(t, SharedPoolPath)
		MountPoolFS(t, nil, SharedPoolPath, "btrfs", 16<<30)
		// Dir volumes get a size limit only where the administrator turned quota on
		// (docs/pools.md, "Quota is the admin's decision").
		if out, err := exec.Command("btrfs", "quota", "enable", SharedPoolPath).CombinedOutput(); err != nil {
			t.Fatalf("btrfs quota enable: %v\n%s", err, out)
		}
		initBin := bin // an upgrade starts from the pool the earlier release laid out
		if opts.Prev != nil {
			initBin = opts.Prev.Bin
		}
		if out, err := exec.Command(initBin, "pool", "init", "--path", SharedPoolPath, "--name", "shared").CombinedOutput(); err != nil {
			t.Fatalf("poolcsi pool init: %v\n%s", err, out)
		}
	}

	if opts.Nodes <= 1 {
		log.NoteMount(t, SharesDir)
		SharedBindMount(t, nil, SharesDir, "")
	}

	// Last resort, after the node is gone and before the pools are unmounted: a loop device
	// the test run left (a failure before the claims were deleted) keeps a pool busy.
	t.Cleanup(func() {
		for dev, line := range OurLoops(KubeletDir, LocalPoolPath, SharedPoolPath) {
			t.Errorf("detaching a loop device left behind: %s", line)
			_, _ = detachLoop(dev)
		}
	})
	var nodes []*Node
	if opts.Nodes <= 1 {
		nodes = []*Node{StartNode(t, c, ip, images)}
	} else {
		nodes = startNodes(t, c, log, ip, images, sharedSrc)
	}
	for _, n := range nodes {
		t.Logf("node %s Ready after %s", n.Name, time.Since(total).Round(time.Second))
	}
	env := &Env{Cluster: c, Node: nodes[0], Nodes: nodes, Poolcsi: bin, Log: log, Overrides: envOverrides}

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
	env.ApplyChart(t, docs)
	// Graceful teardown first (runs before the node stops): claims deleted, pods gone, the
	// driver has unpublished, unstaged and deleted every volume.
	t.Cleanup(func() { env.DeleteAll(t) })
	env.WaitChartReady(t)
	t.Logf("chart running as pods after %s", time.Since(total).Round(time.Second))
	return env
}

// ApplyChart applies a rendered chart as helm install or helm upgrade does: each object
// server-side applied into the release's namespace.
func (e *Env) ApplyChart(t testing.TB, docs []chart.Doc) {
	t.Helper()
	ap := e.Cluster.Applier()
	for _, d := range docs {
		objs, err := ParseObjects([]byte(d.YAML))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if o.GetNamespace() == "" && o.GetKind() != "Namespace" && IsNamespaced(o) {
				o.SetNamespace(chart.Namespace)
			}
			if err := ap.Apply(context.Background(), o, false); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// IsNamespaced reports whether an object of the chart's kinds lives in a namespace.
func IsNamespaced(o *unstructured.Unstructured) bool {
	switch o.GetKind() {
	case "ClusterRole", "ClusterRoleBinding", "CSIDriver", "StorageClass", "VolumeSnapshotClass", "Namespace", "PriorityClass":
		return false
	}
	return true
}

// MountPoolFS formats a sparse image and mounts it at path (loop, autoclear) on node n (nil:
// this machine), undone when the test ends.
func MountPoolFS(t testing.TB, n *Node, path, fsType string, size int64) {
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
	if out, err := n.Command("mount", "-o", "loop", img, path).CombinedOutput(); err != nil {
		t.Fatalf("mount %s: %v\n%s", path, err, out)
	}
	// The chart mounts pools into its containers with HostToContainer or Bidirectional
	// propagation, which containerd refuses on a private mount ("is mounted on ... but it
	// is not a shared or slave mount"). systemd makes every mount shared; this machine's
	// init does not.
	if out, err := n.Command("mount", "--make-shared", path).CombinedOutput(); err != nil {
		t.Fatalf("mount --make-shared %s: %v\n%s", path, err, out)
	}
	t.Cleanup(func() {
		if out, err := n.Command("umount", path).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v %s (still in use: a volume of the test was left behind)", path, err, out)
			_ = n.Command("umount", "-l", path).Run()
		}
		// On a node, the mount point is every node's: startNodes removes it.
		if created && n == nil {
			_ = os.Remove(path)
			_ = os.Remove(filepath.Dir(path)) // /var/lib/poolcsi/pools, if empty
			_ = os.Remove(filepath.Dir(filepath.Dir(path)))
		}
	})
}

// ShareSource is the share the share-bind StorageClass names.
const ShareSource = SharedPoolPath + "/share-src"

// SharesDir is the chart's shares.hostDir, where the shared driver's node plugin mounts the
// shares StorageClasses name.
const SharesDir = "/var/lib/poolcsi/shares"

// SharedBindMount makes path a mount point of its own with shared propagation on node n
// (nil: this machine): the chart mounts it into the node plugin with Bidirectional
// propagation, which containerd refuses below a private mount, and this machine's / is
// private (systemd makes it shared). src, if set, is the directory mounted there instead
// of path itself (a node's own, on a node with OwnMounts).
func SharedBindMount(t testing.TB, n *Node, path, src string) {
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
		if out, err := n.Command("mount", args...).CombinedOutput(); err != nil {
			t.Fatalf("mount %v: %v\n%s", args, err, out)
		}
	}
	t.Cleanup(func() {
		if out, err := n.Command("umount", "-R", path).CombinedOutput(); err != nil {
			t.Errorf("umount -R %s: %v %s", path, err, out)
			_ = n.Command("umount", "-R", "-l", path).Run()
		}
		if src != path {
			return // the node's own directory goes with the node's
		}
		// The bind mount is the directory itself, so what the driver wrote there (a
		// mount point and a record per share) stays on the host's disk: remove it, once
		// nothing is mounted below it any more.
		if left := MountsUnder(path); len(left) > 0 {
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
	cmd := tools.Nice(t.Context(), GoBin(), "build", "-o", bin, "./cmd/pause")
	cmd.Dir = filepath.Join(chart.RepoRoot(), "test", "k8s")
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/pause: %v\n%s", err, out)
	}
	return bin
}

// WaitChartReady waits for every pod of the release to be Ready and for kubelet to list
// both drivers in the node's CSINode, registered by poolcsi itself.
func (e *Env) WaitChartReady(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	WaitFor(t, 180*time.Second, "the chart's pods Ready", func() error {
		pods, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		want := 2 + len(e.Nodes) // the node DaemonSet's pods and two controller replicas
		if e.LocalOnly {
			want = len(e.Nodes)
		}
		if len(pods.Items) < want {
			return fmt.Errorf("%d pods", len(pods.Items))
		}
		for _, p := range pods.Items {
			if !PodReady(&p) {
				return fmt.Errorf("pod %s not ready: %s", p.Name, PodSummary(&p))
			}
		}
		return nil
	})
	for _, n := range e.Nodes {
		WaitFor(t, 60*time.Second, "CSINode of "+n.Name+" with both drivers", func() error {
			cn, err := e.Cluster.Client.StorageV1().CSINodes().Get(ctx, n.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			found := map[string]bool{}
			for _, d := range cn.Spec.Drivers {
				if len(d.TopologyKeys) != 1 || d.TopologyKeys[0] != TopologyKey || d.NodeID != n.Name {
					return fmt.Errorf("driver %s registered as node %q with topology keys %v", d.Name, d.NodeID, d.TopologyKeys)
				}
				found[d.Name] = true
			}
			if !found[LocalDriver] || (!found[SharedDriver] && !e.LocalOnly) {
				return fmt.Errorf("CSINode lists %v", cn.Spec.Drivers)
			}
			return nil
		})
	}
}

// PodReady reports whether the pod's Ready condition is true.
func PodReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// PodSummary is the pod's phase, its conditions that are not true and its containers'
// waiting or terminated states, for a failure message.
func PodSummary(p *corev1.Pod) string {
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

// DeleteAll deletes every test namespace's pods and claims and waits until no PV is left.
func (e *Env) DeleteAll(t testing.TB) {
	ctx := context.Background()
	nss, err := e.Cluster.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
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
		_ = e.Cluster.Client.CoreV1().Namespaces().Delete(ctx, ns.Name, metav1.DeleteOptions{})
	}
	deadline := time.Now().Add(120 * time.Second)
	for time.Now().Before(deadline) {
		pvs, err := e.Cluster.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err == nil && len(pvs.Items) == 0 {
			return
		}
		time.Sleep(time.Second)
	}
	t.Errorf("PersistentVolumes left 120 s after their claims were deleted")
}

// Namespace creates a test namespace, deleted with everything in it by DeleteAll.
func (e *Env) Namespace(t testing.TB, name string) string {
	t.Helper()
	_, err := e.Cluster.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: name, Labels: map[string]string{"poolcsi-test": "true"}}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	return name
}

// Exec runs a shell command in a pod's first container through the API server and
// kubelet's streaming server, as kubectl exec does.
func (e *Env) Exec(t testing.TB, ns, pod, script string) (string, error) {
	t.Helper()
	return e.ExecIn(t, ns, pod, "", "sh", "-c", script)
}

// ExecIn runs a command in the named container ("": the first).
func (e *Env) ExecIn(t testing.TB, ns, pod, container string, command ...string) (string, error) {
	t.Helper()
	req := e.Cluster.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ex, err := remotecommand.NewSPDYExecutor(e.Cluster.Config, "POST", req.URL())
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

// MustExec is Exec, failing the test on an error.
func (e *Env) MustExec(t testing.TB, ns, pod, script string) string {
	t.Helper()
	out, err := e.Exec(t, ns, pod, script)
	if err != nil {
		t.Fatalf("exec in %s/%s: %q: %v\n%s", ns, pod, script, err, out)
	}
	return out
}

// Events lists the events of one object, one per line.
func (e *Env) Events(ns, name string) string {
	evs, err := e.Cluster.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return ""
	}
	var b strings.Builder
	for _, ev := range evs.Items {
		fmt.Fprintf(&b, "\n  event %s %s: %s", ev.Type, ev.Reason, ev.Message)
	}
	return b.String()
}

// DeletePod deletes a pod and waits until it is gone: kubelet has unpublished its volumes.
func (e *Env) DeletePod(t testing.TB, ns, name string) {
	t.Helper()
	ctx := context.Background()
	if err := e.Cluster.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	WaitFor(t, 120*time.Second, "pod "+ns+"/"+name+" gone", func() error {
		_, err := e.Cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("still there (%w)", err)
	})
}

// startDefaultEnv is the rest of StartEnv for EnvOptions.Defaults: the node is prepared
// with nothing (the local pool's directory is the chart's to make, on the node's disk) and
// the chart is rendered with overrides, which hold the images and nothing else.
func startDefaultEnv(t testing.TB, c *Cluster, log *EnvLog, ip, bin string, images []Image, overrides map[string]any, total time.Time) *Env {
	t.Helper()
	for k := range overrides {
		if k != "image" && k != "sidecars" {
			t.Fatalf("the default install sets %q: only the images may differ from the chart's defaults", k)
		}
	}
	// Nothing is prepared but what systemd gives every node: a shared root mount (the
	// chart mounts the pool into the node plugin with Bidirectional propagation, which
	// containerd refuses below a private mount, and this machine's / is private). The pool
	// directory is bind-mounted onto itself with shared propagation, on the same
	// filesystem as /: no filesystem of its own.
	log.NoteMount(t, LocalPoolPath)
	SharedBindMount(t, nil, LocalPoolPath, "")
	t.Cleanup(func() {
		for dev, line := range OurLoops(KubeletDir, LocalPoolPath) {
			t.Errorf("detaching a loop device left behind: %s", line)
			_, _ = detachLoop(dev)
		}
	})
	n := StartNode(t, c, ip, images)
	t.Logf("node %s Ready after %s", n.Name, time.Since(total).Round(time.Second))
	env := &Env{Cluster: c, Node: n, Nodes: []*Node{n}, Poolcsi: bin, Log: log, LocalOnly: true}
	docs, err := chart.Render(chart.ChartDir(), "", overrides)
	if err != nil {
		t.Fatal(err)
	}
	// helm install --create-namespace
	if _, err := c.Client.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chart.Namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	env.ApplyChart(t, docs)
	t.Cleanup(func() { env.DeleteAll(t) })
	env.WaitChartReady(t)
	t.Logf("chart running as pods after %s", time.Since(total).Round(time.Second))
	return env
}

// BuildPoolcsi builds ./cmd/poolcsi of this checkout into dir (POOLCSI_BIN, if set, is
// used instead) and returns the binary's path.
func BuildPoolcsi(t testing.TB, dir string) string {
	if p := os.Getenv("POOLCSI_BIN"); p != "" {
		return p
	}
	bin := filepath.Join(dir, "poolcsi")
	cmd := tools.Nice(t.Context(), GoBin(), "build", "-o", bin, "./cmd/poolcsi")
	cmd.Dir = chart.RepoRoot()
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	start := time.Now()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/poolcsi in %s: %v\n%s", cmd.Dir, err, out)
	}
	t.Logf("built poolcsi in %s", time.Since(start).Round(time.Second))
	return bin
}
