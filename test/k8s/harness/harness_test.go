package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

const (
	ns = chart.Namespace
)

var handleRE = regexp.MustCompile(`^([a-z0-9][a-z0-9_-]*)\.([0-9a-f]{32})$`)

// TestTools builds (or finds in the cache) every component binary, so that a build
// failure is reported on its own, with the time it took.
func TestTools(t *testing.T) { buildTools(t, tools.All) }

// TestE2ETools does the same for the storage e2e suite's binaries (make e2e, make
// conformance), which make test does not build.
func TestE2ETools(t *testing.T) { buildTools(t, tools.ForE2E) }

func buildTools(t *testing.T, list []tools.Tool) {
	for _, tl := range list {
		start := time.Now()
		bin := tl.Path(t)
		t.Logf("%-24s %-8s ready in %5s: %s", tl.Name, tl.Version, time.Since(start).Round(time.Millisecond), bin)
	}
}

// driver is one poolcsi serve process and a CSI client on its socket.
type driver struct {
	proc *cluster.Proc
	sock string
	conn *grpc.ClientConn
}

func (d *driver) controller() csi.ControllerClient { return csi.NewControllerClient(d.conn) }

// startDriver runs `poolcsi serve` with the args the chart gives the container, pointed at
// a socket, config file and pool directories under dir.
func startDriver(t *testing.T, c *cluster.Cluster, bin string, rendered []*unstructured.Unstructured, name, kind, workload, container, configKey, nodeID, kubeconfig string, pools map[string]string) *driver {
	t.Helper()
	obj := cluster.FindObject(rendered, kind, workload)
	if obj == nil {
		t.Fatalf("rendered manifests have no %s %s", kind, workload)
	}
	args, err := cluster.ContainerArgs(obj, container)
	if err != nil {
		t.Fatal(err)
	}
	cm := cluster.FindObject(rendered, "ConfigMap", "poolcsi-config")
	if cm == nil {
		t.Fatal("rendered manifests have no ConfigMap poolcsi-config")
	}
	cfg, _, _ := unstructured.NestedString(cm.Object, "data", configKey)
	for from, to := range pools {
		if !strings.Contains(cfg, "path: "+from+"\n") {
			t.Fatalf("ConfigMap key %s has no pool path %s:\n%s", configKey, from, cfg)
		}
		cfg = strings.ReplaceAll(cfg, "path: "+from+"\n", "path: "+to+"\n")
		if err := os.MkdirAll(to, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cfgFile := filepath.Join(c.Dir, name+"-"+configKey)
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(c.Dir, name+".sock")
	// The cluster's directory stands in for kubelet's: staging paths are made there.
	// No kubelet here: registration and /healthz are the kubelet tests' business.
	for _, a := range args {
		if strings.HasPrefix(a, "--pvc-events-interval=") {
			// Claims' health events, through the chart's service account, every second.
			args = cluster.RewriteArgs(args, []string{"--pvc-events-interval"}, "--pvc-events-interval=1s", "--kubeconfig="+kubeconfig)
			break
		}
		if a == "--claim-local-snapshots" {
			// Through the node's service account, as in the chart.
			args = append(args, "--kubeconfig="+kubeconfig)
			break
		}
	}
	// The share key the chart mounts from its Secret, as a file of the cluster's directory.
	keyFile := filepath.Join(c.Dir, "share-key")
	if err := os.WriteFile(keyFile, []byte("the test cluster's share key, 32 bytes or more\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	args = cluster.RewriteArgs(args, []string{"--endpoint", "--node-id", "--config", "--metrics-address", "--allowed-path-prefix",
		"--registration-dir", "--kubelet-registration-path", "--healthz-address", "--share-key-file"},
		"--endpoint=unix://"+sock, "--node-id="+nodeID, "--config="+cfgFile, "--allowed-path-prefix="+filepath.Clean(c.Dir),
		"--metrics-address=127.0.0.1:"+strconv.Itoa(cluster.FreePort(t)), "--share-key-file="+keyFile)
	for i, a := range args {
		if strings.HasPrefix(a, "-v=") {
			args[i] = "-v=5"
		}
	}
	args = checkServeFlags(t, bin, args)
	t.Logf("%s: poolcsi %s\n%s", name, strings.Join(args, " "), cfg)
	p := c.Start(t, name, bin, nil, args...)
	d := &driver{proc: p, sock: sock}
	cluster.WaitFor(t, 30*time.Second, name+" socket", func() error {
		p.MustRun(t)
		_, err := os.Stat(sock)
		return err
	})
	d.conn, err = grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.conn.Close() })
	cluster.WaitFor(t, 30*time.Second, name+" Probe", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := csi.NewIdentityClient(d.conn).Probe(ctx, &csi.ProbeRequest{})
		return err
	})
	return d
}

