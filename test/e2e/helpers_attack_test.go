package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestMountHelpersNeverSeeRequestFlags: the attack docs/pools.md ("Which shares
// are tested") describes, against a serving driver whose mount helpers (mount,
// mount.fuse.ceph, ceph-fuse, mount.ceph, mount.nfs) are recorders in PATH. A
// forged volume ID of type fuse.ceph whose source is
// "no_mon_config,admin_socket=<file>" (which mount.fuse.ceph would turn into
// ceph-fuse flags that unlink the file), sent through DeleteVolume,
// ControllerGetVolume and NodeUnpublishVolume, and the same through
// StorageClass parameters and a secret's mountOptions, runs no helper at all; a
// good fuse.ceph share runs ceph-fuse with the driver's own argv, never
// mount.fuse.ceph; the file is untouched and nothing is left in the share
// directory.
func TestMountHelpersNeverSeeRequestFlags(t *testing.T) {
	testutil.RequireRoot(t)
	root := csiproc.ShortRoot(t, "pcsi-h-")
	bin := filepath.Join(root, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(root, "argv.log")
	for _, n := range []string{"mount", "mount.fuse.ceph", "ceph-fuse", "mount.ceph", "mount.nfs", "mount.nfs4"} {
		script := "#!/bin/sh\nprintf '%s\\n' \"" + n + " $*\" >> " + log + "\nexit 32\n"
		if err := os.WriteFile(filepath.Join(bin, n), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH")) // the driver's PATH
	canary := filepath.Join(root, "canary")
	if err := os.WriteFile(canary, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	keyFile := filepath.Join(root, "key")
	if err := os.WriteFile(keyFile, []byte("the cluster's share key, thirty-two bytes at least\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	shares := filepath.Join(root, "shares")
	e := newEnvArgs(t, []string{"--share-dir", shares, "--share-types", "nfs,nfs4,ceph,fuse.ceph", "--share-key-file", keyFile})
	c := ctx(t)
	ctrl, node := e.drv.Controller(), e.drv.Node()
	vc := csiproc.MountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)

	hostile := pool.ShareRef{Type: "fuse.ceph", Source: "no_mon_config,admin_socket=" + canary}
	forged := pool.NewShareVolumeID(hostile, "pvc-x").String()
	for _, id := range []string{forged, forged + ".AAAAAAAAAAA"} {
		_, err := ctrl.DeleteVolume(c, &csi.DeleteVolumeRequest{VolumeId: id})
		wantCode(t, "DeleteVolume of a forged ID", err, codes.InvalidArgument)
		_, err = ctrl.ControllerGetVolume(c, &csi.ControllerGetVolumeRequest{VolumeId: id})
		if err == nil {
			t.Error("ControllerGetVolume of a forged ID answered OK")
		}
		if _, err := node.NodeUnpublishVolume(c, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: filepath.Join(e.root, "t")}); err != nil && status.Code(err) != codes.InvalidArgument {
			t.Errorf("NodeUnpublishVolume of a forged ID: %v", err)
		}
		_, err = node.NodeStageVolume(c, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(e.root, "s"), VolumeCapability: vc})
		wantCode(t, "NodeStageVolume of a forged ID", err, codes.InvalidArgument)
	}
	create := func(params, secrets map[string]string) error {
		_, err := ctrl.CreateVolume(c, &csi.CreateVolumeRequest{Name: "pvc-attack", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: params, Secrets: secrets})
		return err
	}
	for name, params := range map[string]map[string]string{
		"source as flags":          {"shareType": "fuse.ceph", "shareSource": "id=admin,admin_socket=" + canary},
		"ceph. option":             {"shareType": "fuse.ceph", "shareSource": "10.0.0.1:/", "shareOptions": "ceph.admin_socket=" + canary},
		"log_file option":          {"shareType": "fuse.ceph", "shareSource": "10.0.0.1:/", "shareOptions": "log_file=" + canary},
		"ceph secretfile":          {"shareType": "ceph", "shareSource": "10.0.0.1:/", "shareOptions": "secretfile=" + canary},
		"ceph conf":                {"shareType": "ceph", "shareSource": "10.0.0.1:/", "shareOptions": "conf=" + canary},
		"X-mount option":           {"server": "s", "share": "/e", "shareOptions": "X-mount.mkdir=0700"},
		"helper option":            {"server": "s", "share": "/e", "shareOptions": "helper=fuse.ceph"},
		"nfs source with a second": {"shareType": "nfs", "shareSource": "s:/e,admin_socket=" + canary},
	} {
		wantCode(t, "CreateVolume, "+name, create(params, nil), codes.InvalidArgument)
	}
	wantCode(t, "CreateVolume, secret admin_socket", create(map[string]string{"shareType": "fuse.ceph", "shareSource": "10.0.0.1:/"},
		map[string]string{"mountOptions": "admin_socket=" + canary}), codes.InvalidArgument)
	if b, err := os.ReadFile(log); err == nil {
		t.Fatalf("a refused request ran a mount helper:\n%s", b)
	}

	// A good fuse.ceph share: ceph-fuse with the driver's argv (the recorder
	// fails it, so the share is UNAVAILABLE), never mount.fuse.ceph.
	err := create(map[string]string{"shareType": "fuse.ceph", "shareSource": "10.0.0.1:/csi", "shareOptions": "name=csi"}, nil)
	wantCode(t, "CreateVolume on an unreachable fuse.ceph share", err, codes.Unavailable)
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatalf("no helper ran for a good share: %v", err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if !strings.HasPrefix(line, "ceph-fuse -c /dev/null -m 10.0.0.1 -r /csi --id csi ") {
			t.Errorf("ran %q", line)
		}
	}
	if got, _ := os.ReadFile(canary); string(got) != "keep" {
		t.Fatalf("the canary changed: %q", got)
	}
	entries, _ := os.ReadDir(shares)
	for _, en := range entries {
		if en.Name() != ".lock" {
			t.Errorf("left in the share directory: %s", en.Name())
		}
	}
}
