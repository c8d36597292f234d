package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// mountsBelow is the node's mount table below dir, one line each.
func mountsBelow(t *testing.T, dir string) string {
	t.Helper()
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// Over the real kernel: a stage or publish inside an image volume's mount (a loop
// device's) or a dir volume's (a bind of a pool directory), or a publish onto the
// volume's own staging path, is InvalidArgument and makes no directory and no mount.
func TestNestedPathsRefusedByTheKernelTable(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	img := csiproc.MountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	dirCap := csiproc.MountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	a := e.create("a", img, 64*mib)
	resp, err := e.drv.Controller().CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "d", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 * mib},
		VolumeCapabilities: []*csi.VolumeCapability{dirCap}, Parameters: map[string]string{"layout": "dir"}})
	if err != nil {
		t.Fatal(err)
	}
	d := resp.GetVolume().GetVolumeId()
	t.Cleanup(func() { _, _ = e.drv.Controller().DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: d}) })
	b := e.create("b", img, 64*mib)
	e.stage(a, img)
	e.publish(a, img, false)
	e.stage(d, dirCap)
	e.publish(d, dirCap, false)
	before := mountsBelow(t, e.root)
	for _, p := range []string{
		filepath.Join(e.staging(a), "x"), filepath.Join(e.target(a), "x"),
		filepath.Join(e.staging(d), "x"), filepath.Join(e.target(d), "x"),
	} {
		_, err := e.drv.Node().NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{VolumeId: b, StagingTargetPath: p, VolumeCapability: img})
		if err == nil { // without the check: taken down before what it is inside
			t.Cleanup(func() {
				_, _ = e.drv.Node().NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: b, StagingTargetPath: p})
			})
		}
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("stage at %s: %v, want InvalidArgument", p, err)
		}
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("a refused stage made %s: %v", p, err)
		}
	}
	if err := e.tryPublish(a, e.staging(a), img, false); status.Code(err) != codes.InvalidArgument {
		t.Errorf("publish onto its own staging path: %v, want InvalidArgument", err)
		if err == nil {
			t.Cleanup(func() { e.unpublishAt(a, e.staging(a)) })
		}
	}
	if after := mountsBelow(t, e.root); after != before {
		t.Errorf("refused calls changed the mounts:\n%s\n---\n%s", before, after)
	}
	e.stage(b, img) // side by side: fine
}
