package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

// previousRelease is the commit TestUpgrade upgrades from: chart 0.1.0, the last main
// before 0.2.0 (the VERSION file, node-local records, the share key named by
// shareKey.existingSecret, the local pool alone by default). Move it to the newest
// release once one is tagged.
const previousRelease = "0fb0c1f"

// prevRelease is an earlier commit of this repository, built: its source (git archive)
// and its poolcsi binary, cached by commit under $POOLCSI_K8S_CACHE.
type prevRelease struct {
	commit string // full hash
	src    string // the commit's tree
	bin    string // its poolcsi
}

func (p *prevRelease) tag() string      { return "prev-" + p.commit[:12] }
func (p *prevRelease) chartDir() string { return filepath.Join(p.src, "deploy", "helm", "poolcsi") }

// values turns this tree's environment values into the earlier chart's: its image, and
// the share key named by shares.keySecret (shareKey.existingSecret came with 0.2.0).
func (p *prevRelease) values(v map[string]any) map[string]any {
	v["image"] = map[string]any{"repository": cluster.PoolcsiRef, "tag": p.tag()}
	if sk, ok := v["shareKey"].(map[string]any); ok {
		delete(v, "shareKey")
		if sh, ok := v["shares"].(map[string]any); ok {
			sh["keySecret"] = sk["existingSecret"]
		}
	}
	return v
}

// release is the earlier release as an environment installs it.
func (p *prevRelease) release() *cluster.Release {
	return &cluster.Release{Tag: p.tag(), Bin: p.bin, ChartDir: p.chartDir(), Values: p.values}
}

// buildPrev extracts commit from this clone and builds its poolcsi, once per commit.
func buildPrev(t testing.TB, commit string) *prevRelease {
	t.Helper()
	root := chart.RepoRoot()
	out, err := exec.Command("git", "-C", root, "rev-parse", "--verify", commit+"^{commit}").CombinedOutput()
	if err != nil {
		t.Fatalf("the upgrade test starts from commit %s, which this clone lacks (a shallow clone? git fetch --unshallow): %v\n%s", commit, err, out)
	}
	full := strings.TrimSpace(string(out))
	cache := os.Getenv("POOLCSI_K8S_CACHE")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			t.Fatal(err)
		}
		cache = filepath.Join(home, ".cache", "poolcsi-k8s")
	}
	dir := filepath.Join(cache, "poolcsi-"+full)
	p := &prevRelease{commit: full, src: filepath.Join(dir, "src"), bin: filepath.Join(dir, "poolcsi")}
	if cluster.FileExists(p.bin) {
		return p
	}
	tmp := dir + ".tmp"
	_ = os.RemoveAll(tmp)
	if err := os.MkdirAll(filepath.Join(tmp, "src"), 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	archive := exec.Command("sh", "-c", `git -C "$1" archive --format=tar "$2" | tar -x -C "$3"`, "sh", root, full, filepath.Join(tmp, "src"))
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("git archive %s: %v\n%s", full, err, out)
	}
	cmd := tools.Nice(t.Context(), cluster.GoBin(), "build", "-o", filepath.Join(tmp, "poolcsi"), "./cmd/poolcsi")
	cmd.Dir = filepath.Join(tmp, "src")
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/poolcsi at %s: %v\n%s", full, err, out)
	}
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatal(err)
	}
	t.Logf("built poolcsi at %s in %s", full[:12], time.Since(start).Round(time.Second))
	return p
}

// upgradeWriter appends a counter to log in every mount, fsynced, ten times a second;
// the first write that fails ends the container with its error (restartPolicy Never).
const upgradeWriter = `i=0
while :; do
  for d in "$@"; do
    echo $i | dd of=$d/log oflag=append conv=notrunc,fsync 2>/tmp/err || { echo "write $i to $d: $(cat /tmp/err)" >/dev/termination-log; exit 1; }
  done
  i=$((i+1))
  sleep 0.1
done`

