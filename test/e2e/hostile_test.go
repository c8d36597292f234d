package e2e

import (
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// tree lists every path under root with its size, to prove a refused call changed
// nothing on disk.
func tree(t *testing.T, root string) string {
	t.Helper()
	var lines []string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		info, _ := d.Info()
		size := int64(0)
		if info != nil && info.Mode().IsRegular() {
			size = info.Size()
		}
		lines = append(lines, strings.TrimPrefix(p, root)+" "+info.Mode().String()+" "+strconv.FormatInt(size, 10))
		return nil
	})
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// TestHostileInput sends malformed and malicious requests and checks each gets
// the right code while nothing inside or around the pool changes.
func TestHostileInput(t *testing.T) {
	e := newEnv(t, "mkfs.ext4", "mkfs.xfs")
	ctx := ctx(t)
	c, n := e.drv.Controller(), e.drv.Node()
	rwo := csiproc.MountCap("ext4", csiproc.RWO)
	// One real volume, so the node calls below have something to aim at.
	good := e.create("pvc-real", rwo, 16*mib)
	// A canary beside the pool, where a traversal would land.
	canary := filepath.Join(e.root, "canary")
	if err := os.WriteFile(canary, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	before := tree(t, e.root)

	long := strings.Repeat("a", 300)
	traversalIDs := []string{"../../etc", "local/../../canary", "local.../../canary", "local.\x00", long, "local." + long, "/etc/passwd", "local..", "local."}
	mixed := []*csi.VolumeCapability{csiproc.MountCap("ext4", csiproc.RWO), csiproc.BlockCap(csiproc.RWO)}
	noType := []*csi.VolumeCapability{{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csiproc.RWO}}}
	noMode := []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}}
	twoFS := []*csi.VolumeCapability{csiproc.MountCap("ext4", csiproc.RWO), csiproc.MountCap("xfs", csiproc.RWO)}
	rwx := []*csi.VolumeCapability{csiproc.MountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)}
	create := func(name string, caps []*csi.VolumeCapability, r *csi.CapacityRange, params map[string]string) func() error {
		return func() error {
			_, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: caps, CapacityRange: r, Parameters: params})
			return err
		}
	}
	tests := []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"create: no name", create("", []*csi.VolumeCapability{rwo}, nil, nil), codes.InvalidArgument},
		{"create: NUL in name", create("pvc\x00x", []*csi.VolumeCapability{rwo}, nil, nil), codes.InvalidArgument},
		{"create: 300-character name", create(long, []*csi.VolumeCapability{rwo}, nil, nil), codes.InvalidArgument},
		{"create: no capabilities", create("pvc-x", nil, nil, nil), codes.InvalidArgument},
		{"create: block and mount mixed", create("pvc-x", mixed, nil, nil), codes.InvalidArgument},
		{"create: no access type", create("pvc-x", noType, nil, nil), codes.InvalidArgument},
		{"create: no access mode", create("pvc-x", noMode, nil, nil), codes.InvalidArgument},
		{"create: two filesystems", create("pvc-x", twoFS, nil, nil), codes.InvalidArgument},
		{"create: unsupported fs", create("pvc-x", []*csi.VolumeCapability{csiproc.MountCap("ntfs", csiproc.RWO)}, nil, nil), codes.InvalidArgument},
		{"create: RWX on an image", create("pvc-x", rwx, nil, nil), codes.InvalidArgument},
		{"create: limit below required", create("pvc-x", []*csi.VolumeCapability{rwo}, &csi.CapacityRange{RequiredBytes: 64 * mib, LimitBytes: 32 * mib}, nil), codes.InvalidArgument},
		{"create: negative size", create("pvc-x", []*csi.VolumeCapability{rwo}, &csi.CapacityRange{RequiredBytes: -1}, nil), codes.InvalidArgument},
		{"create: limit below the fs minimum", create("pvc-x", []*csi.VolumeCapability{csiproc.MountCap("xfs", csiproc.RWO)}, &csi.CapacityRange{RequiredBytes: 64 * mib, LimitBytes: 64 * mib}, nil), codes.OutOfRange},
		{"create: larger than the pool", create("pvc-x", []*csi.VolumeCapability{rwo}, &csi.CapacityRange{RequiredBytes: 60 << 40}, nil), codes.ResourceExhausted},
		{"create: traversal in pool parameter", create("pvc-x", []*csi.VolumeCapability{rwo}, nil, map[string]string{"pool": "../canary"}), codes.InvalidArgument},
		{"create: unknown parameter", create("pvc-x", []*csi.VolumeCapability{rwo}, nil, map[string]string{"pol": "local"}), codes.InvalidArgument},
		{"create: existing name, other size", create("pvc-real", []*csi.VolumeCapability{rwo}, &csi.CapacityRange{RequiredBytes: 1 << 30}, nil), codes.AlreadyExists},
		{"create: existing name, other fs", create("pvc-real", []*csi.VolumeCapability{csiproc.MountCap("xfs", csiproc.RWO)}, nil, nil), codes.AlreadyExists},
		{"stage: relative staging path", func() error {
			_, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: good, StagingTargetPath: "relative", VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"stage: .. in staging path", func() error {
			_, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: good, StagingTargetPath: e.root + "/x/../../escape", VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"stage: no capability", func() error {
			_, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: good, StagingTargetPath: e.root + "/s"})
			return err
		}, codes.InvalidArgument},
		{"stage: other filesystem than the volume's", func() error {
			_, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: good, StagingTargetPath: e.root + "/s", VolumeCapability: csiproc.MountCap("xfs", csiproc.RWO)})
			return err
		}, codes.FailedPrecondition},
		{"publish: NUL in target", func() error {
			_, err := n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: good, StagingTargetPath: e.root + "/s", TargetPath: e.root + "/t\x00", VolumeCapability: rwo})
			return err
		}, codes.InvalidArgument},
		{"publish: not staged", func() error {
			_, err := n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: good, StagingTargetPath: e.root + "/s", TargetPath: e.root + "/t", VolumeCapability: rwo})
			return err
		}, codes.FailedPrecondition},
		{"unknown pool", func() error {
			_, err := c.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "other.0123456789abcdef0123456789abcdef"})
			return err
		}, codes.NotFound},
		{"list: bad token", func() error {
			_, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "../x"})
			return err
		}, codes.Aborted},
	}
	for _, id := range traversalIDs {
		id := id
		tests = append(tests,
			struct {
				name string
				call func() error
				want codes.Code
			}{"delete " + strings.ToValidUTF8(id[:min(len(id), 24)], "?"), func() error {
				_, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
				return err
			}, codes.InvalidArgument},
			struct {
				name string
				call func() error
				want codes.Code
			}{"stage " + strings.ToValidUTF8(id[:min(len(id), 24)], "?"), func() error {
				_, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: e.root + "/s", VolumeCapability: rwo})
				return err
			}, codes.InvalidArgument},
			struct {
				name string
				call func() error
				want codes.Code
			}{"validate " + strings.ToValidUTF8(id[:min(len(id), 24)], "?"), func() error {
				_, err := c.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{rwo}})
				return err
			}, codes.InvalidArgument},
			struct {
				name string
				call func() error
				want codes.Code
			}{"unstage " + strings.ToValidUTF8(id[:min(len(id), 24)], "?"), func() error {
				_, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.root + "/s"})
				return err
			}, codes.InvalidArgument},
		)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			if got := status.Code(err); got != tt.want {
				t.Fatalf("code %v (%v), want %v", got, err, tt.want)
			}
			if msg := status.Convert(err).Message(); len(msg) < 10 {
				t.Errorf("error message %q does not say what is wrong", msg)
			}
		})
	}
	if after := tree(t, e.root); after != before {
		t.Fatalf("refused calls changed the disk.\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "nopool.0123456789abcdef0123456789abcdef"}); err != nil {
		t.Errorf("deleting a volume of an unknown pool must succeed (it does not exist here): %v", err)
	}
}

