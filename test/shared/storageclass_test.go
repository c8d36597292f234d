package shared

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
	"github.com/poolcsi/poolcsi/test/support/cephfs"
)

// unmountShares takes down, at the end of a test, every share a driver mounted
// under dir: the driver never unmounts a share that holds a pool.
func unmountShares(t *testing.T, dirs ...string) {
	t.Cleanup(func() {
		for _, dir := range dirs {
			mounts, _ := filepath.Glob(filepath.Join(dir, "s-*"))
			for _, m := range mounts {
				if ok, _ := mountinfo.Mounted(m); ok {
					if out, err := exec.Command("umount", m).CombinedOutput(); err != nil {
						t.Errorf("umount %s: %v %s", m, err, out)
					}
				}
			}
		}
	})
}

// TestStorageClassShare: a StorageClass that names a share provisions and
// mounts volumes through real driver processes with no pool configured for it,
// on each backend: a bind mount of a directory of a btrfs filesystem (standing
// in for an NFS export: no NFS client here), and the package's CephFS through
// ceph-fuse (type fuse.ceph; the driver runs ceph-fuse itself). Node 1's controller mounts the
// share and lays out the pool; node 2 mounts it when it stages, from the volume
// context alone; both drivers restart and the volumes still unstage and
// delete; a controller on a third node that never saw the share deletes from
// the IDs alone (their share tag proves a StorageClass named the share); a
// forged ID naming another directory mounts nothing and leaves nothing; the
// request's secrets reach no log and no file.
func TestStorageClassShare(t *testing.T) {
	for _, b := range backends {
		t.Run(b, func(t *testing.T) { testStorageClassShare(t, b) })
	}
}