// TestUpgrade installs the chart and image of previousRelease, runs a pod writing to a
// local image volume, a shared image volume and a shared dir volume, and upgrades to this
// tree's chart and image as helm upgrade does (the rendered objects applied over, those
// the new chart no longer has deleted): the node plugin's and the controller's pods are
// replaced under the mounted volumes. Then no write failed, the writes go on, every
// volume keeps its stage (the same loop devices), a new pod mounts each, the pools'
// records pass `poolcsi pool check`, and the new release deletes the old one's volumes.
func TestUpgrade(t *testing.T) {
	start := time.Now()
	prev := buildPrev(t, previousRelease)
	env := startEnv(t, cluster.EnvOptions{Prev: prev.release()})
	installed := time.Now()
	ctx := context.Background()
	env.storageClasses(t)
	ns := env.Namespace(t, "upgrade")
	claims := []cluster.ClaimSpec{
		{Name: "local", Class: "local-xfs", Size: "256Mi"},
		{Name: "shared-image", Class: "shared-ext4", Size: "256Mi"},
		{Name: "shared-dir", Class: "shared-dir", Size: "256Mi", RWX: true},
	}
	var names, mounts []string
	for i, c := range claims {
		env.Claim(t, ns, c)
		names = append(names, c.Name)
		mounts = append(mounts, mountPath(i))
	}
	w := cluster.PodObject(ns, cluster.PodSpec{Name: "writer", Claims: names})
	w.Spec.RestartPolicy = corev1.RestartPolicyNever
	w.Spec.Containers[0].Command = append([]string{"sh", "-c", upgradeWriter, "writer"}, mounts...)
	if _, err := env.Cluster.Client.CoreV1().Pods(ns).Create(ctx, w, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	env.WaitRunning(t, ns, "writer")
	counts := func() []int {
		t.Helper()
		var n []int
		for _, m := range mounts {
			n = append(n, checkCounter(t, env.MustExec(t, ns, "writer", "cat "+m+"/log"), m))
		}
		return n
	}
	cluster.WaitFor(t, 30*time.Second, "the writer's first records", func() error {
		for _, n := range counts() {
			if n < 10 {
				return fmt.Errorf("%d records", n)
			}
		}
		return nil
	})
	loopsBefore := sortedKeys(cluster.OurLoops(cluster.KubeletDir, cluster.LocalPoolPath, cluster.SharedPoolPath))
	if len(loopsBefore) != 2 {
		t.Fatalf("loop devices of the image volumes before the upgrade: %v, want 2", loopsBefore)
	}
	// The node-local stage record of the shared image volume (docs/fencing.md): 0.1.0
	// wrote none; the new release must adopt the stage it finds, or its fence would not
	// know the device.
	stageRecords := filepath.Join("/var/lib/poolcsi/state", cluster.SharedDriver, env.Node.Name, "stages",
		env.VolumeHandle(t, ns, "shared-image")+"@*.json")
	if recs, _ := filepath.Glob(stageRecords); len(recs) > 0 {
		t.Fatalf("stage records before the upgrade, which 0.1.0 does not write: %v", recs)
	}
	nodeBefore, err := env.NodePodName(t)
	if err != nil {
		t.Fatal(err)
	}
	before := counts()
	t.Logf("previous release %s running, writer at %v records, %s after the start", prev.commit[:12], before, time.Since(start).Round(time.Second))

	// helm upgrade: the new chart's objects applied over the old ones, and what only the
	// old release had deleted.
	up := time.Now()
	oldDocs, err := chart.Render(prev.chartDir(), "", prev.values(env.Overrides()))
	if err != nil {
		t.Fatal(err)
	}
	// The new chart with its defaults, as an operator upgrading from 0.1.0 gets it: the local
	// pools move from 0.1.0's per-node sidecars to the central controller here, and what
	// the per-node provisioner made is unpublished, unstaged and deleted through it below.
	// The move's mixed window (a node not yet rolled while the central controller runs) is
	// TestUpgradeToCentral's.
	newDocs, err := chart.Render(chart.ChartDir(), "", env.Overrides())
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range droppedObjects(t, oldDocs, newDocs) {
		t.Logf("upgrade: deleting %s %s, which the new chart no longer has", o.GetKind(), o.GetName())
		env.deleteObject(t, o)
	}
	env.ApplyChart(t, newDocs)
	env.waitRolledOut(t, cluster.PoolcsiRef+":"+cluster.PoolcsiTag, releasePods(t, newDocs, len(env.Nodes)))
	nodeAfter, err := env.NodePodName(t)
	if err != nil {
		t.Fatal(err)
	}
	if nodeAfter == nodeBefore {
		t.Fatalf("the node plugin's pod %s was not replaced", nodeAfter)
	}
	t.Logf("upgraded: every pod of the release runs %s:%s after %s", cluster.PoolcsiRef, cluster.PoolcsiTag, time.Since(up).Round(time.Second))

	// No write failed, and the writes go on past the upgrade.
	after := counts()
	cluster.WaitFor(t, 30*time.Second, "writes after the upgrade", func() error {
		now := counts()
		for i := range now {
			if now[i] <= after[i]+10 {
				return fmt.Errorf("%s at %d records, %d when the upgrade finished", mounts[i], now[i], after[i])
			}
		}
		return nil
	})
	p, err := env.Cluster.Client.CoreV1().Pods(ns).Get(ctx, "writer", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].RestartCount != 0 ||
		p.Status.ContainerStatuses[0].State.Running == nil {
		t.Fatalf("the writer did not run through the upgrade: %s", cluster.PodSummary(p))
	}
	// Every stage kept: the same loop devices serve the image volumes.
	if after := sortedKeys(cluster.OurLoops(cluster.KubeletDir, cluster.LocalPoolPath, cluster.SharedPoolPath)); strings.Join(after, " ") != strings.Join(loopsBefore, " ") {
		t.Fatalf("loop devices of the image volumes: %v before the upgrade, %v after", loopsBefore, after)
	}
	cluster.WaitFor(t, 30*time.Second, "the new release's record of the stage it adopted", func() error {
		if recs, _ := filepath.Glob(stageRecords); len(recs) != 1 {
			return fmt.Errorf("%s: %v", stageRecords, recs)
		}
		return nil
	})
	// Every volume still served: a new pod mounts each (a publish by the new release over
	// the old one's stage) and reads what the writer wrote.
	env.Pod(t, ns, cluster.PodSpec{Name: "reader", Claims: names})
	for _, m := range mounts {
		checkCounter(t, env.MustExec(t, ns, "reader", "cat "+m+"/log"), m)
	}
	// The records of both pools read by the new release.
	for _, pool := range []string{cluster.LocalPoolPath, cluster.SharedPoolPath} {
		if out, err := exec.Command(env.Poolcsi, "pool", "check", "--path", pool).CombinedOutput(); err != nil {
			t.Fatalf("poolcsi pool check --path %s: %v\n%s", pool, err, out)
		}
	}
	for _, c := range []string{"poolcsi", "poolcsi-local"} {
		if out, err := env.ExecIn(t, chart.Namespace, nodeAfter, c, "poolcsi", "status"); err != nil {
			t.Fatalf("poolcsi status in %s/%s: %v\n%s", nodeAfter, c, err, out)
		}
	}
	// The new release unpublishes, unstages and deletes the old one's volumes.
	env.DeletePod(t, ns, "reader")
	env.DeletePod(t, ns, "writer")
	for _, c := range claims {
		if err := env.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, c.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	env.waitNoPVs(t, 120*time.Second)
	if left := cluster.OurLoops(cluster.KubeletDir, cluster.LocalPoolPath, cluster.SharedPoolPath); len(left) > 0 {
		t.Fatalf("loop devices left after the volumes were deleted: %v", left)
	}
	t.Logf("upgrade test: %s in all, %s of it after the install", time.Since(start).Round(time.Second), time.Since(installed).Round(time.Second))
}

func mountPath(i int) string {
	if i == 0 {
		return "/data"
	}
	return fmt.Sprintf("/data%d", i+1)
}

// checkCounter checks that log is the lines 0, 1, ... n-1, each whole (what a write that
// failed or was lost would break), and returns n.
func checkCounter(t testing.TB, log, what string) int {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(log, "\n"), "\n")
	if log == "" {
		return 0
	}
	for i, l := range lines {
		if l != strconv.Itoa(i) {
			t.Fatalf("%s/log: line %d is %q, want %d", what, i+1, l, i)
		}
	}
	return len(lines)
}

func sortedKeys(m map[string]string) []string {
	var k []string
	for d := range m {
		k = append(k, d)
	}
	sort.Strings(k)
	return k
}

// droppedObjects are the objects of old that new does not have (by kind, namespace and
// name): helm upgrade deletes them.
func droppedObjects(t testing.TB, old, new []chart.Doc) []*unstructured.Unstructured {
	t.Helper()
	key := func(o *unstructured.Unstructured) string {
		return o.GetKind() + "/" + o.GetNamespace() + "/" + o.GetName()
	}
	parse := func(docs []chart.Doc) []*unstructured.Unstructured {
		var all []*unstructured.Unstructured
		for _, d := range docs {
			objs, err := cluster.ParseObjects([]byte(d.YAML))
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, objs...)
		}
		return all
	}
	have := map[string]bool{}
	for _, o := range parse(new) {
		have[key(o)] = true
	}
	var dropped []*unstructured.Unstructured
	for _, o := range parse(old) {
		if !have[key(o)] {
			dropped = append(dropped, o)
		}
	}
	return dropped
}

