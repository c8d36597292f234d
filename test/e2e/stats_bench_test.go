package e2e

import (
	"context"
	"github.com/poolcsi/poolcsi/test/harness"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
)

// BenchmarkNodeGetVolumeStats measures NodeGetVolumeStats as kubelet calls it:
// over the real gRPC unix socket of a `poolcsi serve` process, on a staged and
// published ext4 volume. Each iteration also times one bare statfs(2) on the
// same path, so the two are measured side by side under the same load. It
// reports per-call percentiles; run it with a fixed call count:
//
//	go test ./test/e2e -run '^$' -bench NodeGetVolumeStats -benchtime 10000x
//
// The driver runs at -v=2, where calls are not logged (they are from -v=3).
func BenchmarkNodeGetVolumeStats(b *testing.B) {
	e := newEnvArgs(b, []string{"-v", "2"}, "mkfs.ext4")
	vc := harness.MountCap("ext4", harness.RWO)
	id := e.create("bench-stats", vc, 64*mib)
	e.stage(id, vc)
	e.publish(id, vc, false)
	path := e.target(id)
	node := e.drv.Node()
	req := &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: path}
	ctx := context.Background()
	if _, err := node.NodeGetVolumeStats(ctx, req); err != nil { // connect, warm up
		b.Fatal(err)
	}

	ident := e.drv.Identity()
	rpc := make([]time.Duration, 0, b.N)
	bare := make([]time.Duration, 0, b.N)
	floor := make([]time.Duration, 0, b.N)
	var st unix.Statfs_t
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		if _, err := node.NodeGetVolumeStats(ctx, req); err != nil {
			b.Fatal(err)
		}
		mid := time.Now()
		if err := unix.Statfs(path, &st); err != nil {
			b.Fatal(err)
		}
		end := time.Now()
		// The gRPC floor: a call that does no work at all, on the same socket.
		if _, err := ident.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); err != nil {
			b.Fatal(err)
		}
		rpc = append(rpc, mid.Sub(start))
		bare = append(bare, end.Sub(mid))
		floor = append(floor, time.Since(end))
	}
	b.StopTimer()
	b.ReportMetric(percentile(rpc, 50), "rpc-p50-µs")
	b.ReportMetric(percentile(rpc, 99), "rpc-p99-µs")
	b.ReportMetric(percentile(bare, 50), "statfs-p50-µs")
	b.ReportMetric(percentile(bare, 99), "statfs-p99-µs")
	b.ReportMetric(percentile(floor, 50), "noop-rpc-p50-µs")
}

// percentile returns the p-th percentile of ds in microseconds (nearest rank).
func percentile(ds []time.Duration, p int) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	i = min(max(i, 1), len(s)) - 1
	return float64(s[i].Nanoseconds()) / 1e3
}
