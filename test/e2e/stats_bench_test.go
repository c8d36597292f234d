package e2e

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/csiproc"

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
	vc := csiproc.MountCap("ext4", csiproc.RWO)
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

// BenchmarkNodeGetVolumeStatsConcurrent is the same call from 50 callers at
// once (the load docs/performance.md budgets for), beside the no-op RPC from 50 callers in the same
// run: the difference is what the driver adds under load.
//
//	go test ./test/e2e -run '^$' -bench NodeGetVolumeStatsConcurrent -benchtime 20000x
func BenchmarkNodeGetVolumeStatsConcurrent(b *testing.B) {
	e := newEnvArgs(b, []string{"-v", "2"}, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	id := e.create("bench-stats-50", vc, 64*mib)
	e.stage(id, vc)
	e.publish(id, vc, false)
	node, ident := e.drv.Node(), e.drv.Identity()
	req := &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: e.target(id)}
	ctx := context.Background()
	if _, err := node.NodeGetVolumeStats(ctx, req); err != nil {
		b.Fatal(err)
	}
	const callers = 50
	run := func(call func() error) []time.Duration {
		var mu sync.Mutex
		all := make([]time.Duration, 0, b.N)
		var wg sync.WaitGroup
		for c := 0; c < callers; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				mine := make([]time.Duration, 0, b.N/callers+1)
				for i := c; i < b.N; i += callers {
					start := time.Now()
					if err := call(); err != nil {
						b.Error(err)
						return
					}
					mine = append(mine, time.Since(start))
				}
				mu.Lock()
				all = append(all, mine...)
				mu.Unlock()
			}()
		}
		wg.Wait()
		return all
	}
	b.ResetTimer()
	stats := run(func() error { _, err := node.NodeGetVolumeStats(ctx, req); return err })
	noop := run(func() error { _, err := ident.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); return err })
	b.StopTimer()
	b.ReportMetric(percentile(stats, 50), "rpc-p50-µs")
	b.ReportMetric(percentile(stats, 99), "rpc-p99-µs")
	b.ReportMetric(percentile(noop, 50), "noop-p50-µs")
	b.ReportMetric(percentile(noop, 99), "noop-p99-µs")
}
