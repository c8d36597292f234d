package driver

import (
	"context"
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

const rwx = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER

// testShareKey is the cluster's share key of the test drivers.
var testShareKey = []byte("0123456789abcdef0123456789abcdef-test")

// newShareDriver is a test driver whose StorageClasses may name shares, over
// fake shares under shareRoot (shared by drivers standing for two nodes).
func newShareDriver(t testing.TB, shareRoot, node string, types ...string) (*testDriver, *fake.Shares) {
	t.Helper()
	fs := fake.NewShares(shareRoot)
	td := newTestDriver(t, testOpts{modify: func(o *Options) {
		o.NodeID = node
		o.Shares = fs
		o.ShareKeys = [][]byte{testShareKey}
		if types != nil {
			o.ShareTypes = types
		}
	}})
	return td, fs
}

// taggedID is the ID, as a CO holds it, of volume name on share r: tagged
// under key.
func taggedID(key []byte, r pool.ShareRef, name string) string {
	return pool.NewShareVolumeID(r, name).String() + "." + poolset.Tag(key, r)
}

func nfsParams() map[string]string {
	return map[string]string{"server": "nfs.example.com", "share": "/export/poolcsi"}
}

// TestShareParameters: every share parameter is checked before anything is
// mounted; a bad one is INVALID_ARGUMENT and nothing is mounted or written.
func TestShareParameters(t *testing.T) {
	tests := []struct {
		name   string
		params map[string]string
		ok     bool
		types  []string
	}{
		{"nfs server and share", nfsParams(), true, nil},
		{"nfs4 server and share", map[string]string{"server": "10.0.0.1", "share": "/", "shareType": "nfs4"}, true, nil},
		{"type and source", map[string]string{"shareType": "ceph", "shareSource": "mon.example.com:/volumes/csi"}, true, nil},
		{"ceph-fuse when allowed", map[string]string{"shareType": "fuse.ceph", "shareSource": "v2:10.0.0.1:3300:/csi", "shareOptions": "name=csi,fs=cephfs"}, true, []string{"fuse.ceph"}},
		{"ceph-fuse not allowed by default", map[string]string{"shareType": "fuse.ceph", "shareSource": "10.0.0.1:/csi"}, false, nil},
		{"ceph-fuse source with options", map[string]string{"shareType": "fuse.ceph", "shareSource": "id=csi,admin_socket=/etc/x"}, false, []string{"fuse.ceph"}},
		{"ceph-fuse admin_socket", map[string]string{"shareType": "fuse.ceph", "shareSource": "10.0.0.1:/", "shareOptions": "admin_socket=/etc/passwd"}, false, []string{"fuse.ceph"}},
		{"ceph-fuse ceph. option", map[string]string{"shareType": "fuse.ceph", "shareSource": "10.0.0.1:/", "shareOptions": "ceph.log_file=/etc/x"}, false, []string{"fuse.ceph"}},
		{"ceph secretfile", map[string]string{"shareType": "ceph", "shareSource": "10.0.0.1:/", "shareOptions": "secretfile=/etc/shadow"}, false, nil},
		{"ceph conf", map[string]string{"shareType": "ceph", "shareSource": "10.0.0.1:/", "shareOptions": "conf=/etc/x.conf"}, false, nil},
		{"ceph secret outside the secrets", map[string]string{"shareType": "ceph", "shareSource": "10.0.0.1:/", "shareOptions": "secret=AQDkeykeykeykeykey=="}, false, nil},
		{"ceph new-style source", map[string]string{"shareType": "ceph", "shareSource": "csi@.cephfs=/volumes"}, true, nil},
		{"nfs bg", map[string]string{"server": "s", "share": "/e", "shareOptions": "bg"}, false, nil},
		{"X-mount option", map[string]string{"server": "s", "share": "/e", "shareOptions": "X-mount.mkdir"}, false, nil},
		{"helper option", map[string]string{"server": "s", "share": "/e", "shareOptions": "helper=ceph"}, false, nil},
		{"upper-case key", map[string]string{"server": "s", "share": "/e", "shareOptions": "Hard"}, false, nil},
		{"nfs source with a second colon path", map[string]string{"shareType": "nfs", "shareSource": "s:/e:/f"}, false, nil},
		{"nfs path with ..", map[string]string{"server": "s", "share": "/e/../etc"}, false, nil},
		{"nfs server starting with -", map[string]string{"shareType": "nfs", "shareSource": "-s:/e"}, false, nil},
		{"ipv6 server", map[string]string{"shareType": "nfs", "shareSource": "[fd00::1]:/e"}, true, nil},
		{"share options", map[string]string{"server": "s", "share": "/e", "shareOptions": "nfsvers=4.1,hard"}, true, nil},
		{"image layout", map[string]string{"server": "s", "share": "/e", "layout": "image"}, true, nil},
		{"server without share", map[string]string{"server": "s"}, false, nil},
		{"share without server", map[string]string{"share": "/e"}, false, nil},
		{"relative share", map[string]string{"server": "s", "share": "e"}, false, nil},
		{"server with path", map[string]string{"server": "s:/x", "share": "/e"}, false, nil},
		{"server and source", map[string]string{"server": "s", "share": "/e", "shareSource": "s:/e", "shareType": "nfs"}, false, nil},
		{"server with ceph type", map[string]string{"server": "s", "share": "/e", "shareType": "ceph"}, false, nil},
		{"type without source", map[string]string{"shareType": "nfs"}, false, nil},
		{"source without type", map[string]string{"shareSource": "s:/e"}, false, nil},
		{"options alone", map[string]string{"shareOptions": "hard"}, false, nil},
		{"type not allowed", map[string]string{"shareType": "bind", "shareSource": "/etc"}, false, nil},
		{"type xfs not allowed", map[string]string{"shareType": "xfs", "shareSource": "/dev/sda"}, false, nil},
		{"pool and share", map[string]string{"server": "s", "share": "/e", "pool": "local"}, false, nil},
		{"source as option", map[string]string{"shareType": "nfs", "shareSource": "-oremount"}, false, nil},
		{"shell in source", map[string]string{"shareType": "fuse.ceph", "shareSource": "id=x;reboot"}, false, nil},
		{"newline in source", map[string]string{"shareType": "nfs", "shareSource": "s:/e\nx"}, false, nil},
		{"NUL in source", map[string]string{"shareType": "nfs", "shareSource": "s:/e\x00"}, false, nil},
		{"source too long", map[string]string{"server": "s", "share": "/" + strings.Repeat("e", 60)}, false, nil},
		{"empty option", map[string]string{"server": "s", "share": "/e", "shareOptions": "hard,,soft"}, false, nil},
		{"newline in option", map[string]string{"server": "s", "share": "/e", "shareOptions": "hard\nro"}, false, nil},
		{"space in option", map[string]string{"server": "s", "share": "/e", "shareOptions": "a b"}, false, nil},
		{"bind option", map[string]string{"server": "s", "share": "/e", "shareOptions": "bind"}, false, nil},
		{"remount option", map[string]string{"server": "s", "share": "/e", "shareOptions": "remount"}, false, nil},
		{"loop option", map[string]string{"server": "s", "share": "/e", "shareOptions": "loop=/dev/loop0"}, false, nil},
		{"x- option", map[string]string{"server": "s", "share": "/e", "shareOptions": "x-systemd.automount"}, false, nil},
		{"unknown key", map[string]string{"server": "s", "share": "/e", "subDir": "x"}, false, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td, fs := newShareDriver(t, filepath.Join(t.TempDir(), "shares"), "node-1", tt.types...)
			_, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
				Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwx, "")}, Parameters: tt.params,
			})
			if tt.ok {
				if tt.params["layout"] == "image" {
					// An image layout refuses RWX: the parameters passed.
					wantCode(t, err, codes.InvalidArgument)
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			wantCode(t, err, codes.InvalidArgument)
			if fs.MountCount() != 0 {
				t.Fatalf("a refused request mounted %+v", fs.Mounts)
			}
			if _, err := os.Stat(fs.Root); !os.IsNotExist(err) {
				t.Fatalf("a refused request made %s: %v", fs.Root, err)
			}
		})
	}
}

