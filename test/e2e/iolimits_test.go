package e2e

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/cgroup"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

const blkioRoot = "/sys/fs/cgroup/blkio"

// podCgroup makes a real cgroup v1 blkio cgroup shaped like kubelet's for a
// burstable pod (cgroupfs driver), below a parent cgroup of its own (never
// the node's kubepods), and a cgroup root for --cgroup-root whose blkio entry
// leads to that parent. Every cgroup it made is removed at cleanup.
func podCgroup(t testing.TB) (root, uid, podDir string) {
	t.Helper()
	testutil.RequireRoot(t)
	if _, err := os.Stat(filepath.Join(blkioRoot, "blkio.throttle.write_bps_device")); err != nil {
		if testutil.InCI() {
			t.Fatalf("prerequisite missing in CI: a cgroup v1 blkio hierarchy at %s: %v", blkioRoot, err)
		}
		t.Skipf("prerequisite missing: a cgroup v1 blkio hierarchy at %s: %v", blkioRoot, err)
	}
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	h := hex.EncodeToString(b)
	uid = h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
	parent := filepath.Join(blkioRoot, "poolcsi-test-"+h[:8])
	podDir = filepath.Join(parent, "kubepods", "burstable", "pod"+uid)
	t.Cleanup(func() {
		for d := podDir; d != blkioRoot; d = filepath.Dir(d) {
			if err := os.Remove(d); err != nil && !os.IsNotExist(err) {
				t.Errorf("remove cgroup %s: %v", d, err)
			}
		}
	})
	if err := os.MkdirAll(podDir, 0o755); err != nil {
		t.Fatal(err)
	}
	root = t.TempDir()
	if err := os.Symlink(parent, filepath.Join(root, "blkio")); err != nil {
		t.Fatal(err)
	}
	return root, uid, podDir
}

// throttleOf reads what the kernel holds podDir to on the one device it
// names: its number and the four limits.
func throttleOf(t testing.TB, podDir string) (string, cgroup.Limits) {
	t.Helper()
	var dev string
	read := func(file string) int64 {
		raw, err := os.ReadFile(filepath.Join(podDir, file))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
			if f := strings.Fields(line); len(f) == 2 {
				if dev != "" && f[0] != dev {
					t.Fatalf("%s names two devices: %q", file, raw)
				}
				dev = f[0]
			}
		}
		if dev == "" {
			return 0
		}
		n, err := cgroup.ReadV1(podDir, file, dev)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	l := cgroup.Limits{ReadBPS: read("blkio.throttle.read_bps_device"), WriteBPS: read("blkio.throttle.write_bps_device"),
		ReadIOPS: read("blkio.throttle.read_iops_device"), WriteIOPS: read("blkio.throttle.write_iops_device")}
	return dev, l
}

// podTarget is where kubelet v1.36 publishes a filesystem volume to a pod,
// below a kubelet root of the test's own: a restarted driver finds the pod
// again from that path.
func (e *env) podTarget(name, uid string) string {
	return filepath.Join(e.root, "kubelet/pods", uid, "volumes/kubernetes.io~csi", name, "mount")
}

// limitedVolume makes a volume with mutable parameters, stages it and
// publishes it to the pod uid at its podTarget (as kubelet does with
// podInfoOnMount).
func (e *env) limitedVolume(name, uid string, vc *csi.VolumeCapability, mutable map[string]string) string {
	e.t.Helper()
	resp, err := e.drv.Controller().CreateVolume(ctx(e.t), &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 512 * mib}, MutableParameters: mutable})
	if err != nil {
		e.t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	e.t.Cleanup(func() {
		if _, err := e.drv.Controller().DeleteVolume(ctx(e.t), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			e.t.Errorf("DeleteVolume %s: %v", id, err)
		}
	})
	e.stage(id, vc)
	target := e.podTarget(name, uid)
	e.t.Cleanup(func() { e.unpublishAt(id, target) })
	if _, err := e.drv.Node().NodePublishVolume(ctx(e.t), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging(id), TargetPath: target, VolumeCapability: vc,
		VolumeContext: map[string]string{"csi.storage.k8s.io/pod.uid": uid},
	}); err != nil {
		e.t.Fatal(err)
	}
	return id
}

func (e *env) modify(id string, params map[string]string) {
	e.t.Helper()
	if _, err := e.drv.Controller().ControllerModifyVolume(ctx(e.t), &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: params}); err != nil {
		e.t.Fatalf("ControllerModifyVolume %s: %v", id, err)
	}
}

