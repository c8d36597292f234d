package driver

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/poolset"
)

// TestStatsConditionCacheShrinks: every pod publishes at a new path, and each
// NodeGetVolumeStats caches the health of that path; a node that runs pods for
// months must not keep one entry per pod it ever ran.
func TestStatsConditionCacheShrinks(t *testing.T) {
	td := newTestDriver(t, testOpts{modify: func(o *Options) { o.StatsHealthTTL = time.Hour }})
	ctx := context.Background()
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(td.root, "staging", id)
	const pods = 50
	for i := range pods {
		target := filepath.Join(td.root, "pods", fmt.Sprint(i), "mount")
		if _, err := td.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc,
		}); err != nil {
			t.Fatal(err)
		}
		for _, st := range []string{staging, ""} { // kubelet sends the staging path, or not
			if _, err := td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target, StagingTargetPath: st}); err != nil {
				t.Fatal(err)
			}
		}
		if n := td.conditions.len(); n != 2 {
			t.Fatalf("pod %d: %d cached conditions while published, want 2", i, n)
		}
		if _, err := td.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
			t.Fatal(err)
		}
		if n := td.conditions.len(); n != 0 {
			t.Fatalf("pod %d: %d cached conditions after unpublish, want 0", i, n)
		}
	}
	if _, err := td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := td.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if n := td.conditions.len(); n != 0 {
		t.Fatalf("%d cached conditions after unstage, want 0", n)
	}
}

// TestStatsConditionCacheBounded: paths never unpublished through this process
// (a kubelet that asked about them and moved on) cannot grow the cache past
// its cap.
func TestStatsConditionCacheBounded(t *testing.T) {
	tests := []struct {
		name string
		ttl  time.Duration
		max  int
	}{
		{"reused", time.Hour, maxCachedConditions},
		{"never reused, never kept", 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{modify: func(o *Options) { o.StatsHealthTTL = tt.ttl }})
			id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
			rq, err := td.resolve(context.Background(), rpcNodeGetVolumeStats, id, poolset.Access{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			vid, p := rq.id, rq.pool
			for i := range maxCachedConditions + 100 {
				if _, err := td.statsCondition(p, vid, "", filepath.Join(td.root, "gone", fmt.Sprint(i))); err != nil {
					t.Fatal(err)
				}
				if n := td.conditions.len(); n > tt.max {
					t.Fatalf("after %d paths: %d cached conditions, want at most %d", i+1, n, tt.max)
				}
			}
		})
	}
}
