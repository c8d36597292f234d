package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// ephemeral is one pod's inline volume as kubelet drives it: a handle and a
// target, published and unpublished by the handle alone.
type ephemeral struct {
	e      *env
	handle string
	target string
}

func (e *env) inline(name string) *ephemeral {
	sum := sha256.Sum256([]byte(e.root + name))
	return &ephemeral{e: e, handle: "csi-" + hex.EncodeToString(sum[:]), target: filepath.Join(e.root, "pods", name, "volumes", "mount")}
}

// publish is kubelet's NodePublishVolume of the inline volume; its unpublish
// is registered first, so a failed test leaves nothing behind.
func (v *ephemeral) publish(attrs map[string]string) {
	v.e.t.Helper()
	v.e.t.Cleanup(func() { _ = v.unpublish() })
	vctx := map[string]string{
		"csi.storage.k8s.io/ephemeral":     "true",
		"csi.storage.k8s.io/pod.name":      "db-0",
		"csi.storage.k8s.io/pod.namespace": "e2e",
	}
	for k, val := range attrs {
		vctx[k] = val
	}
	if err := os.MkdirAll(filepath.Dir(v.target), 0o750); err != nil {
		v.e.t.Fatal(err)
	}
	if _, err := v.e.drv.Node().NodePublishVolume(ctx(v.e.t), &csi.NodePublishVolumeRequest{
		VolumeId: v.handle, TargetPath: v.target, VolumeContext: vctx,
		VolumeCapability: csiproc.MountCap("", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER),
	}); err != nil {
		v.e.t.Fatalf("NodePublishVolume of inline volume %s: %v", v.handle, err)
	}
}

func (v *ephemeral) unpublish() error {
	_, err := v.e.drv.Node().NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: v.handle, TargetPath: v.target})
	return err
}

// requireNothingLeft fails unless no loop device, mount or volume of the
// test's pool is left.
func (e *env) requireNothingLeft() {
	e.t.Helper()
	out, err := exec.Command("losetup", "-a").Output()
	if err != nil {
		e.t.Fatal(err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, e.root) {
			e.t.Errorf("loop device left: %s", line)
		}
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		e.t.Fatal(err)
	}
	for _, line := range strings.Split(string(mi), "\n") {
		if strings.Contains(line, e.root) {
			e.t.Errorf("mount left: %s", line)
		}
	}
	ents, err := os.ReadDir(filepath.Join(e.pool, "volumes"))
	if err != nil {
		e.t.Fatal(err)
	}
	for _, ent := range ents {
		e.t.Errorf("volume left in the pool: %s", ent.Name())
	}
}

// TestEphemeralInlineLifecycle: publish an inline volume on a real loop
// device and filesystem, write, read its stats, unpublish: nothing is left.
func TestEphemeralInlineLifecycle(t *testing.T) {
	for _, tc := range []struct {
		name  string
		attrs map[string]string
		total int64 // at least, as the filesystem reports it
		tools []string
	}{
		{"default ext4 1Gi", nil, 900 * mib, []string{"mkfs.ext4"}},
		{"xfs 320Mi", map[string]string{"size": "320Mi", "fsType": "xfs"}, 250 * mib, []string{"mkfs.xfs"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.tools...)
			v := e.inline("pod-a")
			v.publish(tc.attrs)
			sum := writeRandom(t, filepath.Join(v.target, "data"), 8*mib)
			if got := checksum(t, filepath.Join(v.target, "data"), -1); got != sum {
				t.Fatalf("read back %s, wrote %s", got, sum)
			}
			if total := e.totalBytes(v.handle, v.target); total < tc.total {
				t.Errorf("NodeGetVolumeStats total %d, want at least %d", total, tc.total)
			}
			// A retried publish (kubelet retries on a timeout) changes nothing.
			v.publish(tc.attrs)
			if err := v.unpublish(); err != nil {
				t.Fatalf("NodeUnpublishVolume: %v", err)
			}
			e.requireNothingLeft()
			if err := v.unpublish(); err != nil {
				t.Fatalf("second NodeUnpublishVolume: %v", err)
			}
			// For the record, never asserted (a shared, noisy machine).
			for _, c := range e.drv.Calls() {
				t.Logf("%s took %s", c.Method, c.Elapsed)
			}
		})
	}
}

// TestEphemeralInlineSurvivesRestart: the driver restarts between publish and
// unpublish; the restarted driver's sweep keeps the volume (its target still
// shows it) and its unpublish removes it.
func TestEphemeralInlineSurvivesRestart(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	v := e.inline("pod-b")
	v.publish(map[string]string{"size": "256Mi"})
	sum := writeRandom(t, filepath.Join(v.target, "data"), 4*mib)
	e.drv.Restart(t)
	// The sweep at start has run or is running: a second, explicit look
	// comes after a call the restarted driver answered.
	if total := e.totalBytes(v.handle, v.target); total <= 0 {
		t.Fatalf("stats after restart: total %d", total)
	}
	waitSwept(t, e, 2)
	if got := checksum(t, filepath.Join(v.target, "data"), -1); got != sum {
		t.Fatalf("after restart read %s, wrote %s", got, sum)
	}
	if err := v.unpublish(); err != nil {
		t.Fatalf("NodeUnpublishVolume after restart: %v", err)
	}
	e.requireNothingLeft()
}

// TestEphemeralInlineLeakSwept: the driver dies, the pod's target is
// unmounted without it (kubelet cleaned up, or the node rebooted), and the
// driver started again removes the volume on its own.
func TestEphemeralInlineLeakSwept(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	kept, leaked := e.inline("pod-kept"), e.inline("pod-leaked")
	kept.publish(map[string]string{"size": "128Mi"})
	leaked.publish(map[string]string{"size": "128Mi"})
	e.drv.Kill()
	if out, err := exec.Command("umount", leaked.target).CombinedOutput(); err != nil {
		t.Fatalf("umount %s: %v: %s", leaked.target, err, out)
	}
	e.drv.Launch(t)
	waitSwept(t, e, 2)
	vols, err := os.ReadDir(filepath.Join(e.pool, "volumes"))
	if err != nil {
		t.Fatal(err)
	}
	if len(vols) != 1 {
		t.Fatalf("volumes after the sweep: %d, want 1 (the one still mounted)", len(vols))
	}
	if total := e.totalBytes(kept.handle, kept.target); total <= 0 {
		t.Fatalf("the kept volume's stats: %d", total)
	}
	if err := leaked.unpublish(); err != nil {
		t.Fatalf("unpublish of the swept volume: %v", err)
	}
	if err := kept.unpublish(); err != nil {
		t.Fatal(err)
	}
	e.requireNothingLeft()
}

// waitSwept waits until the driver's log (every process of the test) tells
// of n finished sweeps: each process sweeps once at start. It is a wait for
// an event, not a timing assertion: the limit only keeps a broken driver from
// hanging the test.
func waitSwept(t *testing.T, e *env, n int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for strings.Count(e.drv.Log(), "Swept ephemeral volumes") < n {
		if time.Now().After(deadline) {
			t.Fatalf("no sweep logged within a minute:\n%s", e.drv.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
