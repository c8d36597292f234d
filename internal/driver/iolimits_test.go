package driver

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/cgroup"
	"github.com/poolcsi/poolcsi/internal/iolimits"
	"github.com/poolcsi/poolcsi/internal/pool"
)

const testPod = "0d7d9a9e-3c1b-4d7e-9a55-1b2c3d4e5f60"

func (td *testDriver) publishPod(id string, vc *csi.VolumeCapability, pod string) error {
	_, err := td.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: filepath.Join(td.root, "staging", id),
		TargetPath: filepath.Join(td.root, "target", id), VolumeCapability: vc,
		VolumeContext: map[string]string{iolimits.PodUIDKey: pod},
	})
	return err
}

func (td *testDriver) modify(t *testing.T, id string, params map[string]string) {
	t.Helper()
	if _, err := td.ControllerModifyVolume(context.Background(), &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: params}); err != nil {
		t.Fatal(err)
	}
}

func (td *testDriver) device(t *testing.T, id string) string {
	t.Helper()
	vid, _ := pool.ParseVolumeID(id)
	dev, ok, err := td.Loops.Find(td.pool.ImagePath(vid))
	if err != nil || !ok {
		t.Fatalf("no loop device for %s: %v", id, err)
	}
	return dev
}

func TestIOLimitsReachPods(t *testing.T) {
	vc := mountCap(rwo, "ext4")
	limits := map[string]string{"readBytesPerSecond": "40Mi", "writeIOPS": "100"}
	want := cgroup.Limits{ReadBPS: 40 << 20, WriteIOPS: 100}
	tests := []struct {
		name    string
		created map[string]string // mutable_parameters at create
		pod     string            // pod UID in the volume context
		podCg   bool              // the pod's cgroup exists at publish
		code    codes.Code
		// then: what the pod's cgroup holds after publish, after a
		// reconcile (its cgroup made if missing), after a modify and a
		// reconcile
		atPublish, afterReconcile *cgroup.Limits
		change                    map[string]string
		afterChange               *cgroup.Limits
	}{
		{name: "limits at create reach the pod at publish", created: limits, pod: testPod, podCg: true,
			atPublish: &want, afterReconcile: &want,
			change: map[string]string{"readBytesPerSecond": "0", "writeBytesPerSecond": "1Mi"}, afterChange: &cgroup.Limits{WriteBPS: 1 << 20, WriteIOPS: 100}},
		{name: "a pod's cgroup found later is limited by the reconcile", created: limits, pod: testPod,
			afterReconcile: &want},
		{name: "a class set after publish reaches the running pod", pod: testPod, podCg: true,
			change: limits, afterChange: &want},
		{name: "limits set to none are cleared", created: limits, pod: testPod, podCg: true, atPublish: &want, afterReconcile: &want,
			change: map[string]string{"readBytesPerSecond": "0", "writeIOPS": "0"}, afterChange: &cgroup.Limits{}},
		{name: "no pod UID: nothing to throttle", created: limits},
		// Never part of a path, and no reason to refuse the pod its volume.
		{name: "a pod UID that is not a UUID is not used", created: limits, pod: "../../../etc", podCg: true},
		{name: "an upper-case UID is not used", created: limits, pod: "0D7D9A9E-3C1B-4D7E-9A55-1B2C3D4E5F60", podCg: true},
		{name: "a static pod's hash is not used", created: limits, pod: "6f4e1c0b7a2d9e8f6f4e1c0b7a2d9e8f", podCg: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			ctx := context.Background()
			resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{vc},
				CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, MutableParameters: tt.created})
			if err != nil {
				t.Fatal(err)
			}
			id := resp.GetVolume().GetVolumeId()
			if err := td.stage(id, vc); err != nil {
				t.Fatal(err)
			}
			if tt.podCg {
				td.host.AddPod(testPod)
			}
			err = td.publishPod(id, vc, tt.pod)
			wantCode(t, err, tt.code)
			if err != nil {
				if n := len(td.host.Mounts()); n != 1 {
					t.Errorf("a refused publish left %d mounts, want the staging mount only", n)
				}
				return
			}
			dev := td.device(t, id)
			check := func(when string, want *cgroup.Limits) {
				t.Helper()
				got, ok := td.host.PodLimits(testPod, dev)
				if want == nil {
					if ok {
						t.Errorf("%s: the pod's cgroup holds %+v, want nothing written", when, got)
					}
					return
				}
				if !ok || got != *want {
					t.Errorf("%s: the pod's cgroup holds %+v (written %t), want %+v", when, got, ok, *want)
				}
			}
			check("after publish", tt.atPublish)
			td.host.AddPod(testPod)
			td.throttle.Reconcile(ctx)
			check("after a reconcile", tt.afterReconcile)
			if tt.change != nil {
				td.modify(t, id, tt.change)
				td.throttle.Reconcile(ctx)
				check("after a modify", tt.afterChange)
			}
			// Unpublished, the pod is forgotten: nothing more is written.
			calls := td.host.Faults.Calls("Apply")
			if _, err := td.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: filepath.Join(td.root, "target", id)}); err != nil {
				t.Fatal(err)
			}
			td.modify(t, id, map[string]string{"readIOPS": "7"})
			td.throttle.Reconcile(ctx)
			if n := td.host.Faults.Calls("Apply"); n != calls {
				t.Errorf("%d cgroup writes after the unpublish", n-calls)
			}
		})
	}
}