// TestShareVolumeLifecycle: a StorageClass naming a share provisions on it
// with no pool configured for it, the ID names the share, another node
// stages from the volume context alone, and a restarted controller deletes
// from the ID alone.
func TestShareVolumeLifecycle(t *testing.T) {
	ctx := context.Background()
	shares := filepath.Join(t.TempDir(), "shares")
	ctrl, ctrlShares := newShareDriver(t, shares, "node-1")
	vc := mountCap(rwx, "")
	vc.GetMount().MountFlags = []string{"nfsvers=4.1", "noatime"}
	params := nfsParams()
	params["shareOptions"] = "hard"
	resp, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: params,
		Secrets: map[string]string{"mountOptions": "sec=sys"},
	})
	if err != nil {
		t.Fatal(err)
	}
	v := resp.GetVolume()
	vid, err := pool.ParseVolumeID(v.GetVolumeId())
	if err != nil {
		t.Fatal(err)
	}
	ref, ok := vid.ShareRef()
	if want := (pool.ShareRef{Type: "nfs", Source: "nfs.example.com:/export/poolcsi"}); !ok || ref != want {
		t.Fatalf("ID %s names share %+v, want %+v", vid, ref, want)
	}
	if c := v.GetVolumeContext(); c["layout"] != "dir" || c["shareType"] != "nfs" || c["shareSource"] != ref.Source || c["shareOptions"] != "hard" {
		t.Fatalf("volume context %v", c)
	}
	if len(ctrlShares.Mounts) != 1 {
		t.Fatalf("mounts %+v", ctrlShares.Mounts)
	}
	m := ctrlShares.Mounts[0]
	// shareOptions and the non-generic mount flags are the share's; noatime is the volume's bind.
	if strings.Join(m.Options, ",") != "hard,nfsvers=4.1" || strings.Join(m.Sensitive, ",") != "sec=sys" {
		t.Fatalf("mounted with options %v, sensitive %v", m.Options, m.Sensitive)
	}
	if _, err := os.Stat(filepath.Join(shares, ref.PoolName(), "pool.json")); err != nil {
		t.Fatalf("no pool laid out on the share: %v", err)
	}

	// Node 2 has no pool of the share either: the volume context, capability
	// and secrets bring what mounting it takes.
	node, nodeShares := newShareDriver(t, shares, "node-2")
	nodeShares.Unmount(ref) // its own mount, not node 1's
	if _, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.GetVolumeId(), NodeId: "node-2", VolumeCapability: vc, VolumeContext: v.GetVolumeContext(),
	}); err != nil {
		t.Fatalf("publish to a node that never mounted the share: %v", err)
	}
	staging := filepath.Join(node.root, "staging")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: v.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: vc,
		VolumeContext: v.GetVolumeContext(), Secrets: map[string]string{"mountOptions": "sec=sys"},
	}); err != nil {
		t.Fatal(err)
	}
	if len(nodeShares.Mounts) != 1 || strings.Join(nodeShares.Mounts[0].Options, ",") != "hard,nfsvers=4.1" {
		t.Fatalf("node mounts %+v", nodeShares.Mounts)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "node-2"}); err != nil {
		t.Fatal(err)
	}

	// A controller restarted on another machine: nothing mounted, nothing
	// known. A call that only reads mounts nothing; a delete, whose ID
	// carries the share's tag, mounts the share and finds the volume.
	ctrl2, ctrl2Shares := newShareDriver(t, shares, "node-3")
	ctrl2Shares.Unmount(ref)
	_, err = ctrl2.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: v.GetVolumeId()})
	wantCode(t, err, codes.Unavailable)
	if ctrl2Shares.MountCount() != 0 {
		t.Fatal("ControllerGetVolume mounted a share")
	}
	if _, err := ctrl2.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "node-2"}); err != nil {
		t.Fatalf("ControllerUnpublishVolume on a controller that never saw the share: %v", err)
	}
	list, err := ctrl2.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetVolume().GetVolumeId() != v.GetVolumeId() {
		t.Fatalf("ListVolumes after the share was found: %v %v", list, err)
	}
	if _, err := ctrl2.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	if ctrl2.Driver.pools.Pool(ref.PoolName()).VolumeExists(vid) {
		t.Fatal("volume still there")
	}
}

