package shared

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestWhileTheOtherNodeCreates: node 1 creates and deletes volumes in the
// shared pool while node 2 keeps asking what a livenessprobe, the external
// health monitor and an operator ask: Probe (with the chart's 3 s timeout),
// ListVolumes, ControllerListVolumeHealth and `poolcsi pool check`. Every
// answer must come within its deadline, and a volume that node 1 is still
// creating must never read as damaged: on CephFS another client's create is
// seen seconds late (the MDS's early replies), so a volume directory whose
// volume.json is not there yet is a create in flight, not lost metadata.
func TestWhileTheOtherNodeCreates(t *testing.T) { onEachBackend(t, testWhileTheOtherNodeCreates) }

func testWhileTheOtherNodeCreates(t *testing.T, e *env) {
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	slowest := map[string]time.Duration{}
	count := map[string]int{}
	watch := func(name string, every time.Duration, f func() error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				start := time.Now()
				err := f()
				d := time.Since(start)
				mu.Lock()
				count[name]++
				if d > slowest[name] {
					slowest[name] = d
				}
				mu.Unlock()
				if err != nil {
					t.Errorf("%s on node 2 while node 1 creates, after %s: %v", name, d, err)
				}
				time.Sleep(every)
			}
		}()
	}
	watch("Probe", 100*time.Millisecond, func() error {
		c, cancel := context.WithTimeout(context.Background(), csiproc.ProbeTimeout)
		defer cancel()
		_, err := e.d2.Identity().Probe(c, &csi.ProbeRequest{})
		return err
	})
	watch("ListVolumes", 50*time.Millisecond, func() error {
		_, err := e.d2.Controller().ListVolumes(context.Background(), &csi.ListVolumesRequest{})
		return err
	})
	watch("ControllerListVolumeHealth", 50*time.Millisecond, func() error {
		lh, err := e.d2.Controller().ControllerListVolumeHealth(context.Background(), &csi.ControllerListVolumeHealthRequest{})
		if len(lh.GetEntries()) != 0 {
			return fmt.Errorf("volumes reported unhealthy: %v", lh.GetEntries())
		}
		return err
	})
	watch("pool check", 200*time.Millisecond, func() error {
		out, err := exec.Command(csiproc.Binary(t), "pool", "check", "--path", e.pool2).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(out)))
		}
		return nil
	})
	for i := 0; i < 3; i++ {
		for _, layout := range []string{"dir", "image"} {
			vc := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
			if layout == "image" {
				vc = mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
			}
			r, err := e.d1.Controller().CreateVolume(context.Background(), &csi.CreateVolumeRequest{
				Name: fmt.Sprintf("busy-%s-%d", layout, i), Parameters: map[string]string{"pool": "shared", "layout": layout},
				VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
			if err != nil {
				t.Fatal(err)
			}
			if i%2 == 0 {
				if _, err := e.d1.Controller().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: r.GetVolume().GetVolumeId()}); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	stop()
	wg.Wait()
	for name, n := range count {
		t.Logf("%s on node 2: %d calls, slowest %s", name, n, slowest[name].Round(time.Millisecond))
	}
}