// TestIOLimitsReachRestartedContainers: under cgroup v1 a pod-level limit does
// not hold the containers below it, so each container's cgroup is written; one
// restarted since holds nothing, and the next reconcile writes it again even
// though the volume's limits did not change (before, a reconcile skipped what
// it had written once).
func TestIOLimitsReachRestartedContainers(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	ctx := context.Background()
	vc := mountCap(rwo, "ext4")
	resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, MutableParameters: map[string]string{"writeBytesPerSecond": "8Mi"}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	td.host.AddPod(testPod)
	if err := td.publishPod(id, vc, testPod); err != nil {
		t.Fatal(err)
	}
	dev := td.device(t, id)
	want := cgroup.Limits{WriteBPS: 8 << 20}
	if got, ok := td.host.PodLimits(testPod, dev); !ok || got != want {
		t.Fatalf("after publish the pod holds %+v (%t), want %+v", got, ok, want)
	}
	td.host.RestartContainers(testPod)
	td.throttle.Reconcile(ctx)
	if got, ok := td.host.PodLimits(testPod, dev); !ok || got != want {
		t.Fatalf("after a container restart and a reconcile the pod holds %+v (%t), want %+v", got, ok, want)
	}
	// Nothing changed since: the next reconcile reads, and writes nothing.
	calls := td.host.Faults.Calls("Apply")
	td.throttle.Reconcile(ctx)
	if n := td.host.Faults.Calls("Apply"); n != calls {
		t.Fatalf("%d cgroup writes by a reconcile with nothing to change", n-calls)
	}
}

// TestIOLimitsReconcileRunsWithServer: the periodic reconcile started by Serve
// brings a changed class to a running pod, and stops with the server.
func TestIOLimitsReconcileRunsWithServer(t *testing.T) {
	td, id := servedPodWithChangedClass(t, 5*time.Millisecond)
	waitPodWriteLimit(t, td, id, 5<<20, "the reconcile never applied the changed limits")
}

// TestIOLimitsKick: a kick reaches a running pod at once, long before the
// reconcile's interval.
func TestIOLimitsKick(t *testing.T) {
	td, id := servedPodWithChangedClass(t, time.Hour)
	td.KickIOLimits()
	td.KickIOLimits() // kicks coalesce and never block
	waitPodWriteLimit(t, td, id, 5<<20, "the kick never applied the changed limits")
}

// servedPodWithChangedClass serves a driver whose I/O-limit reconcile runs
// every interval, publishes a volume to testPod and changes its class to a
// write limit of 5 MiB/s.
func servedPodWithChangedClass(t *testing.T, interval time.Duration) (*testDriver, string) {
	t.Helper()
	td := newTestDriver(t, testOpts{modify: func(o *Options) { o.IOLimitsInterval = interval }})
	td.serve(t)
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	td.host.AddPod(testPod)
	if err := td.publishPod(id, vc, testPod); err != nil {
		t.Fatal(err)
	}
	td.modify(t, id, map[string]string{"writeBytesPerSecond": "5Mi"})
	return td, id
}

// waitPodWriteLimit polls until testPod's limit on the volume's device is
// bps. Polled, not timed: the tests assert that it happens, not how fast.
func waitPodWriteLimit(t *testing.T, td *testDriver, id string, bps int64, never string) {
	t.Helper()
	dev := td.device(t, id)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if l, ok := td.host.PodLimits(testPod, dev); ok && l.WriteBPS == bps {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(never)
		}
	}
}

// restart is a new Driver on the same pools and fake kernel: a node plugin
// restarted (an upgrade, a crash) with every mount and loop device still
// there and nothing of the old one's memory.
func (td *testDriver) restart(t *testing.T) *testDriver {
	t.Helper()
	d, err := New(td.opts)
	if err != nil {
		t.Fatal(err)
	}
	d.registerNode(context.Background())
	return &testDriver{Driver: d, host: td.host, root: td.root, pool: td.pool}
}