// TestShareRecoveredAfterRestart: a driver restarted on the same node serves
// the shares it had mounted before any call names them.
func TestShareRecoveredAfterRestart(t *testing.T) {
	shares := filepath.Join(t.TempDir(), "shares")
	td, fs := newShareDriver(t, shares, "node-1")
	id := td.create(t, "pvc-1", mountCap(rwx, ""), nfsParams())
	again := newTestDriver(t, testOpts{modify: func(o *Options) { o.Shares = fs; o.ShareKeys = [][]byte{testShareKey} }})
	again.pools.Recover(context.Background())
	list, err := again.ListVolumes(context.Background(), &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetVolume().GetVolumeId() != id {
		t.Fatalf("ListVolumes after a restart: %v %v", list, err)
	}
	if fs.MountCount() != 1 {
		t.Fatalf("mounted %d times", fs.MountCount())
	}
}

// TestStatsNeverMountShares: NodeGetVolumeStats and NodeGetVolumeHealth, which
// kubelet repeats on staged volumes and which bring no options, never mount a
// share: a volume whose share this driver does not serve is UNAVAILABLE.
func TestStatsNeverMountShares(t *testing.T) {
	ctx := context.Background()
	shares := filepath.Join(t.TempDir(), "shares")
	td, fs := newShareDriver(t, shares, "node-1")
	id := td.create(t, "pvc-1", mountCap(rwx, ""), nfsParams())
	other := newTestDriver(t, testOpts{modify: func(o *Options) { o.NodeID = "node-2"; o.Shares = fs }})
	fs.Unmount(pool.ShareRef{Type: "nfs", Source: "nfs.example.com:/export/poolcsi"}) // a call that mounts would count
	before := fs.MountCount()
	_, err := other.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: filepath.Join(other.root, "t")})
	wantCode(t, err, codes.Unavailable)
	_, err = other.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id, VolumePublishPath: filepath.Join(other.root, "t")})
	wantCode(t, err, codes.Unavailable)
	if fs.MountCount() != before {
		t.Fatal("a stats or health call mounted a share")
	}
}

