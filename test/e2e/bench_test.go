package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/harness"
)

// BenchmarkLifecycle times create → stage → publish → unpublish → unstage → delete
// of a 1 GiB xfs volume through poolcsi, and beside it the same steps as raw
// commands (truncate, losetup, mkfs.xfs, mount, bind mount, umount, losetup -d,
// rm), in one run so the two share the machine's state. Run with
//
//	go test ./test/e2e -run '^$' -bench Lifecycle -benchtime 20x
//
// Each reports its median as ms-median/op: a shared, noisy machine makes means
// drift, medians less so.
func BenchmarkLifecycle(b *testing.B) {
	testutil.RequireRoot(b)
	testutil.RequireCommands(b, "mkfs.xfs", "losetup", "mount", "umount", "truncate")
	root := b.TempDir()
	const size = 1 << 30

	b.Run("poolcsi", func(b *testing.B) {
		d := harness.Start(b, harness.Options{Pools: []string{"bench=" + filepath.Join(root, "pool")}})
		ctx := context.Background()
		vc := harness.MountCap("xfs", harness.RWO)
		staging, target := filepath.Join(root, "staging"), filepath.Join(root, "pod")
		steps := map[string][]time.Duration{}
		var times []time.Duration
		for i := 0; b.Loop(); i++ {
			start := time.Now()
			step := func(name string, call func() error) {
				t0 := time.Now()
				must(b, call())
				steps[name] = append(steps[name], time.Since(t0))
			}
			var id string
			step("create", func() error {
				v, err := d.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
					Name: "bench-" + strconv.Itoa(i), CapacityRange: &csi.CapacityRange{RequiredBytes: size},
					VolumeCapabilities: []*csi.VolumeCapability{vc},
				})
				id = v.GetVolume().GetVolumeId()
				return err
			})
			step("stage", func() error {
				_, err := d.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
				return err
			})
			step("publish", func() error {
				_, err := d.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc})
				return err
			})
			step("unpublish", func() error {
				_, err := d.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
				return err
			})
			step("unstage", func() error {
				_, err := d.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
				return err
			})
			step("delete", func() error {
				_, err := d.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
				return err
			})
			times = append(times, time.Since(start))
		}
		reportMedian(b, times)
		for name, ds := range steps {
			slices.Sort(ds)
			b.ReportMetric(float64(ds[len(ds)/2].Microseconds())/1000, name+"-ms")
		}
	})

	b.Run("raw-commands", func(b *testing.B) {
		img := filepath.Join(root, "raw.img")
		mnt, bind := filepath.Join(root, "raw-mnt"), filepath.Join(root, "raw-bind")
		must(b, os.MkdirAll(mnt, 0o750))
		must(b, os.MkdirAll(bind, 0o750))
		var times []time.Duration
		for b.Loop() {
			start := time.Now()
			run(b, "truncate", "-s", strconv.Itoa(size), img)
			dev := strings.TrimSpace(run(b, "losetup", "--direct-io=on", "-f", "--show", img))
			b.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
			run(b, "mkfs.xfs", "-q", dev)
			run(b, "mount", dev, mnt)
			run(b, "mount", "--bind", mnt, bind)
			run(b, "umount", bind)
			run(b, "umount", mnt)
			run(b, "losetup", "-d", dev)
			must(b, os.Remove(img))
			times = append(times, time.Since(start))
		}
		reportMedian(b, times)
	})
}

func reportMedian(b *testing.B, times []time.Duration) {
	if len(times) == 0 {
		return
	}
	slices.Sort(times)
	b.ReportMetric(float64(times[len(times)/2].Microseconds())/1000, "ms-median/op")
}

func must(b testing.TB, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

func run(b testing.TB, name string, args ...string) string {
	b.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		b.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}
