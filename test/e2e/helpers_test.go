// Package e2e drives the real poolcsi process over its CSI socket the way the
// external-resizer and kubelet do, on real loop devices, filesystems and mounts.
package e2e

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

const mib = int64(1) << 20

// env is one driver process on one temporary pool.
type env struct {
	t    testing.TB
	root string
	pool string
	drv  *csiproc.Driver
}

func newEnv(t testing.TB, tools ...string) *env {
	return newEnvArgs(t, nil, tools...)
}

// newEnvArgs passes extra flags to `poolcsi serve`.
func newEnvArgs(t testing.TB, args []string, tools ...string) *env {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, append([]string{"blkid", "mount", "umount"}, tools...)...)
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	e := &env{t: t, root: root, pool: filepath.Join(root, "pool")}
	e.drv = csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"e2e=" + e.pool}, Args: args})
	return e
}

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// create makes a volume, registers its deletion and returns its ID.
func (e *env) create(name string, vc *csi.VolumeCapability, size int64) string {
	e.t.Helper()
	return e.createVolume(name, vc, size).GetVolumeId()
}

// createVolume is create returning the whole volume CreateVolume answered.
func (e *env) createVolume(name string, vc *csi.VolumeCapability, size int64) *csi.Volume {
	e.t.Helper()
	resp, err := e.drv.Controller().CreateVolume(ctx(e.t), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{vc},
	})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	id := resp.GetVolume().GetVolumeId()
	e.t.Cleanup(func() {
		if _, err := e.drv.Controller().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			e.t.Errorf("DeleteVolume %s: %v", id, err)
		}
	})
	return resp.GetVolume()
}

func (e *env) staging(id string) string { return filepath.Join(e.root, "staging", id) }
func (e *env) target(id string) string  { return filepath.Join(e.root, "target", id) }

// stage stages a volume; unstage is registered first, so a half-done stage is
// released too.
func (e *env) stage(id string, vc *csi.VolumeCapability) {
	e.t.Helper()
	e.t.Cleanup(func() { e.unstage(id) })
	if _, err := e.drv.Node().NodeStageVolume(ctx(e.t), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging(id), VolumeCapability: vc,
	}); err != nil {
		e.t.Fatalf("NodeStageVolume %s: %v", id, err)
	}
}

func (e *env) unstage(id string) {
	if _, err := e.drv.Node().NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging(id),
	}); err != nil {
		e.t.Errorf("NodeUnstageVolume %s: %v", id, err)
	}
}

func (e *env) publish(id string, vc *csi.VolumeCapability, readOnly bool) {
	e.t.Helper()
	e.publishAt(id, e.target(id), vc, readOnly)
}

// publishAt publishes to target, as for a second pod; unpublish is registered first.
func (e *env) publishAt(id, target string, vc *csi.VolumeCapability, readOnly bool) {
	e.t.Helper()
	e.t.Cleanup(func() { e.unpublishAt(id, target) })
	if err := e.tryPublish(id, target, vc, readOnly); err != nil {
		e.t.Fatalf("NodePublishVolume %s at %s: %v", id, target, err)
	}
}

func (e *env) tryPublish(id, target string, vc *csi.VolumeCapability, readOnly bool) error {
	_, err := e.drv.Node().NodePublishVolume(ctx(e.t), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging(id), TargetPath: target,
		VolumeCapability: vc, Readonly: readOnly,
	})
	return err
}

func (e *env) unpublish(id string) { e.unpublishAt(id, e.target(id)) }

func (e *env) unpublishAt(id, target string) {
	if _, err := e.drv.Node().NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{
		VolumeId: id, TargetPath: target,
	}); err != nil {
		e.t.Errorf("NodeUnpublishVolume %s: %v", id, err)
	}
}

func (e *env) controllerExpand(id string, required int64) *csi.ControllerExpandVolumeResponse {
	e.t.Helper()
	resp, err := e.drv.Controller().ControllerExpandVolume(ctx(e.t), &csi.ControllerExpandVolumeRequest{
		VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: required},
	})
	if err != nil {
		e.t.Fatalf("ControllerExpandVolume %s to %d: %v", id, required, err)
	}
	return resp
}

func (e *env) nodeExpand(id, path string, required int64) int64 {
	e.t.Helper()
	resp, err := e.drv.Node().NodeExpandVolume(ctx(e.t), &csi.NodeExpandVolumeRequest{
		VolumeId: id, VolumePath: path, StagingTargetPath: e.staging(id),
		CapacityRange: &csi.CapacityRange{RequiredBytes: required},
	})
	if err != nil {
		e.t.Fatalf("NodeExpandVolume %s at %s: %v", id, path, err)
	}
	return resp.GetCapacityBytes()
}

// totalBytes is the bytes total NodeGetVolumeStats reports.
func (e *env) totalBytes(id, path string) int64 {
	e.t.Helper()
	resp, err := e.drv.Node().NodeGetVolumeStats(ctx(e.t), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: path})
	if err != nil {
		e.t.Fatalf("NodeGetVolumeStats %s at %s: %v", id, path, err)
	}
	for _, u := range resp.GetUsage() {
		if u.GetUnit() == csi.VolumeUsage_BYTES {
			return u.GetTotal()
		}
	}
	e.t.Fatalf("NodeGetVolumeStats %s: no bytes usage in %v", id, resp)
	return 0
}

// writeRandom writes n random bytes to path, fsyncs, and returns their SHA-256.
func writeRandom(t testing.TB, path string, n int64) string {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.CopyN(io.MultiWriter(f, h), rand.Reader, n); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// checksum is the SHA-256 of the first n bytes of path (all of it if n < 0).
func checksum(t testing.TB, path string, n int64) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var r io.Reader = f
	if n >= 0 {
		r = io.LimitReader(f, n)
	}
	h := sha256.New()
	if _, err := io.Copy(h, r); err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if status.Code(err) != want {
		t.Errorf("%s: got %v, want code %s", what, err, want)
	}
}
