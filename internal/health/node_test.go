package health

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/poolcsi/poolcsi/internal/mount/fake"
)

// TestCheckNodeAlone: the node checks that need no driver, over the fake
// kernel. The driver's TestNodeHealthReasons covers every reason through
// NodeGetVolumeHealth; these are the cases only CheckNode itself decides.
func TestCheckNodeAlone(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name  string
		setup func(t *testing.T, h *fake.Host, v *NodeVolume)
		want  []string
	}{
		{"not attached, image there", func(*testing.T, *fake.Host, *NodeVolume) {}, nil},
		{"not attached, image gone", func(t *testing.T, _ *fake.Host, v *NodeVolume) {
			if err := os.Remove(v.Image); err != nil {
				t.Fatal(err)
			}
		}, []string{ReasonImageMissing}},
		{"block staged, nothing attached", func(_ *testing.T, _ *fake.Host, v *NodeVolume) {
			v.Block, v.StagingPath = true, filepath.Join(filepath.Dir(v.Image), "staging")
		}, []string{ReasonLoopDeviceDetached}},
		{"mounted read-only only, as asked", func(t *testing.T, h *fake.Host, v *NodeVolume) {
			v.Device = attachFormatted(t, h, v.Image)
			v.StagingPath = filepath.Join(filepath.Dir(v.Image), "staging")
			if err := h.Mount(ctx, v.Device, v.StagingPath, "ext4", []string{"ro"}); err != nil {
				t.Fatal(err)
			}
		}, nil},
		{"read-only under a writable mount", func(t *testing.T, h *fake.Host, v *NodeVolume) {
			v.Device = attachFormatted(t, h, v.Image)
			v.StagingPath = filepath.Join(filepath.Dir(v.Image), "staging")
			if err := h.Mount(ctx, v.Device, v.StagingPath, "ext4", nil); err != nil {
				t.Fatal(err)
			}
			h.SetFilesystemReadOnly(v.StagingPath)
		}, []string{ReasonFilesystemReadOnly}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			v := NodeVolume{ID: "p.v", Image: filepath.Join(dir, "disk.img"), FSType: "ext4"}
			if err := os.WriteFile(v.Image, make([]byte, 1<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			h := fake.New()
			tt.setup(t, h, &v)
			var got []string
			for _, is := range CheckNode(h, v, DefaultOptions) {
				got = append(got, is.Reason)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("reasons %q, want %q", got, tt.want)
			}
		})
	}
}

func attachFormatted(t *testing.T, h *fake.Host, image string) string {
	t.Helper()
	dev, err := h.Attach(context.Background(), image)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Format(context.Background(), dev, "ext4"); err != nil {
		t.Fatal(err)
	}
	return dev
}

// TestReadOnlyMessageNamesTheRepairTool: the message of a filesystem turned read-only names
// the command that repairs that filesystem (it said "run fsck" for every one, and fsck.xfs
// does nothing).
func TestReadOnlyMessageNamesTheRepairTool(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct{ fsType, want, notWant string }{
		{"ext4", "e2fsck -f ", ""},
		{"xfs", "xfs_repair ", "fsck"},
		{"btrfs", "btrfs check ", "fsck"},
	} {
		t.Run(tc.fsType, func(t *testing.T) {
			dir := t.TempDir()
			v := NodeVolume{ID: "p.v", Image: filepath.Join(dir, "disk.img"), FSType: tc.fsType}
			if err := os.WriteFile(v.Image, make([]byte, 1<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			h := fake.New()
			dev, err := h.Attach(ctx, v.Image)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Format(ctx, dev, tc.fsType); err != nil {
				t.Fatal(err)
			}
			v.Device, v.StagingPath = dev, filepath.Join(dir, "staging")
			if err := h.Mount(ctx, dev, v.StagingPath, tc.fsType, nil); err != nil {
				t.Fatal(err)
			}
			h.SetFilesystemReadOnly(v.StagingPath)
			issues := CheckNode(h, v, DefaultOptions)
			if len(issues) != 1 || issues[0].Reason != ReasonFilesystemReadOnly {
				t.Fatalf("issues %+v, want one %s", issues, ReasonFilesystemReadOnly)
			}
			msg := issues[0].Message
			if !strings.Contains(msg, tc.want+v.Image) {
				t.Errorf("the message does not say to run %q on the image:\n%s", tc.want, msg)
			}
			if tc.notWant != "" && strings.Contains(msg, tc.notWant) {
				t.Errorf("the message says %q, which does not repair %s:\n%s", tc.notWant, tc.fsType, msg)
			}
		})
	}
}
