package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const fioImage = cluster.LocalImagePrefix + "fio:1"

// BenchmarkIOLimit measures, with fio in a pod, the I/O of an image claim under a
// VolumeAttributesClass and after the class is changed on the running pod (csi-resizer's
// ControllerModifyVolume, then the node's cgroup limits), beside the same claim with no
// class. Direct I/O: cgroup v1, this machine's, throttles only I/O its issuer submits, not
// the kernel's writeback of buffered writes (docs/modify.md). Reported: each measured rate
// and its ratio to the class's limit. Run with:
//
//	cd test/k8s && go test ./harness -run '^$' -bench IOLimit -benchtime 1x -timeout 30m -v
func BenchmarkIOLimit(b *testing.B) {
	env := startKubeletEnvWith(b, func(t testing.TB) []cluster.Image {
		return []cluster.Image{cluster.WithHostBinaries(t, cluster.BusyboxImage(t, fioImage), "/usr/bin/fio")}
	}, nil)
	env.storageClasses(b)
	ns := env.Namespace(b, "iolimit")
	env.volumeAttributesClass(b, "w8", cluster.SharedDriver, map[string]string{"writeBytesPerSecond": "8Mi", "readBytesPerSecond": "8Mi"})
	env.volumeAttributesClass(b, "w24", cluster.SharedDriver, map[string]string{"writeBytesPerSecond": "24Mi", "readBytesPerSecond": "24Mi", "writeIOPS": "200", "readIOPS": "200"})
	for i := 0; i < b.N; i++ {
		claim, pod := fmt.Sprintf("c%d", i), fmt.Sprintf("fio%d", i)
		env.Claim(b, ns, cluster.ClaimSpec{Name: claim, Class: "shared-xfs", Size: "1Gi"})
		p := cluster.PodObject(ns, cluster.PodSpec{Name: pod, Claims: []string{claim}})
		p.Spec.Containers[0].Image = fioImage
		if _, err := env.Cluster.Client.CoreV1().Pods(ns).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		running := env.WaitRunning(b, ns, pod)
		// Lay the file out first so reads and rewrites meet allocated blocks.
		env.MustExec(b, ns, pod, "fio --name=lay --filename=/data/f --size=256M --rw=write --bs=1M --direct=1 --output=/dev/null")
		for _, step := range []struct {
			class     string
			bps, iops int64 // the class's limits; 0: none
		}{{"", 0, 0}, {"w8", 8 << 20, 0}, {"w24", 24 << 20, 200}} {
			if step.class != "" {
				env.patchClaim(b, ns, claim, fmt.Sprintf(`{"spec":{"volumeAttributesClassName":%q}}`, step.class))
				env.waitThrottle(b, running, "blkio.throttle.write_bps_device", step.bps)
			}
			for _, rw := range []string{"write", "read", "randwrite"} {
				bs := "1M"
				if rw == "randwrite" {
					bs = "4k"
				}
				bw, iops := runFio(b, env, ns, pod, rw, bs)
				name := or(step.class, "none") + "-" + rw
				b.ReportMetric(bw/(1<<20), name+"-MiB/s")
				line := fmt.Sprintf("class %-4s %-9s %7.2f MiB/s %8.0f IOPS", or(step.class, "none"), rw, bw/(1<<20), iops)
				switch {
				case rw == "randwrite" && step.iops > 0:
					b.ReportMetric(iops/float64(step.iops), name+"/limit")
					line += fmt.Sprintf("  %.3f of its %d IOPS", iops/float64(step.iops), step.iops)
				case rw != "randwrite" && step.bps > 0:
					b.ReportMetric(bw/float64(step.bps), name+"/limit")
					line += fmt.Sprintf("  %.3f of its %d MiB/s", bw/float64(step.bps), step.bps>>20)
				}
				b.Log(line)
			}
		}
		env.DeletePod(b, ns, pod)
	}
}

// runFio runs one 10-second direct-I/O fio job in the pod and returns its bytes and
// operations per second.
func runFio(b *testing.B, env *kubeletEnv, ns, pod, rw, bs string) (bw, iops float64) {
	b.Helper()
	out := env.MustExec(b, ns, pod, fmt.Sprintf("fio --name=j --filename=/data/f --size=256M --rw=%s --bs=%s --direct=1 --ioengine=psync "+
		"--time_based --runtime=10 --ramp_time=2 --output-format=json", rw, bs))
	var res struct {
		Jobs []struct {
			Read, Write struct {
				BW   float64 `json:"bw_bytes"`
				IOPS float64 `json:"iops"`
			}
		}
	}
	if i := strings.Index(out, "{"); i >= 0 {
		out = out[i:]
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.Jobs) != 1 {
		b.Fatalf("fio output: %v\n%s", err, out)
	}
	j := res.Jobs[0]
	if rw == "read" {
		return j.Read.BW, j.Read.IOPS
	}
	return j.Write.BW, j.Write.IOPS
}

func or(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
