package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BenchmarkPodStart times, through kubelet, a claim created → its pod Running, beside the
// same pod with a hostPath volume (what kubelet and containerd cost on their own), side by
// side in one run, one of each per iteration. The claim is provisioned as a user's would be:
// local-xfs waits for the pod (WaitForFirstConsumer), so CreateVolume, mkfs, stage and
// publish are all inside the time; shared-dir is provisioned at once, but still inside it.
// Reported: the median of each and its ratio to hostPath. Run with:
//
//	cd test/k8s && go test ./harness -run '^$' -bench PodStart -benchtime 20x -timeout 40m
func BenchmarkPodStart(b *testing.B) {
	env := startKubeletEnv(b)
	env.storageClasses(b)
	ns := env.Namespace(b, "podstart")
	host := filepath.Join(b.TempDir(), "hostpath")
	if err := os.MkdirAll(host, 0o755); err != nil {
		b.Fatal(err)
	}
	times := map[string][]time.Duration{}
	steps := map[string]map[string][]time.Duration{} // class → milestone → times
	classes := []string{"local-xfs", "shared-dir"}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		name := fmt.Sprintf("h%d", i)
		d, _ := env.timePod(b, ns, cluster.PodSpec{Name: name, HostPath: host}, nil)
		times["hostPath"] = append(times["hostPath"], d)
		env.DeletePod(b, ns, name)
		for _, class := range classes {
			name := fmt.Sprintf("%s-%d", class, i)
			c := &cluster.ClaimSpec{Name: name, Class: class, Size: "300Mi"}
			d, seen := env.timePod(b, ns, cluster.PodSpec{Name: name, Claims: []string{name}}, c)
			times[class] = append(times[class], d)
			if steps[class] == nil {
				steps[class] = map[string][]time.Duration{}
			}
			for m, at := range seen {
				steps[class][m] = append(steps[class][m], at)
			}
			env.DeletePod(b, ns, name)
			if class == "local-xfs" {
				// The same claim, now bound and its volume on the node, in a new pod: what
				// a StatefulSet's pod re-created on its node waits for.
				bound := name + "-bound"
				d, _ := env.timePod(b, ns, cluster.PodSpec{Name: bound, Claims: []string{name}}, nil)
				times["local-xfs-bound"] = append(times["local-xfs-bound"], d)
				env.DeletePod(b, ns, bound)
			}
			if err := env.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
				b.Fatal(err)
			}
		}
	}
	classes = append(classes, "local-xfs-bound")
	b.StopTimer()
	base := median(times["hostPath"])
	b.ReportMetric(float64(base.Milliseconds()), "hostPath-ms")
	for _, class := range classes {
		m := median(times[class])
		b.ReportMetric(float64(m.Milliseconds()), class+"-ms")
		b.ReportMetric(float64(m)/float64(base), class+"/hostPath")
	}
	b.Logf("medians of %d: hostPath %s, %v", b.N, base, func() map[string]time.Duration {
		out := map[string]time.Duration{}
		for _, c := range classes {
			out[c] = median(times[c])
		}
		return out
	}())
	for _, class := range classes {
		line := class + ", median time from the claim's creation to each milestone:"
		for _, m := range milestones {
			if at := steps[class][m]; len(at) > 0 {
				line += fmt.Sprintf(" %s %s (%d of %d);", m, median(at).Round(time.Millisecond), len(at), b.N)
			}
		}
		b.Log(line)
	}
}

// Pod-start milestones, in the order they happen for a claim; each is the time from the
// claim's creation to the first poll that saw it. They split the time between the
// scheduler and provisioner (selected, bound, scheduled), the attach round trip
// (attached: the VolumeAttachment's status, for drivers that need one) and kubelet
// (running: stage, publish and the container).
var milestones = []string{"selected-node", "bound", "scheduled", "attached", "running"}

// timePod creates the claim (if any) and the pod and returns how long until kubelet
// reports the pod Running and Ready, polled every 20 ms, and when each milestone was first
// seen.
func (e *kubeletEnv) timePod(t testing.TB, ns string, p cluster.PodSpec, c *cluster.ClaimSpec) (time.Duration, map[string]time.Duration) {
	t.Helper()
	ctx := context.Background()
	seen := map[string]time.Duration{}
	mark := func(m string, ok bool, at time.Duration) {
		if _, done := seen[m]; ok && !done {
			seen[m] = at
		}
	}
	start := time.Now()
	if c != nil {
		e.Claim(t, ns, *c)
	}
	if _, err := e.Cluster.Client.CoreV1().Pods(ns).Create(ctx, cluster.PodObject(ns, p), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := start.Add(120 * time.Second)
	for {
		at := time.Since(start)
		if c != nil {
			if pvc, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, c.Name, metav1.GetOptions{}); err == nil {
				_, selected := pvc.Annotations["volume.kubernetes.io/selected-node"]
				mark("selected-node", selected, at)
				mark("bound", pvc.Status.Phase == corev1.ClaimBound, at)
				if pv := pvc.Spec.VolumeName; pv != "" && seen["attached"] == 0 {
					if vas, err := e.Cluster.Client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{}); err == nil {
						for _, va := range vas.Items {
							if va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv {
								mark("attached", va.Status.Attached, at)
							}
						}
					}
				}
			}
		}
		pod, err := e.Cluster.Client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err == nil {
			mark("scheduled", pod.Spec.NodeName != "", at)
			if pod.Status.Phase == corev1.PodRunning && cluster.PodReady(pod) {
				seen["running"] = time.Since(start)
				return seen["running"], seen
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s/%s not Running after 120 s: %v", ns, p.Name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func median(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration{}, d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