// TestForgedShareID: an ID alone never starts a mount. An untagged ID of a
// share this node never mounted, or one whose tag does not verify, mounts
// nothing and leaves nothing behind, in every call; the calls that only read
// or tear down mount nothing even for a good tag. An ID whose tag verifies but
// whose share holds no pool is mounted (it must be, to know), found empty and
// let go, and nothing is laid out.
func TestForgedShareID(t *testing.T) {
	ctx := context.Background()
	td, fs := newShareDriver(t, filepath.Join(t.TempDir(), "shares"), "node-1")
	ref := pool.ShareRef{Type: "nfs", Source: "evil.example.com:/"}
	untagged := pool.NewShareVolumeID(ref, "pvc-x").String()
	badTag := untagged + ".AAAAAAAAAAA"
	goodTag := taggedID(testShareKey, ref, "pvc-x")
	otherKey := taggedID([]byte("another cluster's key, 32 bytes or more"), ref, "pvc-x")
	staging, target := filepath.Join(td.root, "s"), filepath.Join(td.root, "t")
	calls := map[string]func(id string) error{
		"DeleteVolume": func(id string) error {
			_, err := td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		},
		"ControllerPublishVolume": func(id string) error {
			_, err := td.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: mountCap(rwx, ""),
				VolumeContext: map[string]string{"shareType": ref.Type, "shareSource": ref.Source}})
			return err
		},
		"ControllerUnpublishVolume": func(id string) error {
			_, err := td.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"})
			return err
		},
		"NodeStageVolume": func(id string) error {
			_, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap(rwx, ""),
				VolumeContext: map[string]string{"shareType": ref.Type, "shareSource": ref.Source}})
			return err
		},
		"CreateSnapshot": func(id string) error {
			_, err := td.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: id})
			return err
		},
		"ControllerExpandVolume": func(id string) error {
			_, err := td.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
			return err
		},
	}
	readOnly := map[string]func(id string) error{
		"ControllerGetVolume": func(id string) error {
			_, err := td.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
			return err
		},
		"ValidateVolumeCapabilities": func(id string) error {
			_, err := td.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwx, "")}})
			return err
		},
		"NodeUnpublishVolume": func(id string) error {
			_, err := td.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
			return err
		},
		"NodeUnstageVolume": func(id string) error {
			_, err := td.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		},
		"NodeGetVolumeStats": func(id string) error {
			_, err := td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
			return err
		},
		"NodeExpandVolume": func(id string) error {
			_, err := td.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target})
			return err
		},
	}
	nothingLeft := func(t *testing.T) {
		t.Helper()
		if fs.MountCount() != 0 {
			t.Fatalf("mounted %+v", fs.Mounts)
		}
		if _, err := os.Stat(fs.Root); !os.IsNotExist(err) {
			t.Fatalf("something was made under the share directory: %v", err)
		}
	}
	for name, call := range calls {
		t.Run(name, func(t *testing.T) {
			wantCode(t, call(untagged), codes.FailedPrecondition)
			wantCode(t, call(badTag), codes.InvalidArgument)
			wantCode(t, call(otherKey), codes.InvalidArgument)
			nothingLeft(t)
		})
	}
	for name, call := range readOnly {
		t.Run(name, func(t *testing.T) {
			for _, id := range []string{untagged, badTag, goodTag} {
				if err := call(id); err == nil && name != "NodeUnpublishVolume" && name != "NodeUnstageVolume" {
					t.Errorf("%s answered OK for a share it does not serve", id)
				}
			}
			nothingLeft(t)
		})
	}

	// A good tag: mounted (to know), no pool there, let go; nothing laid out.
	if _, err := td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: goodTag}); err != nil {
		t.Fatalf("DeleteVolume of a volume that does not exist: %v", err)
	}
	_, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: goodTag, StagingTargetPath: staging, VolumeCapability: mountCap(rwx, "")})
	wantCode(t, err, codes.NotFound)
	if _, err := os.Stat(filepath.Join(fs.Root, ref.PoolName(), "pool.json")); !os.IsNotExist(err) {
		t.Fatalf("a pool was laid out on a share an ID named: %v", err)
	}
	if len(fs.Released) == 0 || td.pools.Pool(ref.PoolName()) != nil || fs.Recorded(ref) {
		t.Fatalf("the share was not let go: released %v", fs.Released)
	}

	bind := taggedID(testShareKey, pool.ShareRef{Type: "bind", Source: "/etc"}, "pvc-x")
	before := fs.MountCount()
	_, err = td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: bind})
	wantCode(t, err, codes.InvalidArgument)
	if fs.MountCount() != before {
		t.Fatal("a share type that is not allowed was mounted")
	}
	// The share part must name the ID's pool.
	forged := pool.ShareRef{Type: "nfs", Source: "a:/"}.PoolName() + "." + pool.KeyForName("x") + "." + base64.RawURLEncoding.EncodeToString([]byte("nfs b:/"))
	_, err = td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: forged})
	wantCode(t, err, codes.InvalidArgument)
}

