package faults

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

func (e *env) wantReady() {
	e.t.Helper()
	resp, err := e.d.Identity().Probe(ctx(e.t), &csi.ProbeRequest{})
	if err != nil || !resp.GetReady().GetValue() {
		e.t.Fatalf("Probe: want ready, got %v, %v", resp, err)
	}
}

// wantPoolDown checks what a broken pool does: the driver stays live (Probe
// ready: restarting it would fix nothing), the pool's storage health is
// unreachable and a create in it answers code, each naming the cause.
func (e *env) wantPoolDown(code codes.Code, words ...string) {
	e.t.Helper()
	e.wantReady()
	sh, err := e.d.Node().NodeGetStorageHealth(ctx(e.t), &csi.NodeGetStorageHealthRequest{})
	if err != nil {
		e.t.Fatal(err)
	}
	msg := ""
	for _, b := range sh.GetBackendHealth() {
		if b.GetStatus() == csi.StorageHealthErrorType_STORAGE_UNREACHABLE {
			msg = b.GetMessage()
		}
	}
	_, cerr := e.d.Controller().CreateVolume(ctx(e.t), &csi.CreateVolumeRequest{Name: "while-down", VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4")},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if status.Code(cerr) != code {
		e.t.Fatalf("CreateVolume in the broken pool: %v, want %v", cerr, code)
	}
	for _, w := range words {
		if !strings.Contains(msg, w) {
			e.t.Errorf("storage health does not mention %q: %q", w, msg)
		}
		if !strings.Contains(status.Convert(cerr).Message(), w) && code == codes.Unavailable {
			e.t.Errorf("CreateVolume's error does not mention %q: %s", w, status.Convert(cerr).Message())
		}
	}
}

// readOnlyOver makes dir read-only with a read-only bind mount over it, the
// way a pool's filesystem looks after it was remounted read-only.
func readOnlyOver(t *testing.T, dir string) (restore func()) {
	t.Helper()
	t.Cleanup(func() { unix.Unmount(dir, 0) })
	run(t, "mount", "--bind", dir, dir)
	run(t, "mount", "-o", "remount,bind,ro", dir)
	return func() { run(t, "umount", dir) }
}

func TestProbePoolUnwritable(t *testing.T) {
	e := start(t, "")
	e.wantReady()
	restore := readOnlyOver(t, e.pool)
	e.wantPoolDown(codes.Unavailable, "pool p", "not writable", e.pool)
	restore()
	e.wantReady()
}

func TestProbePoolMissing(t *testing.T) {
	e := start(t, "")
	moved := e.pool + ".away"
	if err := os.Rename(e.pool, moved); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Rename(moved, e.pool) })
	e.wantPoolDown(codes.Unavailable, "pool p", "missing", e.pool)
	if err := os.Rename(moved, e.pool); err != nil {
		t.Fatal(err)
	}
	e.wantReady()
}

// smallFS mounts a fresh ext4 filesystem of size bytes at a directory under a
// temp dir, so a test can fill a pool without touching the host's disk.
func smallFS(t *testing.T, size int64) string {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "mount")
	dir := t.TempDir()
	csiproc.CheckNoLeaks(t, dir)
	img := filepath.Join(dir, "poolfs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v\n%s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o750); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Unmount(mnt, 0)
		detachBacking(img)
	})
	run(t, "mount", "-o", "loop", img, mnt)
	return filepath.Join(mnt, "pool")
}

func TestPoolNearlyFullAndOutOfSpace(t *testing.T) {
	poolDir := smallFS(t, 256<<20)
	e := start(t, poolDir)
	v := e.create("sparse", "ext4", 32<<20)
	wantHealthy(t, e.controllerHealth(v))
	storage := func() *csi.NodeGetStorageHealthResponse {
		resp, err := e.d.Node().NodeGetStorageHealth(ctx(t), &csi.NodeGetStorageHealthRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	if s := storage(); len(s.GetBackendHealth()) != 0 {
		t.Fatalf("storage health of a roomy pool: %v", s)
	}

	// Something else fills the pool's filesystem: the sparse image can no longer grow.
	filler := fill(t, filepath.Dir(poolDir), 0.95)
	wantIssue(t, e.controllerHealth(v), degraded, "PoolNearlyFull", "pool p", "sparse image can still grow", "Free space")
	if e.listedHealth(v) == nil {
		t.Fatal("ControllerListVolumeHealth does not list the volume of the full pool")
	}
	if s := storage(); len(s.GetBackendHealth()) != 1 || s.GetBackendHealth()[0].GetStatus() != csi.StorageHealthErrorType_STORAGE_DEGRADED {
		t.Fatalf("storage health of a nearly full pool: %v", s)
	}
	e.wantReady() // nearly full is a warning, not a reason to restart the driver

	rest := fill2(t, filepath.Dir(poolDir))
	e.wantPoolDown(codes.ResourceExhausted, "pool p", "out of space")

	os.Remove(rest)
	os.Remove(filler)
	e.wantReady()
	wantHealthy(t, e.controllerHealth(v))
}

// fill2 takes every free byte left.
func fill2(t *testing.T, dir string) string {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "filler2")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := int64(st.Bavail) * st.Bsize
	for n > 0 && unix.Fallocate(int(f.Fd()), 0, 0, n) != nil {
		n -= st.Bsize * 16 // metadata blocks for the extent tree come out of the same space
	}
	return path
}

// One pool unmounted under a running driver: no restart (Probe stays ready),
// and the healthy pool's volumes are created, staged and published.
func TestOneBrokenPoolKeepsTheOthersServing(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid", "losetup", "mount")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	broken := smallFS(t, 64<<20)
	good := filepath.Join(root, "good")
	d := csiproc.Start(t, csiproc.Options{Pools: []string{"broken=" + broken, "good=" + good}})
	e := &env{t: t, root: root, pool: good, d: d}
	// The broken pool's filesystem goes away under the driver.
	if err := unix.Unmount(filepath.Dir(broken), unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	e.wantReady()
	_, err := d.Controller().CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "in-broken", Parameters: map[string]string{"pool": "broken"},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4")}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("create in the unmounted pool: %v, want UNAVAILABLE", err)
	}
	resp, err := d.Controller().CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "in-good", Parameters: map[string]string{"pool": "good"},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4")}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatalf("create in the healthy pool: %v", err)
	}
	id := resp.GetVolume().GetVolumeId()
	staging, target := filepath.Join(root, "staging"), filepath.Join(root, "target")
	t.Cleanup(func() {
		d.Node().NodeUnpublishVolume(ctx(t), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		d.Node().NodeUnstageVolume(ctx(t), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		d.Controller().DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: id})
	})
	if _, err := d.Node().NodeStageVolume(ctx(t), &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap("ext4")}); err != nil {
		t.Fatalf("stage in the healthy pool: %v", err)
	}
	if _, err := d.Node().NodePublishVolume(ctx(t), &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: mountCap("ext4")}); err != nil {
		t.Fatalf("publish in the healthy pool: %v", err)
	}
	e.wantReady()
	if !strings.Contains(d.Log(), "Pool unavailable") {
		t.Error("the log does not say the pool is unavailable")
	}
}