// TestSecretsNeverLogged sends secrets in every field that carries them, at the
// highest log verbosity, and checks the driver's log holds none of them.
func TestSecretsNeverLogged(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	ctx := ctx(t)
	const secret = "s3cr3t-do-not-log"
	secrets := map[string]string{"password": secret}
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	resp, err := e.drv.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-secret", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{vc}, Secrets: secrets,
	})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	staging := filepath.Join(e.root, "staging")
	t.Cleanup(func() {
		e.drv.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		e.drv.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets})
	})
	if _, err := e.drv.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc, Secrets: secrets}); err != nil {
		t.Fatal(err)
	}
	// A refused call is logged as an error: its request must be stripped too.
	e.drv.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: "relative", VolumeCapability: vc, Secrets: secrets})
	if _, err := e.drv.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.drv.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets}); err != nil {
		t.Fatal(err)
	}
	log := e.drv.Log()
	if !strings.Contains(log, "NodeStageVolume") {
		t.Fatal("the driver did not log the calls at all; the check below would prove nothing")
	}
	if strings.Contains(log, secret) {
		t.Fatal("a secret reached the driver's log")
	}
}

// TestShareSecretsNeverLogged: the secret mount options of a share a
// StorageClass names (the secret's mountOptions) reach the share's mount but
// no log line at -v 5, no error and no file: CreateVolume, publish, stage,
// delete with them, and a refused secret option.
func TestShareSecretsNeverLogged(t *testing.T) {
	testutil.RequireRoot(t)
	root := csiproc.ShortRoot(t, "pcsi-e2e-")
	export, shares := filepath.Join(root, "export"), filepath.Join(root, "shares")
	if err := os.Mkdir(export, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // after the driver stops: it never unmounts a share with a pool
		mounts, _ := filepath.Glob(filepath.Join(shares, "s-*"))
		for _, m := range mounts {
			if out, err := exec.Command("umount", m).CombinedOutput(); err != nil && !strings.Contains(string(out), "not mounted") {
				t.Errorf("umount %s: %v %s", m, err, out)
			}
		}
	})
	keyFile := filepath.Join(root, "share-key")
	if err := os.WriteFile(keyFile, []byte("a share key of at least thirty-two bytes\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newEnvArgs(t, []string{"--share-dir", shares, "--share-types", "bind", "--share-key-file", keyFile})
	ctx := ctx(t)
	// A bind share takes no secret mount option (internal/poolmount's
	// TestShareCommandLines shows ceph's secret= masked in the mount's log
	// line): the secret here rides in the request, as a CO sends it.
	const secret = "s3cr3t-share-do-not-log"
	secrets := map[string]string{"password": secret}
	vc := csiproc.MountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	resp, err := e.drv.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "pvc-share-secret", CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		Parameters:         map[string]string{"shareType": "bind", "shareSource": export},
		VolumeCapabilities: []*csi.VolumeCapability{vc}, Secrets: secrets,
	})
	if err != nil {
		t.Fatal(err)
	}
	v := resp.GetVolume()
	staging := filepath.Join(e.root, "staging")
	t.Cleanup(func() { // a failed check below leaves the stage behind
		_, _ = e.drv.Node().NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging})
	})
	if _, err := e.drv.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.GetVolumeId(), NodeId: "node-1", VolumeCapability: vc, VolumeContext: v.GetVolumeContext(), Secrets: secrets,
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.drv.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: v.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: vc, VolumeContext: v.GetVolumeContext(), Secrets: secrets,
	}); err != nil {
		t.Fatal(err)
	}
	// A secret option that is refused: the error and the log never show its
	// value.
	bad := map[string]string{"mountOptions": "nodev,ceph.key=" + secret}
	_, err = e.drv.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId(), Secrets: bad})
	if status.Code(err) != codes.InvalidArgument || strings.Contains(err.Error(), secret) {
		t.Fatalf("a refused secret option: %v", err)
	}
	if _, err := e.drv.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.GetVolumeId(), StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.drv.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "node-1", Secrets: secrets}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.drv.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId(), Secrets: secrets}); err != nil {
		t.Fatal(err)
	}
	log := e.drv.Log()
	if strings.Contains(log, secret) {
		t.Fatal("a secret reached the driver's log")
	}
	recs, _ := filepath.Glob(filepath.Join(shares, "*"))
	for _, r := range recs {
		if raw, err := os.ReadFile(r); err == nil && strings.Contains(string(raw), secret) {
			t.Fatalf("%s holds a secret", r)
		}
	}
}