// TestShareMountFailure: a share that cannot be mounted is UNAVAILABLE, for a
// delete too (never "deleted"), and the secret is in no message.
func TestShareMountFailure(t *testing.T) {
	ctx := context.Background()
	td, fs := newShareDriver(t, filepath.Join(t.TempDir(), "shares"), "node-1")
	fs.Err = status.Error(codes.Internal, "server not responding")
	id := taggedID(testShareKey, pool.ShareRef{Type: "nfs", Source: "s:/e"}, "pvc-1")
	_, err := td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	wantCode(t, err, codes.Unavailable)
	_, err = td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: map[string]string{"mountOptions": "secret=t0p-s3cr3t\nx"}})
	wantCode(t, err, codes.InvalidArgument)
	if strings.Contains(err.Error(), "t0p-s3cr3t") {
		t.Fatalf("the error shows the secret: %v", err)
	}
}

// TestConcurrentCreatesMountOnce: creates racing on a new share make one mount
// and one pool.
func TestConcurrentCreatesMountOnce(t *testing.T) {
	td, fs := newShareDriver(t, filepath.Join(t.TempDir(), "shares"), "node-1")
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
				Name: "pvc-" + string(rune('a'+i)), VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwx, "")}, Parameters: nfsParams(),
			})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if fs.MountCount() != 1 {
		t.Fatalf("%d mounts", fs.MountCount())
	}
	list, err := td.ListVolumes(context.Background(), &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 8 {
		t.Fatalf("ListVolumes: %d entries, %v", len(list.GetEntries()), err)
	}
}

