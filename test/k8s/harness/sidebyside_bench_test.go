package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

// What rancher/local-path-provisioner (k3s's default storage) needs here, beside the
// chart: its binary built from the module proxy, its own manifest
// (deploy/local-path-storage.yaml of the module), its helper pods' busybox, and a
// filesystem of its own of the kind and size of poolcsi's local pool.
const (
	localPathClass = "local-path"
	localPathDir   = "/opt/local-path-provisioner"
	localPathImage = cluster.LocalImagePrefix + "local-path-provisioner:" + tools.LocalPathVersion
	// The helper pods' image as the manifest names it ("busybox", IfNotPresent).
	localPathHelper = "docker.io/library/busybox:latest"
	// sideBySideRounds is the rounds of each iteration, each timing both provisioners.
	sideBySideRounds = 3
)

// BenchmarkSideBySide times poolcsi's local driver (local-xfs: image volumes on an xfs
// pool) against rancher/local-path-provisioner v0.0.30 (directories on an xfs filesystem
// of the same size) on the one-node cluster, in one run, alternating which goes first:
// a claim → its pod Running; 20 claims and their pods created at once → the last pod
// Running; all of them deleted → no PersistentVolume and nothing on the node left. Then,
// once, a pod writes 3 times its claim's size: local-path lets it (its claims are not
// sized), poolcsi stops it at the size. Reported: the median of each per provisioner and
// poolcsi's ratio to local-path (under 1: poolcsi faster). Each iteration is
// sideBySideRounds rounds on one cluster; -benchtime 1x, as more would start a cluster
// for each of go test's tries. Run with:
//
//	cd test/k8s && go test ./harness -run '^$' -bench SideBySide -benchtime 1x -timeout 60m -v
//
// With POOLCSI_SIDEBYSIDE_LAYOUT=per-node, poolcsi runs the per-node layout
// (localController.central=false: each node's own provisioner) instead of the chart's
// default, the central controller: the two layouts' figures, each against local-path.
func BenchmarkSideBySide(b *testing.B) {
	lpp := tools.LocalPath.Path(b)
	env := startKubeletEnvWith(b, func(t testing.TB) []cluster.Image {
		helper := cluster.BusyboxImage(t, localPathHelper)
		return []cluster.Image{cluster.BinaryImage(localPathImage, lpp), helper}
	}, sideBySideValues(b))
	env.storageClasses(b)
	env.Log.NoteMount(b, localPathDir)
	cluster.MountPoolFS(b, nil, localPathDir, "xfs", 16<<30)
	env.installLocalPath(b)
	ns := env.Namespace(b, "sidebyside")
	// Before the namespaces go (deleteAll): local-path's volumes are deleted by its own
	// provisioner, which goes with its namespace.
	b.Cleanup(func() { env.deleteClaims(b, ns) })

	classes := []string{"local-xfs", localPathClass}
	const many = 20
	one, batch, gone := map[string][]time.Duration{}, map[string][]time.Duration{}, map[string][]time.Duration{}
	b.ResetTimer()
	rounds := b.N * sideBySideRounds
	for i := 0; i < rounds; i++ {
		order := classes
		if i%2 == 1 {
			order = []string{classes[1], classes[0]}
		}
		for _, class := range order {
			name := fmt.Sprintf("%s-%d", class, i)
			d, _ := env.timePod(b, ns, cluster.PodSpec{Name: name, Claims: []string{name}}, &cluster.ClaimSpec{Name: name, Class: class, Size: "300Mi"})
			one[class] = append(one[class], d)
			batch[class] = append(batch[class], env.timePods(b, ns, fmt.Sprintf("%s-%d-b", class, i), class, many))
			gone[class] = append(gone[class], env.timeDeleteAll(b, ns, class))
			b.Logf("round %d, %s: 1 claim %s, %d claims %s, deleted %s", i, class, one[class][i].Round(time.Millisecond),
				many, batch[class][i].Round(time.Millisecond), gone[class][i].Round(time.Millisecond))
		}
	}
	b.StopTimer()
	for _, m := range []struct {
		name  string
		times map[string][]time.Duration
	}{{"1-claim", one}, {fmt.Sprintf("%d-claims", many), batch}, {"delete", gone}} {
		p, l := median(m.times["local-xfs"]), median(m.times[localPathClass])
		b.ReportMetric(float64(p.Milliseconds()), m.name+"-poolcsi-ms")
		b.ReportMetric(float64(l.Milliseconds()), m.name+"-localpath-ms")
		b.ReportMetric(float64(p)/float64(l), m.name+"-poolcsi/localpath")
		b.Logf("%s, median of %d: poolcsi %s, local-path %s (ratio %.2f)", m.name, rounds, p.Round(time.Millisecond), l.Round(time.Millisecond), float64(p)/float64(l))
	}
	for _, class := range classes {
		b.Logf("%s: %s", class, env.writePastSize(b, ns, class))
	}
}

