package driver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// handleOf is the handle kubelet makes for a pod's inline volume.
func handleOf(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "csi-" + hex.EncodeToString(sum[:])
}

func (td *testDriver) ephTarget(handle string) string {
	sum := sha256.Sum256([]byte(handle))
	return filepath.Join(td.root, "pods", hex.EncodeToString(sum[:6]), "mount")
}

// ephPublish is kubelet's NodePublishVolume of an inline volume with attrs.
func (td *testDriver) ephPublish(handle string, vc *csi.VolumeCapability, attrs map[string]string) error {
	vctx := map[string]string{
		ctxEphemeral:                             "true",
		params.K8sPrefix + "pod.name":            "web-0",
		params.K8sPrefix + "pod.namespace":       "default",
		params.K8sPrefix + "pod.uid":             "0f6c7a4e-0000-4000-8000-000000000000",
		params.K8sPrefix + "serviceAccount.name": "default",
	}
	for k, v := range attrs {
		vctx[k] = v
	}
	_, err := td.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: handle, TargetPath: td.ephTarget(handle), VolumeCapability: vc, VolumeContext: vctx,
	})
	return err
}

func (td *testDriver) ephUnpublish(handle string) error {
	_, err := td.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: handle, TargetPath: td.ephTarget(handle)})
	return err
}

// ephVolume loads the volume of handle in the test pool (nil when none).
func (td *testDriver) ephVolume(t *testing.T, handle string) *pool.Volume {
	t.Helper()
	v, err := td.pool.Load(td.pool.NewID(pool.EphemeralName(handle)))
	if err != nil {
		return nil
	}
	return v
}

// requireNothingLeft fails when any volume, mount or loop device is left.
func (td *testDriver) requireNothingLeft(t *testing.T) {
	t.Helper()
	if m := td.host.Mounts(); len(m) != 0 {
		t.Errorf("mounts left: %v", m)
	}
	if a := td.host.Attached(); len(a) != 0 {
		t.Errorf("loop devices left: %v", a)
	}
	ents, err := os.ReadDir(filepath.Join(td.pool.Path(), "volumes"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		t.Errorf("volume directory left: %s", e.Name())
	}
	u, err := td.pool.Ledger().Usage()
	if err != nil {
		t.Fatal(err)
	}
	if u.ProvisionedBytes != 0 {
		t.Errorf("pool still counts %d provisioned bytes", u.ProvisionedBytes)
	}
}

func TestEphemeralPublishAttributes(t *testing.T) {
	fsCap := func(fs string) *csi.VolumeCapability { return mountCap(rwo, fs) }
	cases := []struct {
		name   string
		handle string
		vc     *csi.VolumeCapability
		attrs  map[string]string
		code   codes.Code
		size   int64
		fs     string
	}{
		{name: "defaults", vc: fsCap(""), size: pool.GiB, fs: "ext4"},
		{name: "size and fsType", vc: fsCap(""), attrs: map[string]string{"size": "100Mi", "fsType": "xfs"}, size: 300 << 20, fs: "xfs"},
		{name: "size rounded up to MiB", vc: fsCap(""), attrs: map[string]string{"size": "64M"}, size: 62 << 20, fs: "ext4"},
		{name: "fsType from the capability", vc: fsCap("btrfs"), attrs: map[string]string{"size": "200Mi"}, size: 200 << 20, fs: "btrfs"},
		{name: "pool named", vc: fsCap(""), attrs: map[string]string{"pool": "local", "size": "32Mi"}, size: 32 << 20, fs: "ext4"},
		{name: "unknown attribute", vc: fsCap(""), attrs: map[string]string{"sise": "1Gi"}, code: codes.InvalidArgument},
		{name: "layout is not an attribute", vc: fsCap(""), attrs: map[string]string{"layout": "dir"}, code: codes.InvalidArgument},
		{name: "size not a quantity", vc: fsCap(""), attrs: map[string]string{"size": "lots"}, code: codes.InvalidArgument},
		{name: "size zero", vc: fsCap(""), attrs: map[string]string{"size": "0"}, code: codes.InvalidArgument},
		{name: "size negative", vc: fsCap(""), attrs: map[string]string{"size": "-1Gi"}, code: codes.InvalidArgument},
		{name: "size too large", vc: fsCap(""), attrs: map[string]string{"size": "1Ei"}, code: codes.OutOfRange},
		{name: "fsType unknown", vc: fsCap(""), attrs: map[string]string{"fsType": "ntfs"}, code: codes.InvalidArgument},
		{name: "fsType contradicts capability", vc: fsCap("ext4"), attrs: map[string]string{"fsType": "xfs"}, code: codes.InvalidArgument},
		{name: "pool unknown", vc: fsCap(""), attrs: map[string]string{"pool": "../etc"}, code: codes.InvalidArgument},
		{name: "block capability", vc: blockCap(rwo), code: codes.InvalidArgument},
		{name: "multi-node mode", vc: mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, ""), code: codes.InvalidArgument},
		{name: "mount flag not allowed", vc: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: []string{"loop=/etc/passwd"}}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: rwo},
		}, code: codes.InvalidArgument},
		{name: "handle with a path", handle: "csi-../../etc", vc: fsCap(""), code: codes.InvalidArgument},
		{name: "handle too short", handle: "csi-abc", vc: fsCap(""), code: codes.InvalidArgument},
		{name: "handle upper case", handle: "CSI-" + handleOf("x")[4:], vc: fsCap(""), code: codes.InvalidArgument},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			h := tc.handle
			if h == "" {
				h = handleOf(tc.name)
			}
			err := td.ephPublish(h, tc.vc, tc.attrs)
			if tc.code != codes.OK {
				wantCode(t, err, tc.code)
				td.requireNothingLeft(t)
				return
			}
			if err != nil {
				t.Fatalf("publish: %v", err)
			}
			v := td.ephVolume(t, h)
			if v == nil {
				t.Fatal("no volume in the pool")
			}
			if v.CapacityBytes != tc.size || v.FSType != tc.fs || v.Layout != pool.LayoutImage || v.State != pool.StateReady {
				t.Errorf("volume %+v, want %d bytes of %s", v, tc.size, tc.fs)
			}
			if e := v.Ephemeral; e == nil || e.Handle != h || e.Node != "node-1" || e.Target != td.ephTarget(h) || e.Pod != "default/web-0" {
				t.Errorf("ephemeral record %+v", v.Ephemeral)
			}
			if m := td.host.Mounts(); len(m) != 1 || m[0].Target != td.ephTarget(h) || m[0].FSType != tc.fs {
				t.Errorf("mounts %+v", m)
			}
			if err := td.ephUnpublish(h); err != nil {
				t.Fatalf("unpublish: %v", err)
			}
			td.requireNothingLeft(t)
		})
	}
}