// TestShareImageVolume: an image volume on a share (layout: image) goes
// through publish (the attach fence), stage, stats, expansion, a snapshot, a
// restore and a clone (on the same share); the image filesystem gets the
// capability's mount flags, the share only shareOptions.
func TestShareImageVolume(t *testing.T) {
	ctx := context.Background()
	shares := filepath.Join(t.TempDir(), "shares")
	td, fs := newShareDriver(t, shares, "node-1")
	vc := mountCap(rwo, "ext4")
	vc.GetMount().MountFlags = []string{"noatime", "discard"}
	params := nfsParams()
	params["layout"] = "image"
	params["shareOptions"] = "hard"
	resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-img", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: params,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	v := resp.GetVolume()
	if got := strings.Join(fs.Mounts[0].Options, ","); got != "hard" {
		t.Fatalf("share mounted with %q: an image volume's mount flags are its filesystem's", got)
	}
	if _, err := td.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.GetVolumeId(), NodeId: "node-1", VolumeCapability: vc, VolumeContext: v.GetVolumeContext(),
	}); err != nil {
		t.Fatal(err)
	}
	_, err = td.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.GetVolumeId(), NodeId: "node-2", VolumeCapability: vc, VolumeContext: v.GetVolumeContext(),
	})
	wantCode(t, err, codes.FailedPrecondition) // the fence holds on a share's pool too
	staging := filepath.Join(td.root, "staging")
	if _, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: v.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: vc, VolumeContext: v.GetVolumeContext(),
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.GetVolumeId(), VolumePath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := td.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
		VolumeId: v.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20},
	}); err != nil {
		t.Fatal(err)
	}
	// A snapshot of it lives on the share too, and a restore lands there.
	snap, err := td.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: v.GetVolumeId()})
	if err != nil {
		t.Fatal(err)
	}
	sid, err := pool.ParseSnapshotID(snap.GetSnapshot().GetSnapshotId())
	if r, ok := sid.ShareRef(); err != nil || !ok || r.Source != "nfs.example.com:/export/poolcsi" {
		t.Fatalf("snapshot ID %s: %v", snap.GetSnapshot().GetSnapshotId(), err)
	}
	restored, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-restored", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: params,
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: sid.String()}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if rid, _ := pool.ParseVolumeID(restored.GetVolume().GetVolumeId()); rid.Pool != sid.Pool {
		t.Fatalf("restored into %s", rid)
	}
	// Without parameters (a clone whose StorageClass names nothing): the
	// source's share.
	clone, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-clone", VolumeCapabilities: []*csi.VolumeCapability{vc},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: v.GetVolumeId()}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if cid, _ := pool.ParseVolumeID(clone.GetVolume().GetVolumeId()); cid.Pool != sid.Pool {
		t.Fatalf("cloned into %s", cid)
	}
	// A controller elsewhere deletes them from their IDs alone.
	other, otherShares := newShareDriver(t, shares, "node-9")
	otherShares.Unmount(pool.ShareRef{Type: "nfs", Source: "nfs.example.com:/export/poolcsi"})
	for _, id := range []string{restored.GetVolume().GetVolumeId(), clone.GetVolume().GetVolumeId()} {
		if _, err := other.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := other.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: sid.String()}); err != nil {
		t.Fatal(err)
	}
	if _, err := other.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: sid.String()}); err != nil {
		t.Fatal(err)
	}
	if other.Driver.pools.Pool(sid.Pool).Snapshots().Exists(sid) {
		t.Fatal("snapshot still there")
	}
	if _, err := td.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := td.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
}