var helpFlagRE = regexp.MustCompile(`(?m)^\s+-{1,2}([A-Za-z0-9_-]+)`)

// checkServeFlags reports (as a test error, not a skip) every flag the chart passes that
// `poolcsi serve` does not define, and drops it so that the rest can still be verified.
func checkServeFlags(t *testing.T, bin string, args []string) []string {
	t.Helper()
	out, _ := exec.Command(bin, "serve", "--help").CombinedOutput()
	defined := map[string]bool{}
	for _, m := range helpFlagRE.FindAllStringSubmatch(string(out), -1) {
		defined[m[1]] = true
	}
	if len(defined) == 0 {
		t.Fatalf("poolcsi serve --help lists no flags:\n%s", out)
	}
	var keep []string
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			name := strings.TrimLeft(strings.SplitN(a, "=", 2)[0], "-")
			if !defined[name] {
				t.Errorf("the chart passes %s to poolcsi serve, which does not define -%s: the pod would crash-loop "+
					"(running on without it to check the rest)", a, name)
				continue
			}
		}
		keep = append(keep, a)
	}
	return keep
}

// startSidecar runs a real sidecar with the args the chart gives it, minus what only makes
// sense in a pod (leader election, HTTP endpoint, capacity objects owned by the pod).
func startSidecar(t *testing.T, c *cluster.Cluster, bin, name string, obj *unstructured.Unstructured, container, sock, kubeconfig string, env []string, extra ...string) *cluster.Proc {
	t.Helper()
	args, err := cluster.ContainerArgs(obj, container)
	if err != nil {
		t.Fatal(err)
	}
	args = cluster.RewriteArgs(args, []string{"--csi-address", "--leader-election", "--leader-election-namespace", "--http-endpoint",
		"--enable-capacity", "--capacity-ownerref-level", "--v"},
		append([]string{"--csi-address=" + sock, "--kubeconfig=" + kubeconfig, "--v=5"}, extra...)...)
	t.Logf("%s: %s %s", name, filepath.Base(bin), strings.Join(args, " "))
	p := c.Start(t, name, bin, env, args...)
	time.Sleep(time.Second)
	p.MustRun(t)
	return p
}

