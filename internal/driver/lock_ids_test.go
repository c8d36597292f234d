package driver

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// TestHostileIDsTakeNoLock: a volume ID is parsed before any lock is taken, and
// the lock is on the parsed identity. An RPC given a hostile ID answers
// INVALID_ARGUMENT even while that raw string's lock is held (a handler that
// locked the raw ID would answer ABORTED), and leaves no lock behind.
func TestHostileIDsTakeNoLock(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	ctx := context.Background()
	vc := mountCap(rwo, "ext4")
	staging, target := filepath.Join(td.root, "staging", "x"), filepath.Join(td.root, "target", "x")
	rpcs := []struct {
		name string
		call func(id string) error
	}{
		{"NodeStageVolume", func(id string) error {
			_, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
			return err
		}},
		{"NodePublishVolume", func(id string) error {
			_, err := td.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc})
			return err
		}},
		{"NodeUnpublishVolume", func(id string) error {
			_, err := td.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
			return err
		}},
		{"NodeUnstageVolume", func(id string) error {
			_, err := td.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		}},
		{"DeleteVolume", func(id string) error {
			_, err := td.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		}},
		{"ControllerPublishVolume", func(id string) error {
			_, err := td.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: vc})
			return err
		}},
		{"ControllerUnpublishVolume", func(id string) error {
			_, err := td.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"})
			return err
		}},
		{"CreateSnapshot", func(id string) error {
			_, err := td.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: id, Name: "snap"})
			return err
		}},
	}
	hostile := []string{
		"../../etc",
		"local/../../x",
		"local.0123456789abcdef0123456789abcdef/..",
		"local.0123456789abcdef\x000123456789abcdef",
		"local." + strings.Repeat("a", 4096),
		"LOCAL.0123456789ABCDEF0123456789ABCDEF",
		"local..",
	}
	for _, r := range rpcs {
		for _, id := range hostile {
			t.Run(r.name+"/"+strings.ToValidUTF8(id[:min(len(id), 24)], "?"), func(t *testing.T) {
				release, err := td.locks.acquire(id, "test")
				if err != nil {
					t.Fatal(err)
				}
				defer release()
				wantCode(t, r.call(id), codes.InvalidArgument)
				td.locks.mu.Lock()
				held := len(td.locks.busy)
				td.locks.mu.Unlock()
				if held != 1 {
					t.Errorf("%d locks held after the call, want only the test's", held)
				}
			})
		}
	}
}
