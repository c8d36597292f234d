// Package faults injects real faults (read-only remounts, vanished mounts,
// truncated and deleted images, full filesystems, unwritable pools) under a
// real `poolcsi serve` process and checks that health and Probe report each
// one with a message naming the cause, and report healthy again after repair.
package faults

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

type env struct {
	t    *testing.T
	root string
	pool string // pool directory
	d    *csiproc.Driver
	// poolName, when set, is the pool parameter of create (needed when
	// several pools are configured).
	poolName string
}

func (e *env) params() map[string]string {
	if e.poolName == "" {
		return nil
	}
	return map[string]string{"pool": e.poolName}
}

// start runs poolcsi on a pool under a fresh temp dir. poolDir, when set, is a
// directory the test prepared (e.g. on its own small filesystem).
func start(t *testing.T, poolDir string, args ...string) *env {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid", "losetup", "mount")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	if poolDir == "" {
		poolDir = filepath.Join(root, "pool")
	}
	d := csiproc.Start(t, csiproc.Options{Pools: []string{"p=" + poolDir}, Args: args})
	return &env{t: t, root: root, pool: poolDir, d: d}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

func mountCap(fs string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

type vol struct {
	id, staging, target, image string
	cap                        *csi.VolumeCapability
}

// create makes a volume and registers its deletion.
func (e *env) create(name, fs string, size int64) *vol {
	e.t.Helper()
	c := mountCap(fs)
	resp, err := e.d.Controller().CreateVolume(ctx(e.t), &csi.CreateVolumeRequest{
		Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size}, VolumeCapabilities: []*csi.VolumeCapability{c},
		Parameters: e.params(),
	})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	id := resp.GetVolume().GetVolumeId()
	key := id[strings.IndexByte(id, '.')+1:]
	v := &vol{id: id, cap: c, image: filepath.Join(e.pool, "volumes", key, "disk.img"),
		staging: filepath.Join(e.root, name, "staging"), target: filepath.Join(e.root, name, "target")}
	e.t.Cleanup(func() {
		c := context.Background()
		e.d.Node().NodeUnpublishVolume(c, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: v.target})
		e.d.Node().NodeUnstageVolume(c, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: v.staging})
		// Whatever the driver could not undo (a test that broke things on purpose).
		for _, p := range []string{v.target, v.staging} {
			for i := 0; i < 4 && unix.Unmount(p, 0) == nil; i++ {
			}
		}
		detachBacking(v.image)
		if _, err := e.d.Controller().DeleteVolume(c, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			e.t.Errorf("DeleteVolume %s: %v", id, err)
		}
	})
	return v
}

// detachBacking detaches loop devices backed by image (deleted or not), only ours.
func detachBacking(image string) {
	out, _ := exec.Command("losetup", "-a").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if dev, rest, ok := strings.Cut(line, ":"); ok && strings.Contains(rest, "("+image) {
			exec.Command("losetup", "-d", dev).Run()
		}
	}
}

func (e *env) stage(v *vol) {
	e.t.Helper()
	if _, err := e.d.Node().NodeStageVolume(ctx(e.t), &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumeCapability: v.cap}); err != nil {
		e.t.Fatalf("NodeStageVolume: %v", err)
	}
}

func (e *env) publish(v *vol) {
	e.t.Helper()
	if _, err := e.d.Node().NodePublishVolume(ctx(e.t), &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging, TargetPath: v.target, VolumeCapability: v.cap}); err != nil {
		e.t.Fatalf("NodePublishVolume: %v", err)
	}
}

func (e *env) unpublish(v *vol) {
	e.t.Helper()
	if _, err := e.d.Node().NodeUnpublishVolume(ctx(e.t), &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
		e.t.Fatalf("NodeUnpublishVolume: %v", err)
	}
}

func (e *env) unstage(v *vol) {
	e.t.Helper()
	if _, err := e.d.Node().NodeUnstageVolume(ctx(e.t), &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
		e.t.Fatalf("NodeUnstageVolume: %v", err)
	}
}

func (e *env) nodeHealth(v *vol) *csi.VolumeHealth {
	e.t.Helper()
	resp, err := e.d.Node().NodeGetVolumeHealth(ctx(e.t), &csi.NodeGetVolumeHealthRequest{VolumeId: v.id, StagingTargetPath: v.staging, VolumePublishPath: v.target})
	if err != nil {
		e.t.Fatalf("NodeGetVolumeHealth: %v", err)
	}
	return resp.GetVolumeHealth()
}

func (e *env) controllerHealth(v *vol) *csi.VolumeHealth {
	e.t.Helper()
	resp, err := e.d.Controller().ControllerGetVolumeHealth(ctx(e.t), &csi.ControllerGetVolumeHealthRequest{VolumeId: v.id})
	if err != nil {
		e.t.Fatalf("ControllerGetVolumeHealth: %v", err)
	}
	return resp.GetVolumeHealth()
}

// listedHealth is the volume's entry in ControllerListVolumeHealth, or nil.
func (e *env) listedHealth(v *vol) *csi.VolumeHealth {
	e.t.Helper()
	resp, err := e.d.Controller().ControllerListVolumeHealth(ctx(e.t), &csi.ControllerListVolumeHealthRequest{})
	if err != nil {
		e.t.Fatalf("ControllerListVolumeHealth: %v", err)
	}
	for _, h := range resp.GetEntries() {
		if h.GetVolumeId() == v.id {
			return h
		}
	}
	return nil
}

// wantIssue asserts that h reports reason with status, and that the message
// names the cause (every word of words) and says what to do.
func wantIssue(t *testing.T, h *csi.VolumeHealth, status csi.VolumeHealthErrorType, reason string, words ...string) {
	t.Helper()
	for _, s := range h.GetHealthStatuses() {
		if s.GetReason() != reason {
			continue
		}
		if s.GetStatus() != status {
			t.Errorf("%s: status %s, want %s", reason, s.GetStatus(), status)
		}
		for _, w := range words {
			if !strings.Contains(s.GetMessage(), w) {
				t.Errorf("%s message does not mention %q: %s", reason, w, s.GetMessage())
			}
		}
		return
	}
	t.Fatalf("health does not report %s: %v", reason, h)
}

func wantHealthy(t *testing.T, h *csi.VolumeHealth) {
	t.Helper()
	if len(h.GetHealthStatuses()) != 0 {
		t.Fatalf("want a healthy volume, got %v", h)
	}
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// fill allocates a file on the filesystem at dir until it is used to at
// least frac (as df counts), and returns the file.
func fill(t *testing.T, dir string, frac float64) string {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	used := st.Blocks - st.Bfree
	reach := used + st.Bavail
	want := uint64(frac*float64(reach)) + 1
	if want <= used {
		t.Fatalf("%s already %d/%d used", dir, used, reach)
	}
	n := int64(want-used) * st.Bsize
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fallocate(int(f.Fd()), 0, 0, n); err != nil {
		t.Fatalf("fallocate %d bytes in %s: %v", n, dir, err)
	}
	return path
}
