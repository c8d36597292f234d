package driver

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// fixture writes n ready block volumes straight into td's pool (their
// metadata and a sparse image each), much faster than n CreateVolumes.
func fixture(b *testing.B, td *testDriver, n int) {
	b.Helper()
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("pvc-%06d", i)
		id := pool.NewVolumeID("local", name)
		v := pool.Volume{SchemaVersion: pool.SchemaVersion, ID: id.String(), Name: name, Pool: "local", Layout: pool.LayoutImage,
			AccessType: pool.AccessBlock, CapacityBytes: pool.MiB, State: pool.StateReady, CreatedAt: time.Now().UTC()}
		raw, _ := json.Marshal(v)
		if err := os.MkdirAll(td.pool.Dir(id), 0o750); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(td.pool.MetadataPath(id), raw, 0o600); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(td.pool.ImagePath(id), nil, 0o600); err != nil {
			b.Fatal(err)
		}
		if err := os.Truncate(td.pool.ImagePath(id), pool.MiB); err != nil {
			b.Fatal(err)
		}
	}
	// The listing cache reuses a directory read once its last change is a few
	// seconds old, as in a pool that is not being written this instant.
	time.Sleep(3 * time.Second)
}

// BenchmarkListVolumes10k walks a pool of 10,000 volumes through ListVolumes
// (over the fake kernel; the cost is the pool's files): whole walks at 100 per
// page, unpaged, and 1 per page. Each op is one whole walk.
//
//	go test ./internal/driver -run '^$' -bench ListVolumes10k -benchtime 3x
func BenchmarkListVolumes10k(b *testing.B) {
	td := newTestDriver(b, testOpts{})
	fixture(b, td, 10000)
	for _, per := range []int32{100, 0, 1} {
		b.Run(fmt.Sprintf("per-page-%d", per), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				token, total := "", 0
				for {
					resp, err := td.ListVolumes(context.Background(), &csi.ListVolumesRequest{MaxEntries: per, StartingToken: token})
					if err != nil {
						b.Fatal(err)
					}
					total += len(resp.GetEntries())
					if token = resp.GetNextToken(); token == "" {
						break
					}
				}
				if total != 10000 {
					b.Fatalf("walk listed %d volumes", total)
				}
			}
		})
	}
}

// BenchmarkGetCapacity10k is GetCapacity on a pool of 10,000 volumes and on an
// empty pool, side by side in every iteration: from the capacity ledger, no
// walk of the pool (the images' blocks are measured at most every
// capacityTTL, so the first call measures them). The fixture writes around
// the ledger, so a create rebuilds it first. Reports
// both medians and their ratio (goal: within 1.5×).
//
//	go test ./internal/driver -run '^$' -bench GetCapacity10k -benchtime 200x
func BenchmarkGetCapacity10k(b *testing.B) {
	empty := newTestDriver(b, testOpts{})
	full := newTestDriver(b, testOpts{})
	fixture(b, full, 10000)
	ctx := context.Background()
	for _, td := range []*testDriver{empty, full} {
		// A create builds the ledger (one scan), as the first create after
		// an upgrade does; its delete leaves the pool as it was.
		resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "ledger", VolumeCapabilities: []*csi.VolumeCapability{blockCap(rwo)},
			CapacityRange: &csi.CapacityRange{RequiredBytes: pool.MiB}})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: resp.GetVolume().GetVolumeId()}); err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		if _, err := td.GetCapacity(ctx, &csi.GetCapacityRequest{}); err != nil { // the first measures the images
			b.Fatal(err)
		}
		if td == full {
			b.ReportMetric(float64(time.Since(start).Microseconds()), "10k-measuring-µs")
		}
	}
	var te, tf []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j, td := range []*testDriver{empty, full} {
			if i%2 == 1 { // the order alternates
				td = []*testDriver{full, empty}[j]
			}
			start := time.Now()
			if _, err := td.GetCapacity(ctx, &csi.GetCapacityRequest{}); err != nil {
				b.Fatal(err)
			}
			if td == empty {
				te = append(te, time.Since(start))
			} else {
				tf = append(tf, time.Since(start))
			}
		}
	}
	me, mf := medianDuration(te), medianDuration(tf)
	b.ReportMetric(float64(me.Nanoseconds())/1000, "empty-µs")
	b.ReportMetric(float64(mf.Nanoseconds())/1000, "10k-µs")
	b.ReportMetric(float64(mf)/float64(me), "10k/empty")
}

func medianDuration(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkControllerPublish10k is ControllerPublishVolume and
// ControllerUnpublishVolume of one volume, to a node with an attach limit that
// already holds 10 volumes, in a pool of 10,000: the limit's count reads the
// node's publish index, not every volume.json.
//
//	go test ./internal/driver -run '^$' -bench ControllerPublish10k -benchtime 200x
func BenchmarkControllerPublish10k(b *testing.B) {
	td := newTestDriver(b, testOpts{maxVols: 100})
	fixture(b, td, 10000)
	ctx := context.Background()
	vc := blockCap(rwo)
	publish := func(i int) string {
		vid := pool.NewVolumeID("local", fmt.Sprintf("pvc-%06d", i))
		// The fixture writes no lock files; publish takes the volume's.
		if err := os.WriteFile(filepath.Join(td.pool.Dir(vid), "lock"), nil, 0o600); err != nil {
			b.Fatal(err)
		}
		id := vid.String()
		if _, err := td.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: vc}); err != nil {
			b.Fatal(err)
		}
		return id
	}
	for i := range 10 {
		publish(i)
	}
	b.ResetTimer()
	for b.Loop() {
		id := publish(10)
		if _, err := td.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"}); err != nil {
			b.Fatal(err)
		}
	}
}