// TestIOLimitsOnRealCgroupV1: the limits of a volume's class reach the
// kernel's blkio throttle files of its pod's cgroup, for the volume's own loop
// device, at publish; a modified class reaches them through the node's
// reconcile, without a new publish; 0 clears a limit. A restart of the driver
// between publish and modify changes none of it: the restarted driver finds
// the pod again from the kernel's mount table.
func TestIOLimitsOnRealCgroupV1(t *testing.T) {
	root, uid, podDir := podCgroup(t)
	e := newEnvArgs(t, []string{"--cgroup-root", root, "--io-limits-interval", "100ms"}, "mkfs.ext4", "losetup")
	vc := csiproc.MountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	id := e.limitedVolume("limited", uid, vc, map[string]string{"writeBytesPerSecond": "10Mi", "readIOPS": "500", "preallocate": "true"})

	dev, got := throttleOf(t, podDir)
	if want := (cgroup.Limits{WriteBPS: 10 << 20, ReadIOPS: 500}); got != want {
		t.Fatalf("after publish the kernel holds the pod to %+v on %s, want %+v", got, dev, want)
	}
	// The device is the volume's own loop device.
	backing, err := os.ReadFile(filepath.Join("/sys/dev/block", dev, "loop/backing_file"))
	if err != nil || !strings.Contains(string(backing), "/volumes/") || !strings.HasPrefix(strings.TrimSpace(string(backing)), e.pool) {
		t.Fatalf("device %s is backed by %q (%v), not a volume of the pool %s", dev, backing, err, e.pool)
	}

	for _, step := range []struct {
		name    string
		restart bool
		change  map[string]string
		want    cgroup.Limits
	}{
		{name: "a modify", change: map[string]string{"writeBytesPerSecond": "0", "writeIOPS": "200"},
			want: cgroup.Limits{ReadIOPS: 500, WriteIOPS: 200}},
		{name: "a driver restart and a modify", restart: true, change: map[string]string{"readIOPS": "0", "readBytesPerSecond": "30Mi"},
			want: cgroup.Limits{ReadBPS: 30 << 20, WriteIOPS: 200}},
	} {
		if step.restart {
			e.drv.Restart(t)
		}
		e.modify(id, step.change)
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
			if _, got = throttleOf(t, podDir); got == step.want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after %s the kernel holds the pod to %+v, want %+v", step.name, got, step.want)
			}
		}
	}
}

// BenchmarkIOLimitsV1 measures a direct-I/O writer (fio, 1 MiB sequential
// writes, O_DIRECT) in a real pod-shaped v1 blkio cgroup, on a published
// volume, without a limit and with a class of writeBytesPerSecond=20Mi, and
// reports both rates and the limited rate over the limit. Not pass/fail:
//
//	go test ./test/e2e -run '^$' -bench IOLimitsV1 -benchtime 1x
func BenchmarkIOLimitsV1(b *testing.B) {
	root, uid, podDir := podCgroup(b)
	testutil.RequireCommands(b, "fio")
	e := newEnvArgs(b, []string{"--cgroup-root", root, "--io-limits-interval", "100ms"}, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	id := e.limitedVolume("bench", uid, vc, nil)
	const limit = 20 << 20
	var free, limited []float64
	for i := 0; i < b.N; i++ {
		e.modify(id, map[string]string{"writeBytesPerSecond": "0"})
		waitThrottle(b, podDir, 0)
		free = append(free, fioInCgroup(b, podDir, e.podTarget("bench", uid)))
		e.modify(id, map[string]string{"writeBytesPerSecond": "20Mi"})
		waitThrottle(b, podDir, limit)
		limited = append(limited, fioInCgroup(b, podDir, e.podTarget("bench", uid)))
		b.Logf("round %d: unlimited %.1f MiB/s, limited to 20 MiB/s: %.1f MiB/s", i+1, free[i]/(1<<20), limited[i]/(1<<20))
	}
	b.ReportMetric(median(free)/(1<<20), "MiB/s-unlimited")
	b.ReportMetric(median(limited)/(1<<20), "MiB/s-limited")
	b.ReportMetric(median(limited)/limit, "limited/limit")
}

func waitThrottle(b *testing.B, podDir string, wbps int64) {
	b.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if _, l := throttleOf(b, podDir); l.WriteBPS == wbps {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("the write limit never became %d", wbps)
		}
	}
}

// fioInCgroup runs fio in the cgroup (the shell joins it, then execs fio)
// and returns its write rate in bytes per second.
func fioInCgroup(b *testing.B, podDir, dir string) float64 {
	b.Helper()
	out, err := exec.Command("sh", "-c", `echo $$ > "$1/cgroup.procs" && shift && exec fio "$@"`, "sh", podDir,
		"--name=w", "--filename="+filepath.Join(dir, "fio.dat"), "--rw=write", "--bs=1m", "--size=256m",
		"--direct=1", "--ioengine=psync", "--time_based", "--runtime=5", "--output-format=json").Output()
	if err != nil {
		b.Fatalf("fio: %v\n%s", err, out)
	}
	var r struct {
		Jobs []struct {
			Write struct {
				BW int64 `json:"bw_bytes"`
			} `json:"write"`
		} `json:"jobs"`
	}
	if err := json.Unmarshal(out, &r); err != nil || len(r.Jobs) != 1 {
		b.Fatalf("fio output: %v\n%s", err, out)
	}
	return float64(r.Jobs[0].Write.BW)
}
