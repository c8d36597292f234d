package main

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/pool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The claim's lookups through a real driver over the fake kernel: what is here is found,
// what is not is (false, nil), and a handle that is not the driver's is an error, never a
// path.
func TestClaimLookups(t *testing.T) {
	ctx := context.Background()
	p, err := pool.Initialise(pool.Config{Name: "local", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	h := fake.New()
	d, err := driver.New(driver.Options{
		Name: "local.test", Version: "v-test", NodeID: "node-1", Mode: driver.ModeAll, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: h, Loops: h, Devices: h, FS: h, Cgroups: h},
	})
	if err != nil {
		t.Fatal(err)
	}
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	var vols []string
	for _, name := range []string{"data", "wal"} {
		resp, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: pool.MiB * 64},
			VolumeCapabilities: []*csi.VolumeCapability{capability},
			Parameters:         map[string]string{driver.ParamPool: "local"},
		})
		if err != nil {
			t.Fatal(err)
		}
		vols = append(vols, resp.GetVolume().GetVolumeId())
	}
	g, err := d.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: vols})
	if err != nil {
		t.Fatal(err)
	}
	group := g.GetGroupSnapshot().GetGroupSnapshotId()
	var members []string
	for _, s := range g.GetGroupSnapshot().GetSnapshots() {
		members = append(members, s.GetSnapshotId())
	}
	const (
		absentVolume   = "local.ffffffffffffffffffffffffffffffff"
		elsewherePool  = "nopool.ffffffffffffffffffffffffffffffff"
		absentGroup    = "local@g-ffffffffffffffffffffffffffffffff"
		absentSnapshot = "local@ffffffffffffffffffffffffffffffff"
	)

	for _, tc := range []struct {
		name    string
		here    func() (bool, error)
		want    bool
		wantErr codes.Code // OK: no error
	}{
		{"volume here", func() (bool, error) { return volumeHere(d)(ctx, vols[0]) }, true, codes.OK},
		{"volume not in the pool", func() (bool, error) { return volumeHere(d)(ctx, absentVolume) }, false, codes.OK},
		{"volume of a pool not here", func() (bool, error) { return volumeHere(d)(ctx, elsewherePool) }, false, codes.OK},
		{"hostile volume ID", func() (bool, error) { return volumeHere(d)(ctx, "local.../../etc") }, false, codes.InvalidArgument},
		{"group here", func() (bool, error) { return groupHere(d)(ctx, group, members) }, true, codes.OK},
		{"group here, members in another order", func() (bool, error) { return groupHere(d)(ctx, group, []string{members[1], members[0]}) }, true, codes.OK},
		{"group here, a member missing", func() (bool, error) { return groupHere(d)(ctx, group, members[:1]) }, false, codes.InvalidArgument},
		{"group here, a foreign member", func() (bool, error) { return groupHere(d)(ctx, group, []string{members[0], absentSnapshot}) }, false, codes.InvalidArgument},
		{"group not here", func() (bool, error) { return groupHere(d)(ctx, absentGroup, members) }, false, codes.OK},
		{"group handle not the driver's", func() (bool, error) { return groupHere(d)(ctx, "some-other-vendor-id", members) }, false, codes.OK},
		{"hostile group ID", func() (bool, error) { return groupHere(d)(ctx, "local@g-../../x", members) }, false, codes.InvalidArgument},
		{"member snapshot here", func() (bool, error) { return snapshotHere(d)(ctx, members[0]) }, true, codes.OK},
		{"snapshot not here", func() (bool, error) { return snapshotHere(d)(ctx, absentSnapshot) }, false, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.here()
			if got != tc.want || status.Code(err) != tc.wantErr {
				t.Fatalf("= %v, %v; want %v, %v", got, err, tc.want, tc.wantErr)
			}
		})
	}
}
