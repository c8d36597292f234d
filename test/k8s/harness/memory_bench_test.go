package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// BenchmarkLayoutMemory measures, in one cluster, the memory of the release's pods per
// container (the kubelet's /stats/summary: workingSetBytes, what eviction goes by) in the
// per-node layout (localController.central false) and, after the upgrade to the central
// one, in that: each idle, then with memoryClaims local claims bound and mounted (one pod).
// Run with (docs/performance.md):
//
//	cd test/k8s && go test ./harness -run '^$' -bench LayoutMemory -benchtime 1x -timeout 30m -v
func BenchmarkLayoutMemory(b *testing.B) {
	env := startEnv(b, cluster.EnvOptions{Values: map[string]any{"localController": map[string]any{"central": false}}})
	env.storageClasses(b)
	ns := env.Namespace(b, "memory")
	measure := func(label string) {
		time.Sleep(30 * time.Second) // settle: informers synced, the claims' work done
		for _, line := range env.releaseMemory(b) {
			b.Logf("%s: %s", label, line)
		}
	}
	measure("per-node, idle")
	env.memoryLoad(b, ns, "a")
	measure(fmt.Sprintf("per-node, %d claims mounted", memoryClaims))
	env.memoryUnload(b, ns, "a")

	nodeBefore, err := env.NodePodName(b)
	if err != nil {
		b.Fatal(err)
	}
	values := env.Overrides()
	delete(values, "localController")
	docs, err := chart.Render(chart.ChartDir(), "", values)
	if err != nil {
		b.Fatal(err)
	}
	env.ApplyChart(b, docs)
	env.waitNodeReplaced(b, nodeBefore)
	env.waitLocalController(b)
	measure("central, idle")
	env.memoryLoad(b, ns, "b")
	measure(fmt.Sprintf("central, %d claims mounted", memoryClaims))
	env.memoryUnload(b, ns, "b")
}

const memoryClaims = 20

// memoryLoad makes memoryClaims local claims and one pod mounting them all.
func (e *kubeletEnv) memoryLoad(t testing.TB, ns, prefix string) {
	t.Helper()
	var names []string
	for i := range memoryClaims {
		n := fmt.Sprintf("%s%d", prefix, i)
		e.Claim(t, ns, cluster.ClaimSpec{Name: n, Class: "local-xfs", Size: "64Mi"})
		names = append(names, n)
	}
	e.Pod(t, ns, cluster.PodSpec{Name: prefix, Claims: names})
}

// memoryUnload deletes memoryLoad's pod and claims and waits for every PV to be gone.
func (e *kubeletEnv) memoryUnload(t testing.TB, ns, prefix string) {
	t.Helper()
	ctx := context.Background()
	e.DeletePod(t, ns, prefix)
	if err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	e.waitNoPVs(t, 180*time.Second)
}

// releaseMemory is one line per pod of the release: each container's working set in MiB,
// from the kubelet's /stats/summary (through the API server's node proxy).
func (e *kubeletEnv) releaseMemory(t testing.TB) []string {
	t.Helper()
	raw, err := e.Cluster.Client.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes/" + e.Node.Name + "/proxy/stats/summary").DoRaw(context.Background())
	if err != nil {
		t.Fatalf("kubelet /stats/summary: %v", err)
	}
	var summary struct {
		Pods []struct {
			PodRef struct {
				Name, Namespace string
			} `json:"podRef"`
			Containers []struct {
				Name   string `json:"name"`
				Memory *struct {
					WorkingSetBytes *uint64 `json:"workingSetBytes"`
				} `json:"memory"`
			} `json:"containers"`
		} `json:"pods"`
	}
	if err := json.Unmarshal(raw, &summary); err != nil {
		t.Fatalf("kubelet /stats/summary: %v", err)
	}
	var lines []string
	for _, p := range summary.Pods {
		if p.PodRef.Namespace != chart.Namespace {
			continue
		}
		var parts []string
		var total uint64
		for _, c := range p.Containers {
			if c.Memory == nil || c.Memory.WorkingSetBytes == nil {
				parts = append(parts, c.Name+" ?")
				continue
			}
			total += *c.Memory.WorkingSetBytes
			parts = append(parts, fmt.Sprintf("%s %.1f", c.Name, float64(*c.Memory.WorkingSetBytes)/(1<<20)))
		}
		sort.Strings(parts)
		lines = append(lines, fmt.Sprintf("pod %s: %.1f MiB in all: %s", p.PodRef.Name, float64(total)/(1<<20), strings.Join(parts, ", ")))
	}
	sort.Strings(lines)
	if len(lines) == 0 {
		t.Fatalf("kubelet /stats/summary has no pod of namespace %s", chart.Namespace)
	}
	return lines
}

// waitNoPVs waits until the cluster has no PersistentVolume left: every volume deleted
// through the driver.
func (e *kubeletEnv) waitNoPVs(t testing.TB, timeout time.Duration) {
	t.Helper()
	cluster.WaitFor(t, timeout, "every PV deleted", func() error {
		pvs, err := e.Cluster.Client.CoreV1().PersistentVolumes().List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(pvs.Items) > 0 {
			return fmt.Errorf("%d PVs left", len(pvs.Items))
		}
		return nil
	})
}