func testStorageClassShare(t *testing.T, backend string) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mount", "umount")
	ctx := context.Background()
	root := csiproc.ShortRoot(t, "p")
	// export is the share's root as this test sees it, to check what the
	// drivers wrote there.
	var share pool.ShareRef
	var export string
	switch backend {
	case "btrfs":
		testutil.RequireCommands(t, "mkfs.btrfs")
		export = filepath.Join(testutil.LoopFS(t, root, "btrfs", 256*mib), "export")
		if err := os.Mkdir(export, 0o755); err != nil {
			t.Fatal(err)
		}
		share = pool.ShareRef{Type: "bind", Source: export}
	case "cephfs":
		testutil.RequireCommands(t, "ceph-fuse")
		c := cephfs.Shared(t)
		// The whole filesystem (its root holds the other tests' directories
		// too), as client.admin (the test cluster has no authentication):
		// the driver runs ceph-fuse itself, with the monitor and path of the
		// source and no configuration file.
		export = c.Mounts[0]
		share = pool.ShareRef{Type: "fuse.ceph", Source: c.Mon + ":/"}
	default:
		t.Fatalf("unknown backend %q", backend)
	}
	shareDirs := []string{filepath.Join(root, "n1"), filepath.Join(root, "n2"), filepath.Join(root, "n3")}
	keyFile := filepath.Join(root, "share-key")
	if err := os.WriteFile(keyFile, []byte("poolcsi test cluster's share key, 32 bytes or more\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	unmountShares(t, shareDirs...)
	start := func(i int) *csiproc.Driver {
		node := "node-" + string(rune('1'+i))
		d := csiproc.Start(t, csiproc.Options{NodeID: node, SidecarDeadlines: true,
			// A local pool of its own, nothing for the share.
			Pools: []string{"local=" + filepath.Join(root, node, "local")},
			Args:  []string{"--share-dir", shareDirs[i], "--share-types", "bind,fuse.ceph", "--share-key-file", keyFile}})
		d.LogSlowCalls(t, time.Second)
		return d
	}
	d1, d2 := start(0), start(1)

	// Neither a bind mount nor this test cluster takes a secret mount
	// option: a secret comes with every request, and must reach no log and
	// no file.
	const secret = "s3cr3t-share-key"
	secrets := map[string]string{"password": secret}
	params := map[string]string{"shareType": share.Type, "shareSource": share.Source, "shareOptions": "nodev",
		"csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "default"}
	vc := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
	vc.GetMount().MountFlags = []string{"noatime"}
	create := func(name string) *csi.Volume {
		resp := must(d1.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, Parameters: params, VolumeCapabilities: []*csi.VolumeCapability{vc},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}, Secrets: secrets,
		}))(t)
		return resp.GetVolume()
	}
	v := create("pvc-share-1")
	vid := must(pool.ParseVolumeID(v.GetVolumeId()))(t)
	ref, ok := vid.ShareRef()
	if !ok || ref != share {
		t.Fatalf("volume ID %s names share %+v", vid, ref)
	}
	if v.GetVolumeContext()["layout"] != "dir" || v.GetVolumeContext()["shareSource"] != share.Source {
		t.Fatalf("volume context %v", v.GetVolumeContext())
	}
	mnt1 := filepath.Join(shareDirs[0], ref.PoolName())
	if ok, _ := mountinfo.Mounted(mnt1); !ok {
		t.Fatalf("the controller did not mount the share at %s", mnt1)
	}
	if _, err := os.Stat(filepath.Join(export, "pool.json")); err != nil {
		t.Fatalf("no pool laid out on the share itself: %v", err)
	}
	v2 := create("pvc-share-2")
	// The operator's tools read the share's pool like any other.
	out, err := exec.Command(csiproc.Binary(t), "pool", "check", "--path", export).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "2 volumes, no problems") {
		t.Fatalf("poolcsi pool check on the share: %v\n%s", err, out)
	}

	// Node 2: publish and stage with what the CO has, the PV's volume context.
	must(d1.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.GetVolumeId(), NodeId: "node-2", VolumeCapability: vc, VolumeContext: v.GetVolumeContext(), Secrets: secrets,
	}))(t)
	staging, target := filepath.Join(root, "node-2", "staging"), filepath.Join(root, "node-2", "target")
	must(d2.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: v.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: vc,
		VolumeContext: v.GetVolumeContext(), Secrets: secrets,
	}))(t)
	must(d2.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: v.GetVolumeId(), StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc, VolumeContext: v.GetVolumeContext(),
	}))(t)
	if ok, _ := mountinfo.Mounted(filepath.Join(shareDirs[1], ref.PoolName())); !ok {
		t.Fatal("node 2 did not mount the share")
	}
	data := writeRandom(t, filepath.Join(target, "file"), 64<<10)
	wantFile(t, filepath.Join(export, "volumes", vid.Key, "data", "file"), data)

	// Both drivers restart (an upgrade): the shares stay mounted and are found.
	d1.Restart(t)
	d2.Restart(t)
	list := must(d1.Controller().ListVolumes(ctx, &csi.ListVolumesRequest{}))(t)
	if len(list.GetEntries()) != 2 {
		t.Fatalf("ListVolumes after a restart lists %d volumes", len(list.GetEntries()))
	}
	wantFile(t, filepath.Join(target, "file"), data)
	must(d2.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), TargetPath: target}))(t)
	must(d2.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging}))(t)
	must(d1.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "node-2"}))(t)
	must(d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId(), Secrets: secrets}))(t)
	if _, err := os.Stat(filepath.Join(export, "volumes", vid.Key)); !os.IsNotExist(err) {
		t.Fatalf("volume directory after DeleteVolume: %v", err)
	}

	// A snapshot of the other volume lives on the share too.
	snap := must(d1.Controller().CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-share", SourceVolumeId: v2.GetVolumeId(), Secrets: secrets}))(t)

	// A controller on a node that never mounted the share: the IDs are all it has.
	d3 := start(2)
	must(d3.Controller().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}))(t)
	must(d3.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v2.GetVolumeId()}))(t)
	if des, _ := os.ReadDir(filepath.Join(export, "snapshots")); len(des) != 0 {
		t.Fatalf("snapshots left on the share: %v", des)
	}
	if list := must(d1.Controller().ListVolumes(ctx, &csi.ListVolumesRequest{}))(t); len(list.GetEntries()) != 0 {
		t.Fatalf("volumes left: %v", list.GetEntries())
	}

	// A forged ID naming another directory, without the cluster's tag:
	// nothing is mounted, nothing is left in the share directory.
	other := filepath.Join(root, "other")
	if err := os.Mkdir(other, 0o755); err != nil {
		t.Fatal(err)
	}
	otherRef := pool.ShareRef{Type: "bind", Source: other}
	forged := pool.NewShareVolumeID(otherRef, "pvc-x").String()
	before, _ := os.ReadDir(shareDirs[2])
	_, err = d3.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: forged})
	wantCode(t, err, codes.FailedPrecondition, "carries no share tag")
	_, err = d3.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: forged + ".AAAAAAAAAAA", NodeId: "node-3", VolumeCapability: vc})
	wantCode(t, err, codes.InvalidArgument, "does not verify")
	if after, _ := os.ReadDir(shareDirs[2]); len(after) != len(before) {
		t.Fatalf("a forged ID left %v in the share directory (before: %v)", after, before)
	}
	if mi, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mi), other) {
		t.Fatal("the forged ID's directory was mounted")
	}
	// A type the driver does not allow is never mounted.
	_, err = d3.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: pool.NewShareVolumeID(pool.ShareRef{Type: "nfs", Source: "x:/"}, "y").String()})
	wantCode(t, err, codes.InvalidArgument, "not allowed")

	for i, d := range []*csiproc.Driver{d1, d2, d3} {
		if strings.Contains(d.Log(), secret) {
			t.Errorf("node-%d: the secret mount option reached the log", i+1)
		}
		recs, _ := filepath.Glob(filepath.Join(shareDirs[i], "*.json"))
		for _, r := range recs {
			if raw, _ := os.ReadFile(r); strings.Contains(string(raw), secret) {
				t.Errorf("%s holds the secret", r)
			}
		}
	}
	if testing.Verbose() {
		for _, l := range strings.Split(d1.Log(), "\n") {
			if strings.Contains(l, "Mounting pool") {
				t.Log(l)
			}
		}
	}
}