func TestEphemeralPoolAllowed(t *testing.T) {
	yes, no := true, false
	cases := []struct {
		name      string
		shared    bool
		ephemeral *bool
		code      codes.Code
	}{
		{"local by default", false, nil, codes.OK},
		{"local turned off", false, &no, codes.InvalidArgument},
		{"shared by default refused", true, nil, codes.InvalidArgument},
		{"shared allowed by its config", true, &yes, codes.OK},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{shared: tc.shared, ephemeral: tc.ephemeral})
			h := handleOf(tc.name)
			err := td.ephPublish(h, mountCap(rwo, ""), map[string]string{"pool": "local", "size": "64Mi"})
			wantCode(t, err, tc.code)
			if tc.code != codes.OK {
				td.requireNothingLeft(t)
				return
			}
			if err := td.ephUnpublish(h); err != nil {
				t.Fatal(err)
			}
			td.requireNothingLeft(t)
		})
	}
}

func TestEphemeralDefaultPool(t *testing.T) {
	cases := []struct {
		name    string
		opts    testOpts
		want    string
		newFail bool
	}{
		{name: "first local pool", opts: testOpts{extraPool: true}, want: "local"},
		{name: "flag names the pool", opts: testOpts{extraPool: true, modify: func(o *Options) { o.EphemeralPool = "other" }}, want: "other"},
		{name: "flag names no pool", opts: testOpts{modify: func(o *Options) { o.EphemeralPool = "nope" }}, newFail: true},
		{name: "flag names a shared pool", opts: testOpts{shared: true, modify: func(o *Options) { o.EphemeralPool = "local" }}, newFail: true},
		{name: "only a shared pool: none", opts: testOpts{shared: true}, want: ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.newFail {
				root := t.TempDir()
				p, err := pool.Initialise(pool.Config{Name: "local", Path: filepath.Join(root, "pool"), Shared: tc.opts.shared})
				if err != nil {
					t.Fatal(err)
				}
				o := Options{Name: "x", NodeID: "n", Mode: ModeAll, Pools: []*pool.Pool{p}}
				tc.opts.modify(&o)
				if _, err := defaultEphemeralPool(o); err == nil {
					t.Fatal("New accepted the ephemeral pool")
				}
				return
			}
			td := newTestDriver(t, tc.opts)
			got := ""
			if td.ephemeralPool != nil {
				got = td.ephemeralPool.Name()
			}
			if got != tc.want {
				t.Fatalf("default ephemeral pool %q, want %q", got, tc.want)
			}
		})
	}
}

