package driver

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// FuzzListTokens: any starting_token gets a page or ABORTED (or, for a
// negative max_entries, INVALID_ARGUMENT), never another error or a panic, and
// a page never repeats the token's own predecessor.
func FuzzListTokens(f *testing.F) {
	for _, s := range []string{"", "local.0123456789abcdef0123456789abcdef", "local@0123456789abcdef0123456789abcdef", "../x", "\x00", "zzz"} {
		f.Add(s, int32(1))
	}
	td := newTestDriver(f, testOpts{})
	for _, n := range []string{"a", "b", "c"} {
		if _, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
			Name: n, VolumeCapabilities: []*csi.VolumeCapability{blockCap(rwo)}, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		}); err != nil {
			f.Fatal(err)
		}
	}
	f.Fuzz(func(t *testing.T, token string, max int32) {
		ok := func(err error) bool {
			c := status.Code(err)
			return c == codes.OK || c == codes.Aborted || (max < 0 && c == codes.InvalidArgument)
		}
		resp, err := td.ListVolumes(context.Background(), &csi.ListVolumesRequest{StartingToken: token, MaxEntries: max})
		if !ok(err) {
			t.Fatalf("ListVolumes(%q, %d): %v", token, max, err)
		}
		for _, e := range resp.GetEntries() {
			if token != "" && e.GetVolume().GetVolumeId() < token {
				t.Fatalf("token %q: entry %s before it", token, e.GetVolume().GetVolumeId())
			}
		}
		if _, err := td.ListSnapshots(context.Background(), &csi.ListSnapshotsRequest{StartingToken: token, MaxEntries: max}); !ok(err) {
			t.Fatalf("ListSnapshots(%q, %d): %v", token, max, err)
		}
	})
}

// FuzzShareResolver: whatever a volume ID, a volume context's shareOptions and
// a secret's mountOptions hold, the calls that only read or tear down
// (ControllerGetVolume, ValidateVolumeCapabilities, NodeUnpublishVolume,
// NodeUnstageVolume, NodeGetVolumeStats) never mount a share; the calls that
// need the data mount one only when the ID's tag verifies or this node
// mounted the share before; and what reaches the mounter always passes the
// share type's grammar (poolmount.Check).
func FuzzShareResolver(f *testing.F) {
	legit := pool.ShareRef{Type: "nfs", Source: "nfs.example.com:/export/poolcsi"}
	evil := pool.ShareRef{Type: "nfs", Source: "evil.example.com:/"}
	seeds := []struct{ id, opts, secret string }{
		{taggedID(testShareKey, legit, "pvc-1"), "hard", "sec=sys"},
		{taggedID(testShareKey, evil, "pvc-x"), "nfsvers=4.1", ""},
		{pool.NewShareVolumeID(evil, "pvc-x").String(), "bg", "secret=x"},
		{pool.NewShareVolumeID(evil, "pvc-x").String() + ".AAAAAAAAAAA", "X-mount.mkdir", "helper=ceph"},
		{taggedID(testShareKey, pool.ShareRef{Type: "nfs", Source: "a=b,c=d:/x"}, "p"), "ceph.admin_socket=/etc/passwd", "conf=/x"},
		{"local.0123456789abcdef0123456789abcdef", "", ""},
		{"../../etc", ",,", "\x00"},
	}
	for _, s := range seeds {
		f.Add(s.id, s.opts, s.secret)
	}
	td, fs := newShareDriver(f, filepath.Join(f.TempDir(), "shares"), "node-1", "nfs", "nfs4", "ceph", "fuse.ceph")
	ctx := context.Background()
	if _, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwx, "")}, Parameters: nfsParams()}); err != nil {
		f.Fatal(err)
	}
	staging, target := filepath.Join(td.root, "s"), filepath.Join(td.root, "t")
	f.Fuzz(func(t *testing.T, id, opts, secret string) {
		vc := mountCap(rwx, "")
		secrets := map[string]string{"mountOptions": secret}
		vctx := map[string]string{"shareOptions": opts}
		before := fs.MountCount()
		_, _ = td.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
		_, _ = td.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{vc}, Secrets: secrets})
		_, _ = td.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		_, _ = td.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		_, _ = td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
		if fs.MountCount() != before {
			t.Fatalf("a call that only reads or tears down mounted %+v", fs.Mounts[before:])
		}
		_, _ = td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc, VolumeContext: vctx, Secrets: secrets})
		_, _ = td.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: vc, VolumeContext: vctx, Secrets: secrets})
		_, _ = td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets})
		for _, m := range fs.Mounts[before:] {
			if err := poolmount.Check(m); err != nil {
				t.Fatalf("the mounter was given %+v, which its grammar refuses: %v", m, err)
			}
			vid, err := pool.ParseVolumeID(id)
			r, _ := vid.ShareRef()
			if err != nil || r != m.Ref || poolset.Tag(testShareKey, r) != vid.Tag {
				t.Fatalf("ID %q made the driver mount %+v without a verified tag", id, m.Ref)
			}
		}
	})
}