// deleteObject deletes one object of the release.
func (e *kubeletEnv) deleteObject(t testing.TB, o *unstructured.Unstructured) {
	t.Helper()
	if o.GetNamespace() == "" && cluster.IsNamespaced(o) {
		o.SetNamespace(chart.Namespace)
	}
	if err := e.Cluster.Applier().Delete(context.Background(), o); err != nil {
		t.Fatal(err)
	}
}

// releasePods is how many pods the rendered chart docs run on a cluster of nodes: each
// Deployment's replicas (1 when unset) and one pod of each DaemonSet per node (the
// chart's DaemonSets run on every node).
func releasePods(t testing.TB, docs []chart.Doc, nodes int) int {
	t.Helper()
	n := 0
	for _, d := range docs {
		objs, err := cluster.ParseObjects([]byte(d.YAML))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			switch o.GetKind() {
			case "DaemonSet":
				n += nodes
			case "Deployment":
				// Parsed from YAML through JSON, a number is a float64; built in Go, an int64.
				r, found, err := unstructured.NestedFieldNoCopy(o.Object, "spec", "replicas")
				switch x := r.(type) {
				case nil:
					if err != nil || found {
						t.Fatalf("Deployment %s: spec.replicas %v: %v", o.GetName(), r, err)
					}
					n++
				case float64:
					n += int(x)
				case int64:
					n += int(x)
				default:
					t.Fatalf("Deployment %s: spec.replicas is a %T", o.GetName(), r)
				}
			}
		}
	}
	return n
}

// waitRolledOut waits until want pods of the release run image, are Ready, and no pod of
// the release is left with another image: the DaemonSet and the Deployments rolled out.
func (e *kubeletEnv) waitRolledOut(t testing.TB, image string, want int) {
	t.Helper()
	ctx := context.Background()
	cluster.WaitFor(t, 240*time.Second, "the release's pods replaced by "+image, func() error {
		pods, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(pods.Items) != want {
			return fmt.Errorf("%d pods, want %d", len(pods.Items), want)
		}
		for _, p := range pods.Items {
			if p.DeletionTimestamp != nil {
				return fmt.Errorf("pod %s terminating", p.Name)
			}
			for _, c := range p.Spec.Containers {
				if strings.HasPrefix(c.Image, cluster.PoolcsiRef+":") && c.Image != image {
					return fmt.Errorf("pod %s container %s runs %s", p.Name, c.Name, c.Image)
				}
			}
			if !cluster.PodReady(&p) {
				return fmt.Errorf("pod %s not ready: %s", p.Name, cluster.PodSummary(&p))
			}
		}
		return nil
	})
	e.WaitChartReady(t)
}