func TestEphemeralIdempotent(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	h := handleOf("idem")
	attrs := map[string]string{"size": "64Mi"}
	for i := 0; i < 2; i++ {
		if err := td.ephPublish(h, mountCap(rwo, ""), attrs); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	if m := td.host.Mounts(); len(m) != 1 {
		t.Fatalf("mounts after two publishes: %v", m)
	}
	// Same handle, other attributes: the live volume stays.
	wantCode(t, td.ephPublish(h, mountCap(rwo, ""), map[string]string{"size": "128Mi"}), codes.AlreadyExists)
	wantCode(t, td.ephPublish(h, mountCap(rwo, "xfs"), attrs), codes.AlreadyExists)
	if td.ephVolume(t, h) == nil || len(td.host.Mounts()) != 1 {
		t.Fatal("a refused publish took the live volume down")
	}
	// kubelet asks for stats by the handle.
	resp, err := td.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: h, VolumePath: td.ephTarget(h)})
	if err != nil {
		t.Fatalf("stats: %v", err)
	}
	if len(resp.GetUsage()) == 0 {
		t.Fatalf("stats without usage: %v", resp)
	}
	_, err = td.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{VolumeId: h, VolumePath: td.ephTarget(h), CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
	wantCode(t, err, codes.InvalidArgument)
	for i := 0; i < 2; i++ {
		if err := td.ephUnpublish(h); err != nil {
			t.Fatalf("unpublish %d: %v", i, err)
		}
	}
	td.requireNothingLeft(t)
	_, err = td.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: h, VolumePath: td.ephTarget(h)})
	wantCode(t, err, codes.NotFound)
	// An unknown handle's unpublish is done.
	if err := td.ephUnpublish(handleOf("never")); err != nil {
		t.Fatalf("unpublish of an unknown handle: %v", err)
	}
}

func TestEphemeralFailureLeavesNothing(t *testing.T) {
	for _, method := range []string{"Format", "Attach", "DiskFormat", "Mount"} {
		t.Run(method, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			h := handleOf(method)
			td.host.Faults.FailNth(method, 1, errInjected)
			if err := td.ephPublish(h, mountCap(rwo, "xfs"), map[string]string{"size": "300Mi"}); status.Code(err) != codes.Internal {
				t.Fatalf("publish with %s failing: %v, want Internal", method, err)
			}
			td.requireNothingLeft(t)
			if err := td.ephPublish(h, mountCap(rwo, "xfs"), map[string]string{"size": "300Mi"}); err != nil {
				t.Fatalf("retry: %v", err)
			}
			if err := td.ephUnpublish(h); err != nil {
				t.Fatal(err)
			}
			td.requireNothingLeft(t)
		})
	}
	t.Run("target holds another mount", func(t *testing.T) {
		td := newTestDriver(t, testOpts{})
		other, h := handleOf("first"), handleOf("second")
		if err := td.ephPublish(other, mountCap(rwo, ""), map[string]string{"size": "64Mi"}); err != nil {
			t.Fatal(err)
		}
		_, err := td.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
			VolumeId: h, TargetPath: td.ephTarget(other), VolumeCapability: mountCap(rwo, ""),
			VolumeContext: map[string]string{ctxEphemeral: "true", "size": "64Mi"},
		})
		wantCode(t, err, codes.AlreadyExists)
		if td.ephVolume(t, h) != nil {
			t.Error("the refused volume was left in the pool")
		}
		if td.ephVolume(t, other) == nil || len(td.host.Mounts()) != 1 {
			t.Error("the other volume was taken down")
		}
		if err := td.ephUnpublish(other); err != nil {
			t.Fatal(err)
		}
		td.requireNothingLeft(t)
	})
}