// TestIOLimitsFoundAgainAfterRestart: a restarted node plugin finds the pods
// its image volumes are published to again from the mount table and kubelet's
// target paths, so a class changed after the restart reaches them, and writes
// nothing the kernel already holds. A path that is not kubelet's publish of a
// pod with a UUID is not tracked.
func TestIOLimitsFoundAgainAfterRestart(t *testing.T) {
	const pv = "pvc-1b2c3d4e"
	fsPath := func(uid string) string {
		return filepath.Join("kubelet/pods", uid, "volumes/kubernetes.io~csi", pv, "mount")
	}
	blockPath := func(uid string) string {
		return filepath.Join("kubelet/plugins/kubernetes.io/csi/volumeDevices/publish", pv, uid)
	}
	tests := []struct {
		name    string
		vc      *csi.VolumeCapability
		pod     string // in the volume context at publish
		target  string // below the test's root
		tracked bool
	}{
		{name: "filesystem publish", vc: mountCap(rwo, "ext4"), pod: "11111111-1111-4111-8111-111111111111",
			target: fsPath("11111111-1111-4111-8111-111111111111"), tracked: true},
		{name: "block publish", vc: blockCap(rwo), pod: "22222222-2222-4222-8222-222222222222",
			target: blockPath("22222222-2222-4222-8222-222222222222"), tracked: true},
		{name: "a static pod's hash where the UID goes", vc: mountCap(rwo, "ext4"), pod: "33333333-3333-4333-8333-333333333333",
			target: fsPath("6f4e1c0b7a2d9e8f6f4e1c0b7a2d9e8f")},
		{name: "an upper-case UID in a block path", vc: blockCap(rwo), pod: "44444444-4444-4444-8444-444444444444",
			target: blockPath("44444444-4444-4444-8444-44444444444A")},
		{name: "kubelet's global map path of a block volume is no publish", vc: blockCap(rwo), pod: "55555555-5555-4555-8555-555555555555",
			target: filepath.Join("kubelet/plugins/kubernetes.io/csi/volumeDevices", pv, "dev/55555555-5555-4555-8555-555555555555")},
		{name: "not a kubelet path", vc: mountCap(rwo, "ext4"), pod: "66666666-6666-4666-8666-666666666666", target: "target/x"},
	}
	ctx := context.Background()
	td := newTestDriver(t, testOpts{})
	created := cgroup.Limits{WriteIOPS: 100}
	changed := cgroup.Limits{ReadBPS: 1 << 20, WriteIOPS: 200}
	ids := make([]string, len(tests))
	for i, tt := range tests {
		resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("v%d", i), VolumeCapabilities: []*csi.VolumeCapability{tt.vc},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, MutableParameters: map[string]string{"writeIOPS": "100"}})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = resp.GetVolume().GetVolumeId()
		if err := td.stage(ids[i], tt.vc); err != nil {
			t.Fatal(err)
		}
		td.host.AddPod(tt.pod)
		if _, err := td.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: ids[i], StagingTargetPath: filepath.Join(td.root, "staging", ids[i]),
			TargetPath: filepath.Join(td.root, tt.target), VolumeCapability: tt.vc,
			VolumeContext: map[string]string{iolimits.PodUIDKey: tt.pod},
		}); err != nil {
			t.Fatalf("%s: publish: %v", tt.name, err)
		}
		if got, _ := td.host.PodLimits(tt.pod, td.device(t, ids[i])); got != created {
			t.Fatalf("%s: after publish the pod's cgroup holds %+v, want %+v", tt.name, got, created)
		}
	}

	rd := td.restart(t)
	rd.throttle.Rebuild(ctx)
	writes := td.host.Faults.Calls("Apply")
	rd.throttle.Reconcile(ctx)
	if n := td.host.Faults.Calls("Apply") - writes; n != 0 {
		t.Errorf("the first reconcile after the restart wrote %d cgroups, want none: the kernel already holds their limits", n)
	}
	for _, id := range ids {
		rd.modify(t, id, map[string]string{"readBytesPerSecond": "1Mi", "writeIOPS": "200"})
	}
	rd.throttle.Reconcile(ctx)

	throttled := rd.throttle.Pods()
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := created
			if tt.tracked {
				want = changed
			}
			if got, _ := td.host.PodLimits(tt.pod, td.device(t, ids[i])); got != want {
				t.Errorf("after the restart and a modify the pod's cgroup holds %+v, want %+v", got, want)
			}
			if _, ok := throttled[filepath.Join(td.root, tt.target)]; ok != tt.tracked {
				t.Errorf("tracked %t, want %t", ok, tt.tracked)
			}
		})
	}
}
