package driver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/iolimits"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestPoolServesOnlyAfterItsStartPasses: the server answers while a pool's
// start-up passes are held up (as by a filesystem that hangs after its open
// answered), after one start wait; every call that reaches that pool answers
// UNAVAILABLE (but an unpublish) after waiting at most the lease margin, and
// changes nothing, until its passes have run (here: the publication of its
// volume to a pod found again for the I/O limits), while the other pool
// serves. Before, the server answered only once every pass had run over every
// pool.
func TestPoolServesOnlyAfterItsStartPasses(t *testing.T) {
	first := newTestDriver(t, testOpts{extraPool: true, modify: func(o *Options) {
		o.StartWait = 50 * time.Millisecond
		// A call on the held pool waits the margin before it answers.
		o.Lease = lease.Timing{Duration: time.Second, Interval: 100 * time.Millisecond, Margin: 200 * time.Millisecond}
	}})
	c := mountCap(rwo, "ext4")
	resp, err := first.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "held", Parameters: map[string]string{"pool": "other"},
		VolumeCapabilities: []*csi.VolumeCapability{c}, CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		MutableParameters: map[string]string{"writeIOPS": "100"}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	const pod = "11111111-1111-4111-8111-111111111111"
	target := filepath.Join(first.root, "kubelet/pods", pod, "volumes/kubernetes.io~csi/pv-held/mount")
	if err := first.stage(id, c); err != nil {
		t.Fatal(err)
	}
	first.host.AddPod(pod)
	if _, err := first.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: id,
		StagingTargetPath: filepath.Join(first.root, "staging", id), TargetPath: target, VolumeCapability: c,
		VolumeContext: map[string]string{iolimits.PodUIDKey: pod}}); err != nil {
		t.Fatal(err)
	}

	td := first.restart(t)
	tracked := func() bool { _, ok := td.throttle.Pods()[target]; return ok }
	gate := make(chan struct{})
	var held atomic.Bool
	td.beforePasses = func(ctx context.Context, p *pool.Pool) {
		if p.Name() == "other" {
			held.Store(true)
			select {
			case <-gate:
			case <-ctx.Done():
			}
		}
	}
	_, conn := td.serve(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("Probe while a pool's start-up passes are held up: %v", err)
	}
	if !held.Load() {
		t.Fatal("the pool's passes never started")
	}
	ctrl, node := csi.NewControllerClient(conn), csi.NewNodeClient(conn)
	staging := t.TempDir()
	validate := func() error {
		_, err := ctrl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{c}})
		return err
	}
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"ValidateVolumeCapabilities", validate},
		{"CreateVolume", func() error {
			_, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "new", Parameters: map[string]string{"pool": "other"},
				VolumeCapabilities: []*csi.VolumeCapability{c}, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
			return err
		}},
		{"DeleteVolume", func() error {
			_, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		}},
		{"NodeStageVolume", func() error {
			_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c})
			return err
		}},
	} {
		err := tc.call()
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "start-up passes have not run") {
			t.Errorf("%s in the held pool: %v, want UNAVAILABLE (start-up passes have not run)", tc.name, err)
		}
	}
	// An unpublish takes the pod's bind mount away, which no pass needs, and
	// must not wait for a pool that may never answer.
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: filepath.Join(td.root, "elsewhere")}); err != nil {
		t.Errorf("NodeUnpublishVolume in the held pool: %v", err)
	}
	if _, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "beside", Parameters: map[string]string{"pool": "local"},
		VolumeCapabilities: []*csi.VolumeCapability{c}, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}}); err != nil {
		t.Errorf("create in the pool beside it: %v", err)
	}
	if tracked() {
		t.Error("the held pool's publication was found again before its passes ran")
	}

	close(gate)
	if err := untilAvailable(ctx, validate); err != nil {
		t.Fatalf("the pool never served after its passes: %v", err)
	}
	if !tracked() {
		t.Error("the pool served before its publication to a pod was found again for the I/O limits")
	}
	// The refused calls changed nothing: the volume is still there (the
	// validate above), no other was made in the pool, nothing was staged.
	list, err := ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list.GetEntries() {
		if vid := e.GetVolume().GetVolumeId(); vid != id && strings.HasPrefix(vid, "other.") {
			t.Errorf("a refused call made volume %s in the held pool", vid)
		}
	}
	if got, err := os.ReadDir(staging); err != nil || len(got) > 0 {
		t.Errorf("the refused stage left %v (%v) in its staging path", got, err)
	}
}

// untilAvailable calls f until it succeeds or answers anything but UNAVAILABLE.
func untilAvailable(ctx context.Context, f func() error) error {
	for {
		err := f()
		if status.Code(err) != codes.Unavailable {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// TestTeardownGoesThroughAHeldPool: kubelet's teardown of a pod's volume
// (unpublish, then unstage) goes through at once on a pool held for its
// start-up passes, which may never run (a CephFS client the MDS evicted
// while the node plugin restarted answers ESHUTDOWN for good), and leaves
// nothing of the volume on this node. Before, the unstage waited the lease
// margin and answered UNAVAILABLE, for as long as the pool did not answer,
// and the volume's fenced loop device stayed attached (test/shared's
// lost-pool case "hang+restart" on CephFS). Each call's deadline is a third
// of the margin: one that waited for the pool would miss it.
func TestTeardownGoesThroughAHeldPool(t *testing.T) {
	first := newTestDriver(t, testOpts{extraPool: true, modify: func(o *Options) { o.StartWait = 50 * time.Millisecond }})
	c := mountCap(rwo, "ext4")
	resp, err := first.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "torn", Parameters: map[string]string{"pool": "other"},
		VolumeCapabilities: []*csi.VolumeCapability{c}, CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	const pod = "22222222-2222-4222-8222-222222222222"
	staging := filepath.Join(first.root, "staging", id)
	target := filepath.Join(first.root, "kubelet/pods", pod, "volumes/kubernetes.io~csi/pv-torn/mount")
	if err := first.stage(id, c); err != nil {
		t.Fatal(err)
	}
	first.host.AddPod(pod)
	if _, err := first.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: id,
		StagingTargetPath: staging, TargetPath: target, VolumeCapability: c}); err != nil {
		t.Fatal(err)
	}

	td := first.restart(t)
	td.beforePasses = func(ctx context.Context, p *pool.Pool) {
		if p.Name() == "other" {
			<-ctx.Done() // never answers while the test runs
		}
	}
	_, conn := td.serve(t)
	if !td.pools.Held("other") {
		t.Fatal("the pool is not held")
	}
	node := csi.NewNodeClient(conn)
	call := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), td.opts.Lease.Margin/3)
	}
	ctx, cancel := call()
	defer cancel()
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Errorf("NodeUnpublishVolume in the held pool: %v", err)
	}
	ctx, cancel = call()
	defer cancel()
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Errorf("NodeUnstageVolume in the held pool: %v", err)
	}
	if m, a := td.host.Mounts(), td.host.Attached(); len(m) != 0 || len(a) != 0 {
		t.Errorf("after the teardown this node still has mounts %v and loop devices %v", m, a)
	}
}