func tokenKubeconfig(t *testing.T, c *cluster.Cluster, sa string) string {
	t.Helper()
	exp := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), sa,
		&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for service account %s/%s: %v", ns, sa, err)
	}
	path, err := c.WriteKubeconfig(sa, tr.Status.Token)
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// TestKubernetes drives poolcsi with the real control plane and the real sidecars.
func TestKubernetes(t *testing.T) {
	cluster.RequireRoot(t)
	cluster.RequireCommands(t, "mkfs.ext4", "mkfs.xfs")
	total := time.Now()
	dir := t.TempDir()
	if keep := os.Getenv("POOLCSI_K8S_KEEP"); keep != "" {
		dir = keep
		_ = os.MkdirAll(dir, 0o755)
	}
	ctx := context.Background()

	c := cluster.StartCluster(t, dir)
	t.Logf("control plane up at %s after %s", c.APIServer, time.Since(total).Round(time.Second))
	// The cluster's snapshot CRDs, as an admin installs them before any snapshotter.
	cluster.InstallSnapshotCRDs(t, c)
	poolcsi := cluster.BuildPoolcsi(t, dir)
	provisioner, attacher, resizer := tools.Provisioner.Path(t), tools.Attacher.Path(t), tools.Resizer.Path(t)
	snapshotter, snapshotController := tools.Snapshotter.Path(t), tools.SnapshotController.Path(t)
	snapVariant := snapshotVariant(t)

	// The plain YAML installs the local pool only (the chart's defaults); this test drives
	// both drivers, so it runs the plain YAML's values plus the shared pool, which an
	// operator opts into. The plain YAML itself is dry-run below as well. The drivers run
	// as processes in the per-node layout (localController.central false), its sidecars
	// each talking to one node's local driver; the central layout, the default, is
	// TestKubelet's and TestTwoNodes's.
	renderedBytes, err := os.ReadFile(chart.RenderedFile())
	if err != nil {
		t.Fatal(err)
	}
	plain, err := cluster.ParseObjects(renderedBytes)
	if err != nil {
		t.Fatal(err)
	}
	sharedDocs, err := chart.Render(chart.ChartDir(), chart.RenderedValues(), perNodeValues(chart.SharedPoolValues()))
	if err != nil {
		t.Fatal(err)
	}
	rendered, err := cluster.ParseObjects(chart.Join(sharedDocs))
	if err != nil {
		t.Fatal(err)
	}
	examples, err := filepath.Glob(filepath.Join(chart.RepoRoot(), "deploy", "examples", "*.yaml"))
	if err != nil || len(examples) == 0 {
		t.Fatalf("no deploy/examples/*.yaml (%v)", err)
	}
	var exampleObjs []*unstructured.Unstructured
	for _, f := range examples {
		objs, err := cluster.ParseFile(f)
		if err != nil {
			t.Fatal(err)
		}
		exampleObjs = append(exampleObjs, objs...)
	}
	ap := c.Applier()

	t.Run("chart objects pass server-side dry-run", func(t *testing.T) {
		// The namespace must exist for namespaced objects to be dry-run into it.
		if ns := cluster.FindObject(rendered, "Namespace", chart.Namespace); ns == nil {
			t.Fatalf("rendered YAML has no Namespace %s", chart.Namespace)
		} else if err := ap.Apply(ctx, ns, false); err != nil {
			t.Fatal(err)
		}
		all := append([]*unstructured.Unstructured{}, plain...)
		all = append(all, rendered...)
		all = append(all, exampleObjs...)
		// The chart's optional StorageClasses too.
		optional := chart.SharedPoolValues()
		for k, v := range map[string]any{"storageClasses": []any{
			map[string]any{"name": "sc-local", "pool": "local", "fsType": "xfs", "default": true},
			map[string]any{"name": "sc-shared-dir", "pool": "shared", "layout": "dir", "shared": true, "mountOptions": []any{"noatime"}},
		}, "volumeAttributesClasses": []any{
			map[string]any{"name": "vac-shared", "shared": true, "parameters": map[string]any{"writeBytesPerSecond": "20Mi", "readIOPS": "500"}},
			map[string]any{"name": "vac-local", "parameters": map[string]any{"preallocate": "true"}},
		}, "groupSnapshotClass": map[string]any{"create": true}} {
			optional[k] = v
		}
		docs, err := chart.Render(chart.ChartDir(), chart.RenderedValues(), optional)
		if err != nil {
			t.Fatal(err)
		}
		// The snapshot variant: VolumeSnapshotClasses (need the CRDs, so not in the plain
		// YAML) and the DaemonSet and node RBAC with csi-snapshotter-local.
		for _, o := range snapVariant {
			switch {
			case o.GetKind() == "VolumeSnapshotClass",
				o.GetKind() == "DaemonSet" && o.GetName() == "poolcsi-node",
				o.GetKind() == "ClusterRole" && o.GetName() == "poolcsi-node":
				all = append(all, o)
			}
		}
		for _, d := range docs {
			switch d.Kind {
			case "StorageClass", "VolumeAttributesClass", "VolumeGroupSnapshotClass":
				objs, err := cluster.ParseObjects([]byte(d.YAML))
				if err != nil {
					t.Fatal(err)
				}
				all = append(all, objs...)
			}
		}
		for _, o := range all {
			if err := ap.Apply(ctx, o, true); err != nil {
				t.Errorf("rejected by kube-apiserver: %v", err)
			} else {
				t.Logf("accepted: %s %s", o.GetKind(), o.GetName())
			}
		}
	})
	if t.Failed() {
		t.FailNow()
	}

	// Install for real what a driver needs from the API: its identity objects, RBAC and the
	// example StorageClasses. The sidecars then run with the chart's service accounts, so a
	// missing RBAC rule fails the test.
	for _, o := range append(append([]*unstructured.Unstructured{}, rendered...), exampleObjs...) {
		switch o.GetKind() {
		case "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "CSIDriver", "ConfigMap", "StorageClass":
			if err := ap.Apply(ctx, o, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	// From the snapshot variant: the VolumeSnapshotClasses, and the node ClusterRole with
	// csi-snapshotter-local's rules (a superset of the plain YAML's).
	for _, o := range snapVariant {
		if o.GetKind() == "VolumeSnapshotClass" || (o.GetKind() == "ClusterRole" && o.GetName() == "poolcsi-node") {
			if err := ap.Apply(ctx, o, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	nodeKube := tokenKubeconfig(t, c, "poolcsi-node")
	ctrlKube := tokenKubeconfig(t, c, "poolcsi-controller")

	// Two nodes, registered as kubelet and node-driver-registrar would.
	for _, n := range []string{"node-1", "node-2"} {
		if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{
			Name: n, Labels: map[string]string{"kubernetes.io/hostname": n, cluster.TopologyKey: n}}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		var drivers []storagev1.CSINodeDriver
		for _, d := range []string{cluster.LocalDriver, cluster.SharedDriver} {
			drivers = append(drivers, storagev1.CSINodeDriver{Name: d, NodeID: n, TopologyKeys: []string{cluster.TopologyKey}})
		}
		if _, err := c.Client.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: n},
			Spec: storagev1.CSINodeSpec{Drivers: drivers}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	ds := cluster.FindObject(rendered, "DaemonSet", "poolcsi-node")
	dep := cluster.FindObject(rendered, "Deployment", "poolcsi-controller")
	if ds == nil || dep == nil {
		t.Fatal("rendered YAML lacks DaemonSet poolcsi-node or Deployment poolcsi-controller")
	}
	sharedPool := map[string]string{"/mnt/poolcsi-shared": filepath.Join(dir, "pools", "shared")}
	// The operator's one step for an admin-mounted shared pool (docs/pools.md): the
	// driver never lays out a share by itself.
	if err := os.MkdirAll(sharedPool["/mnt/poolcsi-shared"], 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(poolcsi, "pool", "init", "--path", sharedPool["/mnt/poolcsi-shared"], "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}
	// The local driver as the chart runs it with snapshots.local (--claim-local-snapshots),
	// beside that variant's csi-snapshotter-local below.
	local := startDriver(t, c, poolcsi, snapVariant, "poolcsi-local-node-1", "DaemonSet", "poolcsi-node", "poolcsi-local", "local.yaml", "node-1", nodeKube,
		map[string]string{"/var/lib/poolcsi/pools/local": filepath.Join(dir, "pools", "node-1-local")})
	shared := startDriver(t, c, poolcsi, rendered, "poolcsi-controller", "Deployment", "poolcsi-controller", "poolcsi", "shared.yaml", "controller", ctrlKube, sharedPool)
	// The shared driver's node plugins on both nodes: they register the nodes with the
	// shared pool, which ControllerPublishVolume checks.
	for _, n := range []string{"node-1", "node-2"} {
		startDriver(t, c, poolcsi, rendered, "poolcsi-shared-"+n, "DaemonSet", "poolcsi-node", "poolcsi", "shared.yaml", n, nodeKube, sharedPool)
	}
	localProvisioner := startSidecar(t, c, provisioner, "csi-provisioner-local", ds, "csi-provisioner-local", local.sock, nodeKube,
		[]string{"NODE_NAME=node-1"}, "--retry-interval-max=5s")
	sharedProvisioner := startSidecar(t, c, provisioner, "csi-provisioner", dep, "csi-provisioner", shared.sock, ctrlKube, nil, "--retry-interval-max=5s")
	startSidecar(t, c, attacher, "csi-attacher", dep, "csi-attacher", shared.sock, ctrlKube, nil, "--retry-interval-max=5s")
	sharedResizer := startSidecar(t, c, resizer, "csi-resizer", dep, "csi-resizer", shared.sock, ctrlKube, nil, "--retry-interval-max=5s")
	// One leader-elected csi-resizer-local serves the whole cluster; here it talks to
	// node-1's local driver, as it would on whichever node holds the lease.
	localResizer := startSidecar(t, c, resizer, "csi-resizer-local", ds, "csi-resizer-local", local.sock, nodeKube, nil, "--retry-interval-max=5s")
	// The cluster's common snapshot controller (not part of the chart; an admin's, hence the
	// admin credentials, like kube-controller-manager), with distributed snapshotting so
	// that local snapshots reach their node's csi-snapshotter-local: the per-node layout
	// needs it (cluster.StartEnv starts it without, for the central one).
	c.Start(t, "snapshot-controller", snapshotController, nil, "--kubeconfig="+c.AdminKube,
		"--enable-distributed-snapshotting", "--retry-interval-max=5s", "--v=4").MustRun(t)
	sharedSnapshotter := startSidecar(t, c, snapshotter, "csi-snapshotter", dep, "csi-snapshotter", shared.sock, ctrlKube, nil, "--retry-interval-max=5s")
	snapDS := cluster.FindObject(snapVariant, "DaemonSet", "poolcsi-node")
	if snapDS == nil {
		t.Fatal("the snapshot variant of the chart has no DaemonSet poolcsi-node")
	}
	localSnapshotter := startSidecar(t, c, snapshotter, "csi-snapshotter-local", snapDS, "csi-snapshotter-local", local.sock, nodeKube,
		[]string{"NODE_NAME=node-1"}, "--retry-interval-max=5s")
	t.Logf("poolcsi and sidecars up after %s", time.Since(total).Round(time.Second))

	t.Run("local PVC provisioned by csi-provisioner on its node", func(t *testing.T) {
		size := resource.MustParse("96Mi")
		pvc := newPVC("local-claim", "poolcsi-local-image", size, corev1.ReadWriteOnce)
		// WaitForFirstConsumer: the scheduler would put its choice here.
		pvc.Annotations = map[string]string{"volume.kubernetes.io/selected-node": "node-1"}
		pv := provision(t, c, pvc)
		checkPV(t, pv, cluster.LocalDriver, "local", size, true)
		terms := pv.Spec.NodeAffinity
		if terms == nil || terms.Required == nil || len(terms.Required.NodeSelectorTerms) == 0 {
			t.Fatalf("PV %s has no node affinity; want %s=node-1", pv.Name, cluster.TopologyKey)
		}
		found := false
		for _, term := range terms.Required.NodeSelectorTerms {
			for _, e := range term.MatchExpressions {
				if e.Key == cluster.TopologyKey && len(e.Values) == 1 && e.Values[0] == "node-1" {
					found = true
				}
			}
		}
		if !found {
			t.Fatalf("PV %s node affinity %+v lacks %s In [node-1]", pv.Name, terms.Required, cluster.TopologyKey)
		}
		handle := pv.Spec.CSI.VolumeHandle
		if !listHas(t, local, handle) {
			t.Fatalf("poolcsi ListVolumes does not know the PV's volume handle %s", handle)
		}
		t.Logf("PV %s: %s, node affinity %s=node-1, handle %s known to ListVolumes", pv.Name, pv.Spec.Capacity.Storage(), cluster.TopologyKey, handle)
		deleteClaim(t, c, pvc.Name, pv.Name)
		cluster.WaitFor(t, 60*time.Second, "volume "+handle+" gone from ListVolumes", func() error {
			if listHas(t, local, handle) {
				return fmt.Errorf("still listed")
			}
			return nil
		})
		checkGoneFromPool(t, filepath.Join(dir, "pools", "node-1-local"), handle)
	})

	t.Run("VolumeAttachment attached by csi-attacher with the read-write fence", func(t *testing.T) {
		caps, err := shared.controller().ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		publish := false
		for _, cp := range caps.GetCapabilities() {
			if cp.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME {
				publish = true
			}
		}
		if !publish {
			t.Log("NOTE: poolcsi does not advertise PUBLISH_UNPUBLISH_VOLUME yet: csi-attacher attaches with its " +
				"trivial handler (no ControllerPublishVolume), so the read-write fence is NOT checked here; " +
				"checking only that the attacher handles VolumeAttachments for poolcsi volumes.")
		}
		size := resource.MustParse("96Mi")
		pvc := newPVC("shared-claim", "poolcsi-shared-image", size, corev1.ReadWriteOnce)
		pv := provision(t, c, pvc)
		// xfs (the example class) has a 300 MiB minimum: the driver may round up.
		checkPV(t, pv, cluster.SharedDriver, "shared", size, false)
		if pv.Spec.NodeAffinity != nil {
			t.Errorf("a shared-pool PV must be usable from every node, has node affinity %+v", pv.Spec.NodeAffinity)
		}
		handle := pv.Spec.CSI.VolumeHandle
		if !listHas(t, shared, handle) {
			t.Fatalf("poolcsi ListVolumes does not know the PV's volume handle %s", handle)
		}

		va1 := attach(t, c, "va-node-1", pv.Name, "node-1")
		waitAttached(t, c, va1, 60*time.Second)
		t.Logf("VolumeAttachment %s: attached to node-1", va1)
		va2 := attach(t, c, "va-node-2", pv.Name, "node-2")
		if publish {
			// The fence: a second read-write node is refused while the first holds the volume.
			var msg string
			cluster.WaitFor(t, 60*time.Second, "csi-attacher to report the refusal of "+va2, func() error {
				va, err := c.Client.StorageV1().VolumeAttachments().Get(ctx, va2, metav1.GetOptions{})
				if err != nil {
					return err
				}
				if va.Status.Attached {
					t.Fatalf("FENCE BROKEN: poolcsi advertises PUBLISH_UNPUBLISH_VOLUME but attached RWO image volume %s "+
						"read-write to node-2 while node-1 holds it", handle)
				}
				if va.Status.AttachError == nil {
					return fmt.Errorf("no attach error yet")
				}
				msg = va.Status.AttachError.Message
				return nil
			})
			if !strings.Contains(msg, "FailedPrecondition") {
				t.Fatalf("poolcsi refused the second writer, but not with FAILED_PRECONDITION: %q", msg)
			}
			t.Logf("VolumeAttachment %s refused while node-1 holds the volume: %s", va2, msg)
			time.Sleep(3 * time.Second) // the attacher retries; it must keep refusing
			if va, _ := c.Client.StorageV1().VolumeAttachments().Get(ctx, va2, metav1.GetOptions{}); va != nil && va.Status.Attached {
				t.Fatalf("FENCE BROKEN: %s became attached on retry while node-1 still holds %s", va2, handle)
			}
			detach(t, c, va1)
			waitAttached(t, c, va2, 90*time.Second)
			t.Logf("after node-1 let go, %s attached to node-2", va2)
		} else {
			waitAttached(t, c, va2, 60*time.Second)
			t.Log("NOTE: without PUBLISH_UNPUBLISH_VOLUME the second node was attached too (no fence to test)")
			detach(t, c, va1)
		}
		detach(t, c, va2)
		deleteClaim(t, c, pvc.Name, pv.Name)
		cluster.WaitFor(t, 60*time.Second, "volume "+handle+" gone from ListVolumes", func() error {
			if listHas(t, shared, handle) {
				return fmt.Errorf("still listed")
			}
			return nil
		})
		checkGoneFromPool(t, filepath.Join(dir, "pools", "shared"), handle)
	})
	t.Run("an abnormal volume puts a VolumeConditionAbnormal event on its claim", func(t *testing.T) {
		size := resource.MustParse("96Mi")
		pvc := newPVC("sick-claim", "poolcsi-shared-image", size, corev1.ReadWriteOnce)
		pv := provision(t, c, pvc)
		handle := pv.Spec.CSI.VolumeHandle
		defer deleteClaim(t, c, pvc.Name, pv.Name)
		key := handle[strings.Index(handle, ".")+1:]
		// The fault, behind the driver's back: the image is cut short.
		image := filepath.Join(sharedPool["/mnt/poolcsi-shared"], "volumes", key, "disk.img")
		fi, err := os.Stat(image)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(image, fi.Size()/2); err != nil {
			t.Fatal(err)
		}
		event := func(reason string) error {
			evs, err := c.Client.CoreV1().Events(pvc.Namespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			for _, e := range evs.Items {
				if e.InvolvedObject.Kind == "PersistentVolumeClaim" && e.InvolvedObject.Name == pvc.Name && e.Reason == reason {
					t.Logf("%s event on claim %s: %s", e.Type, pvc.Name, e.Message)
					return nil
				}
			}
			return fmt.Errorf("no %s event on claim %s yet", reason, pvc.Name)
		}
		cluster.WaitFor(t, 60*time.Second, "VolumeConditionAbnormal event", func() error { return event("VolumeConditionAbnormal") })
		if err := os.Truncate(image, fi.Size()); err != nil {
			t.Fatal(err)
		}
		cluster.WaitFor(t, 60*time.Second, "VolumeConditionNormal event", func() error { return event("VolumeConditionNormal") })
	})

	t.Run("shared PVC expanded by csi-resizer through ControllerExpandVolume", func(t *testing.T) {
		testSharedResize(t, c, shared, sharedResizer, filepath.Join(dir, "pools", "shared"))
	})
	t.Run("local PVC expanded on its node (--expand-on-node)", func(t *testing.T) {
		testLocalResize(t, c, local, localResizer, filepath.Join(dir, "pools", "node-1-local"))
	})
	t.Run("shared VolumeSnapshot taken, restored and deleted through csi-snapshotter", func(t *testing.T) {
		testVolumeSnapshot(t, c, snapshotCase{driver: shared, driverName: cluster.SharedDriver, storageClass: "poolcsi-shared-image",
			snapClass: "poolcsi-shared", poolDir: filepath.Join(dir, "pools", "shared"),
			snapshotter: sharedSnapshotter, provisioner: sharedProvisioner})
	})
	t.Run("local VolumeSnapshot on its node (csi-snapshotter --node-deployment)", func(t *testing.T) {
		testVolumeSnapshot(t, c, snapshotCase{driver: local, driverName: cluster.LocalDriver, storageClass: "poolcsi-local-image",
			snapClass: "poolcsi-local", node: "node-1", poolDir: filepath.Join(dir, "pools", "node-1-local"),
			snapshotter: localSnapshotter, provisioner: localProvisioner})
	})
	t.Logf("TestKubernetes total %s", time.Since(total).Round(time.Second))
}

func newPVC(name, sc string, size resource.Quantity, mode corev1.PersistentVolumeAccessMode) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{mode},
			StorageClassName: &sc,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
		},
	}
}

// provision creates the claim and waits until it is Bound to a PV, which it returns.
func provision(t *testing.T, c *cluster.Cluster, pvc *corev1.PersistentVolumeClaim) *corev1.PersistentVolume {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	if _, err := c.Client.CoreV1().PersistentVolumeClaims(pvc.Namespace).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var got *corev1.PersistentVolumeClaim
	cluster.WaitFor(t, 120*time.Second, "claim "+pvc.Name+" Bound", func() error {
		var err error
		got, err = c.Client.CoreV1().PersistentVolumeClaims(pvc.Namespace).Get(ctx, pvc.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if got.Status.Phase != corev1.ClaimBound {
			evs, _ := c.Client.CoreV1().Events(pvc.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + pvc.Name})
			var last string
			if evs != nil && len(evs.Items) > 0 {
				e := evs.Items[len(evs.Items)-1]
				last = e.Reason + ": " + e.Message
			}
			return fmt.Errorf("phase %s, annotations %v, last event %q", got.Status.Phase, got.Annotations, last)
		}
		return nil
	})
	pv, err := c.Client.CoreV1().PersistentVolumes().Get(ctx, got.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pv.Status.Phase != corev1.VolumeBound {
		t.Fatalf("PV %s phase %s, want Bound", pv.Name, pv.Status.Phase)
	}
	t.Logf("claim %s Bound to %s in %s", pvc.Name, pv.Name, time.Since(start).Round(time.Millisecond))
	return pv
}

func checkPV(t *testing.T, pv *corev1.PersistentVolume, driverName, pool string, size resource.Quantity, exact bool) {
	t.Helper()
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driverName {
		t.Fatalf("PV %s: CSI source %+v, want driver %s", pv.Name, pv.Spec.CSI, driverName)
	}
	got := pv.Spec.Capacity[corev1.ResourceStorage]
	switch {
	case exact && got.Cmp(size) != 0:
		t.Errorf("PV %s capacity %s, want the requested %s", pv.Name, got.String(), size.String())
	case got.Cmp(size) < 0:
		t.Errorf("PV %s capacity %s is less than the requested %s", pv.Name, got.String(), size.String())
	case got.Cmp(size) > 0:
		t.Logf("PV %s capacity %s: the driver rounded the requested %s up", pv.Name, got.String(), size.String())
	}
	m := handleRE.FindStringSubmatch(pv.Spec.CSI.VolumeHandle)
	if m == nil || m[1] != pool {
		t.Errorf("PV %s volume handle %q is not <%s>.<32 hex>", pv.Name, pv.Spec.CSI.VolumeHandle, pool)
	}
	yb, _ := yaml.Marshal(pv.Spec)
	t.Logf("PV %s spec:\n%s", pv.Name, yb)
}

// listVolume is the volume ListVolumes reports for handle, nil when it has none;
// it follows next_token through every page.
func listVolume(t *testing.T, d *driver, handle string) *csi.Volume {
	t.Helper()
	token := ""
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := d.controller().ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: token})
		cancel()
		if err != nil {
			t.Fatalf("ListVolumes: %v", err)
		}
		for _, e := range resp.GetEntries() {
			if e.GetVolume().GetVolumeId() == handle {
				return e.GetVolume()
			}
		}
		if token = resp.GetNextToken(); token == "" {
			return nil
		}
	}
}

func listHas(t *testing.T, d *driver, handle string) bool { return listVolume(t, d, handle) != nil }

// checkGoneFromPool looks for any file or directory named after the volume's id left in
// the pool.
func checkGoneFromPool(t *testing.T, pool, handle string) {
	t.Helper()
	id := handleRE.FindStringSubmatch(handle)
	if id == nil {
		return
	}
	_ = filepath.Walk(pool, func(p string, info os.FileInfo, err error) error {
		if err == nil && strings.Contains(info.Name(), id[2]) {
			t.Errorf("volume %s deleted, but %s is still in the pool", handle, p)
		}
		return nil
	})
}

func deleteClaim(t *testing.T, c *cluster.Cluster, claim, pv string) {
	t.Helper()
	ctx := context.Background()
	if err := c.Client.CoreV1().PersistentVolumeClaims("default").Delete(ctx, claim, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster.WaitFor(t, 90*time.Second, "PV "+pv+" deleted", func() error {
		got, err := c.Client.CoreV1().PersistentVolumes().Get(ctx, pv, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		return fmt.Errorf("phase %s, finalizers %v", got.Status.Phase, got.Finalizers)
	})
}

// attach creates a VolumeAttachment as the attach/detach controller would.
func attach(t *testing.T, c *cluster.Cluster, name, pv, node string) string {
	t.Helper()
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: cluster.SharedDriver, NodeName: node,
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv}},
	}
	if _, err := c.Client.StorageV1().VolumeAttachments().Create(context.Background(), va, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return name
}

func waitAttached(t *testing.T, c *cluster.Cluster, name string, timeout time.Duration) {
	t.Helper()
	cluster.WaitFor(t, timeout, "VolumeAttachment "+name+" attached", func() error {
		va, err := c.Client.StorageV1().VolumeAttachments().Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !va.Status.Attached {
			return fmt.Errorf("status %+v", va.Status)
		}
		return nil
	})
}

// detach deletes the VolumeAttachment, as the attach/detach controller does, and waits for
// csi-attacher to detach and let it go.
func detach(t *testing.T, c *cluster.Cluster, name string) {
	t.Helper()
	ctx := context.Background()
	if err := c.Client.StorageV1().VolumeAttachments().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster.WaitFor(t, 60*time.Second, "VolumeAttachment "+name+" detached and gone", func() error {
		va, err := c.Client.StorageV1().VolumeAttachments().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		return fmt.Errorf("still there: finalizers %v, status %+v", va.Finalizers, va.Status)
	})
}