// A restarted driver (same kernel, same pool) sweeps the inline volumes whose
// target no longer shows them and keeps the one a pod still has mounted.
func TestEphemeralSweep(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	live, orphan := handleOf("live"), handleOf("orphan")
	for _, h := range []string{live, orphan} {
		if err := td.ephPublish(h, mountCap(rwo, ""), map[string]string{"size": "64Mi"}); err != nil {
			t.Fatal(err)
		}
	}
	// The orphan's pod went while no driver ran: its target was unmounted
	// (a reboot, or kubelet cleaning up), its loop device is still there.
	if err := td.host.UnmountChecked(context.Background(), td.ephTarget(orphan), nil); err != nil {
		t.Fatal(err)
	}
	// A publish that crashed after reserving: a creating record, no image.
	crashed := handleOf("crashed")
	if _, err := td.pool.Reserve(context.Background(), pool.Spec{
		Name: pool.EphemeralName(crashed), Layout: pool.LayoutImage, AccessType: pool.AccessFilesystem, FSType: "ext4",
		CapacityBytes: 64 << 20, Ephemeral: &pool.EphemeralRecord{Handle: crashed, Node: "node-1", Target: td.ephTarget(crashed)},
	}); err != nil {
		t.Fatal(err)
	}
	// Another node's inline volume on the same (shared) pool is not this node's to sweep.
	foreign := handleOf("foreign")
	if _, err := td.pool.Reserve(context.Background(), pool.Spec{
		Name: pool.EphemeralName(foreign), Layout: pool.LayoutImage, AccessType: pool.AccessFilesystem, FSType: "ext4",
		CapacityBytes: 64 << 20, Ephemeral: &pool.EphemeralRecord{Handle: foreign, Node: "node-2", Target: "/var/lib/kubelet/x"},
	}); err != nil {
		t.Fatal(err)
	}

	restarted, err := New(td.opts)
	if err != nil {
		t.Fatal(err)
	}
	// A publish of the crashed one under way holds its handle: not swept.
	release, err := restarted.locks.acquire(crashed, "NodePublishVolume")
	if err != nil {
		t.Fatal(err)
	}
	if n := restarted.inline.Sweep(context.Background()); n != 1 {
		t.Fatalf("swept %d, want 1 (the orphan)", n)
	}
	release()
	if n := restarted.inline.Sweep(context.Background()); n != 1 {
		t.Fatalf("second sweep removed %d, want 1 (the crashed publish)", n)
	}
	for h, want := range map[string]bool{live: true, orphan: false, crashed: false, foreign: true} {
		if got := td.ephVolume(t, h) != nil; got != want {
			t.Errorf("volume of %s present=%t, want %t", h[:12], got, want)
		}
	}
	if a := td.host.Attached(); len(a) != 1 {
		t.Errorf("attached after the sweep: %v, want the live one's only", a)
	}
	if n := restarted.inline.Sweep(context.Background()); n != 0 {
		t.Fatalf("a third sweep removed %d", n)
	}
	// The restarted driver unpublishes the live one as kubelet will.
	if _, err := restarted.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: live, TargetPath: td.ephTarget(live)}); err != nil {
		t.Fatal(err)
	}
	if m, a := td.host.Mounts(), td.host.Attached(); len(m) != 0 || len(a) != 0 {
		t.Errorf("left: mounts %v, loops %v", m, a)
	}
}

// The controller never deletes, lists, expands or publishes an inline volume,
// and no CreateVolume name can take an inline volume's key.
func TestEphemeralHiddenFromController(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	h := handleOf("hidden")
	if err := td.ephPublish(h, mountCap(rwo, ""), map[string]string{"size": "64Mi"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = td.ephUnpublish(h) })
	id := td.pool.NewID(pool.EphemeralName(h)).String()
	ctx := context.Background()
	_, err := td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	wantCode(t, err, codes.FailedPrecondition)
	_, err = td.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
	wantCode(t, err, codes.InvalidArgument)
	_, err = td.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: mountCap(rwo, "")})
	wantCode(t, err, codes.InvalidArgument)
	_, err = td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(td.root, "st"), VolumeCapability: mountCap(rwo, "")})
	wantCode(t, err, codes.InvalidArgument)
	_, err = td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: pool.EphemeralName(h), VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "")}})
	wantCode(t, err, codes.InvalidArgument)
	list, err := td.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetEntries()) != 0 {
		t.Errorf("ListVolumes shows %v", list.GetEntries())
	}
	if td.ephVolume(t, h) == nil || len(td.host.Mounts()) != 1 {
		t.Fatal("the inline volume was touched")
	}
}
