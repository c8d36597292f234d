package driver

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// A staging or target path inside, or holding, the mount of a volume (its own stage,
// another volume's stage or publish) is refused, and nothing changes on disk or in the
// mount table: kubelet never nests them, and a nested mount would put one volume's
// mount point, or a pod's data, inside another volume, or hide it.
func TestNestedPathsRefused(t *testing.T) {
	const rwx = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
	img := mountCap(rwo, "ext4")
	dir := mountCap(rwx, "")
	type paths struct{ staging, target string }
	for _, tt := range []struct {
		name string
		// other is staged (and published) first, at <root>/staging/other and <root>/target/other.
		otherLayout string
		// the refused call, for volume "v" (an image one unless dirVolume), at these paths
		// below <root>; target "" is a stage, else a publish (after v is staged at its own
		// staging path, <root>/staging/v, unless staging says otherwise).
		call      paths
		dirVolume bool
	}{
		{name: "publish onto its own staging path", call: paths{"staging/v", "staging/v"}},
		{name: "publish inside its own staging path", call: paths{"staging/v", "staging/v/pod"}},
		{name: "publish onto a directory holding its own staging path", call: paths{"staging/v", "staging"}},
		{name: "publish of a dir volume onto its own staging path", call: paths{"staging/v", "staging/v"}, dirVolume: true},
		{name: "stage inside another image volume's stage", otherLayout: "image", call: paths{"staging/other/globalmount", ""}},
		{name: "stage inside another dir volume's stage", otherLayout: "dir", call: paths{"staging/other/globalmount", ""}},
		{name: "stage inside another volume's publish", otherLayout: "image", call: paths{"target/other/x", ""}},
		{name: "stage over a directory holding another volume's stage", otherLayout: "image", call: paths{"staging", ""}},
		{name: "publish inside another volume's publish", otherLayout: "image", call: paths{"staging/v", "target/other/pod"}},
		{name: "publish inside another dir volume's stage", otherLayout: "dir", call: paths{"staging/v", "staging/other/pod"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			ctx := context.Background()
			p := func(rel string) string { return filepath.Join(td.root, rel) }
			if tt.otherLayout != "" {
				vc := img
				if tt.otherLayout == "dir" {
					vc = dir
				}
				other := td.create(t, "other", vc, map[string]string{"layout": tt.otherLayout})
				if _, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: other, StagingTargetPath: p("staging/other"), VolumeCapability: vc}); err != nil {
					t.Fatal(err)
				}
				if _, err := td.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: other, StagingTargetPath: p("staging/other"),
					TargetPath: p("target/other"), VolumeCapability: vc}); err != nil {
					t.Fatal(err)
				}
			}
			vc, params := img, map[string]string{"layout": "image"}
			if tt.dirVolume {
				vc, params = dir, map[string]string{"layout": "dir"}
			}
			id := td.create(t, "v", vc, params)
			var err error
			if tt.call.target != "" {
				if _, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: p(tt.call.staging), VolumeCapability: vc}); err != nil {
					t.Fatal(err)
				}
			}
			before, mounts := tree(t, td.root), fmt.Sprint(td.host.Table())
			if tt.call.target == "" {
				_, err = td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: p(tt.call.staging), VolumeCapability: vc})
			} else {
				_, err = td.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: p(tt.call.staging),
					TargetPath: p(tt.call.target), VolumeCapability: vc})
			}
			wantCode(t, err, codes.InvalidArgument)
			if after := tree(t, td.root); after != before {
				t.Errorf("a refused call changed the disk:\n%s\n---\n%s", before, after)
			}
			if after := fmt.Sprint(td.host.Table()); after != mounts {
				t.Errorf("a refused call changed the mounts:\n%s\n---\n%s", mounts, after)
			}
		})
	}
}

// The paths kubelet uses, side by side, are accepted, and a repeated stage or publish
// (kubelet retries) is no nesting.
func TestSideBySidePathsAccepted(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	ctx := context.Background()
	vc := mountCap(rwo, "ext4")
	for _, name := range []string{"a", "b"} {
		id := td.create(t, name, vc, nil)
		staging := filepath.Join(td.root, "plugins/kubernetes.io/csi/poolcsi.test", name, "globalmount")
		target := filepath.Join(td.root, "pods/uid-1/volumes/kubernetes.io~csi", name, "mount")
		for range 2 {
			if _, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
				t.Fatal(err)
			}
			if _, err := td.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc}); err != nil {
				t.Fatal(err)
			}
		}
	}
}