// installLocalPath applies local-path-provisioner's own manifest with what this machine
// needs changed: its image (built here, never pulled; the image's binary is at /), and its
// volumes' directory (the manifest's own, /opt/local-path-provisioner, on an xfs
// filesystem mounted there). It returns once the provisioner's pod is Running.
func (e *kubeletEnv) installLocalPath(t testing.TB) {
	t.Helper()
	info, err := tools.ModDownload(tools.LocalPath.Module, tools.LocalPath.Version)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(info.Dir, "deploy", "local-path-storage.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	objs, err := cluster.ParseObjects(data)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ap := e.Cluster.Applier()
	for _, o := range objs {
		if o.GetKind() == "Deployment" {
			containers, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
			c := containers[0].(map[string]any)
			c["image"], c["imagePullPolicy"] = localPathImage, "Never"
			cmd := c["command"].([]any)
			cmd[0] = "/local-path-provisioner"
			if err := unstructured.SetNestedSlice(o.Object, containers, "spec", "template", "spec", "containers"); err != nil {
				t.Fatal(err)
			}
		}
		if err := ap.Apply(ctx, o, false); err != nil {
			t.Fatal(err)
		}
	}
	cluster.WaitFor(t, 120*time.Second, "local-path-provisioner Running", func() error {
		pods, err := e.Cluster.Client.CoreV1().Pods("local-path-storage").List(ctx, metav1.ListOptions{LabelSelector: "app=local-path-provisioner"})
		if err != nil {
			return err
		}
		for _, p := range pods.Items {
			if p.Status.Phase == corev1.PodRunning && cluster.PodReady(&p) {
				return nil
			}
		}
		return fmt.Errorf("%d pods, none Ready", len(pods.Items))
	})
}

// timePods creates n claims of class and a pod for each, all at once, and returns how long
// until the last pod is Running and Ready.
func (e *kubeletEnv) timePods(t testing.TB, ns, prefix, class string, n int) time.Duration {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("%s%02d", prefix, i)
			if _, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, cluster.ClaimObject(ns, cluster.ClaimSpec{Name: name, Class: class, Size: "300Mi"}), metav1.CreateOptions{}); err != nil {
				errs <- err
				return
			}
			if _, err := e.Cluster.Client.CoreV1().Pods(ns).Create(ctx, cluster.PodObject(ns, cluster.PodSpec{Name: name, Claims: []string{name}}), metav1.CreateOptions{}); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for {
		pods, err := e.Cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ready := 0
		for _, p := range pods.Items {
			if strings.HasPrefix(p.Name, prefix) && p.Status.Phase == corev1.PodRunning && cluster.PodReady(&p) {
				ready++
			}
		}
		if ready == n {
			return time.Since(start)
		}
		if time.Since(start) > 5*time.Minute {
			t.Fatalf("%d of %d pods of %s Running after 5 min", ready, n, class)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// timeDeleteAll deletes the namespace's pods and claims (all of class) and returns how
// long until no PersistentVolume of class is left and the provisioner's storage on the
// node is empty (poolcsi: no volume in the local pool; local-path: no directory in its).
func (e *kubeletEnv) timeDeleteAll(t testing.TB, ns, class string) time.Duration {
	t.Helper()
	start := time.Now()
	e.deleteClaims(t, ns)
	dir := filepath.Join(cluster.LocalPoolPath, "volumes")
	if class == localPathClass {
		dir = localPathDir
	}
	cluster.WaitFor(t, 5*time.Minute, "nothing of "+class+" left in "+dir, func() error {
		entries, err := os.ReadDir(dir)
		if err != nil && !os.IsNotExist(err) {
			return err
		}
		if len(entries) > 0 {
			return fmt.Errorf("%d entries, e.g. %s", len(entries), entries[0].Name())
		}
		return nil
	})
	return time.Since(start)
}

// deleteClaims deletes the namespace's pods and claims and waits until their
// PersistentVolumes are gone.
func (e *kubeletEnv) deleteClaims(t testing.TB, ns string) {
	t.Helper()
	ctx := context.Background()
	zero := int64(0)
	if err := e.Cluster.Client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster.WaitFor(t, 5*time.Minute, "the claims' PersistentVolumes deleted", func() error {
		pvs, err := e.Cluster.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		left := 0
		for _, pv := range pvs.Items {
			if pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns {
				left++
			}
		}
		if left > 0 {
			return fmt.Errorf("%d left", left)
		}
		return nil
	})
}

// writePastSize has a pod write three times its claim's size and says how far it got:
// local-path's claims are not sized (the pod fills the node's disk), poolcsi's image
// volumes are (the write stops at the size). 300 MiB: xfs's smallest filesystem, which
// poolcsi rounds a smaller xfs claim up to.
func (e *kubeletEnv) writePastSize(t testing.TB, ns, class string) string {
	t.Helper()
	name := "fill-" + class
	e.Claim(t, ns, cluster.ClaimSpec{Name: name, Class: class, Size: "300Mi"})
	e.Pod(t, ns, cluster.PodSpec{Name: name, Claims: []string{name}})
	e.WaitRunning(t, ns, name)
	out, err := e.Exec(t, ns, name, "dd if=/dev/zero of=/data/fill bs=1M count=900 2>&1 | grep -i 'space'; sync; du -m /data/fill | cut -f1")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	written := lines[len(lines)-1]
	stopped := strings.Contains(out, "No space left")
	if class != localPathClass && !stopped {
		t.Errorf("a 300 MiB claim of %s took 900 MiB: %s (%v)", class, out, err)
	}
	how := "nothing stopped it"
	if stopped {
		how = "stopped by ENOSPC"
	}
	return fmt.Sprintf("a pod wrote %s MiB into a 300 MiB claim (900 MiB asked): %s", written, how)
}

// sideBySideValues are the chart values of POOLCSI_SIDEBYSIDE_LAYOUT: none for the default
// layout, localController.central=false for "per-node".
func sideBySideValues(b *testing.B) map[string]any {
	switch l := os.Getenv("POOLCSI_SIDEBYSIDE_LAYOUT"); l {
	case "", "central":
		return nil
	case "per-node":
		b.Log("layout: per-node (localController.central=false)")
		return map[string]any{"localController": map[string]any{"central": false}}
	default:
		b.Fatalf("POOLCSI_SIDEBYSIDE_LAYOUT=%q: want central or per-node", l)
		return nil
	}
}
