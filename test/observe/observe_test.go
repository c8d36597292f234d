// Package observe tests what operators watch: the livenessprobe sidecar's
// /healthz, the Prometheus /metrics endpoint, and `poolcsi demo`, each against
// the real binary.
package observe

import (
	"context"
	"io"
	"net"
	"net/http"
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

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// get fetches url, retrying while the server is still starting.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			return resp.StatusCode, string(body)
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: %v", url, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// livenessprobe returns the kubernetes-csi livenessprobe binary if the module
// proxy serves it, else the documented stand-in in test/support/livenessprobe (the
// proxy answers 403 for that module today).
func livenessprobe(t *testing.T) string {
	t.Helper()
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	bin := filepath.Join(cache, "poolcsi-test", "livenessprobe")
	real := filepath.Join(bin, "livenessprobe")
	if _, err := os.Stat(real); err == nil {
		return real
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "install", "github.com/kubernetes-csi/livenessprobe/cmd/livenessprobe@latest")
	cmd.Env = append(os.Environ(), "GOBIN="+bin, "GOFLAGS=-mod=mod")
	if out, err := cmd.CombinedOutput(); err == nil {
		return real
	} else {
		t.Logf("the real livenessprobe cannot be built from the module proxy (%v: %s); using the stand-in test/support/livenessprobe, which does what its /healthz does",
			err, strings.TrimSpace(string(out)))
	}
	stand := filepath.Join(t.TempDir(), "livenessprobe")
	build := exec.Command("go", "build", "-o", stand, "./test/support/livenessprobe")
	build.Dir = csiproc.RepoRoot()
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build test/support/livenessprobe: %v\n%s", err, out)
	}
	return stand
}

func TestLivenessProbeHealthz(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mount")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	poolDir := filepath.Join(root, "pool")
	d := csiproc.Start(t, csiproc.Options{Pools: []string{"p=" + poolDir}})

	addr := freeAddr(t)
	lp := exec.Command(livenessprobe(t), "--csi-address", d.Socket, "--http-endpoint", addr, "--probe-timeout", "5s")
	var lpLog strings.Builder
	lp.Stdout, lp.Stderr = &lpLog, &lpLog
	if err := lp.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		lp.Process.Kill()
		lp.Wait()
		if t.Failed() {
			t.Logf("livenessprobe log:\n%s", lpLog.String())
		}
	})
	url := "http://" + addr + "/healthz"
	if code, body := get(t, url); code != http.StatusOK {
		t.Fatalf("healthy driver: /healthz %d %s", code, body)
	}

	// Break the pool: a read-only bind mount over it.
	t.Cleanup(func() { unix.Unmount(poolDir, 0) })
	for _, args := range [][]string{{"--bind", poolDir, poolDir}, {"-o", "remount,bind,ro", poolDir}} {
		if out, err := exec.Command("mount", args...).CombinedOutput(); err != nil {
			t.Fatalf("mount %v: %v %s", args, err, out)
		}
	}
	// A broken pool is that pool's fault, not the process's: liveness stays
	// healthy (a restart would fix nothing), the pool's calls fail instead.
	if code, body := get(t, url); code != http.StatusOK {
		t.Fatalf("broken pool: /healthz %d %q, want 200 (the driver still serves)", code, body)
	}

	if err := unix.Unmount(poolDir, 0); err != nil {
		t.Fatal(err)
	}
	if code, body := get(t, url); code != http.StatusOK {
		t.Fatalf("repaired pool: /healthz %d %s", code, body)
	}
}

func TestMetricsAfterCalls(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	addr := freeAddr(t)
	d := csiproc.Start(t, csiproc.Options{Pools: []string{"p=" + filepath.Join(root, "pool")}, Args: []string{"--metrics-address", addr}})
	ctx := context.Background()
	c := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	vol, err := d.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "m", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, VolumeCapabilities: []*csi.VolumeCapability{c}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	t.Cleanup(func() { d.Controller().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}) })
	d.Controller().ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "p.00000000000000000000000000000000"}) // NOT_FOUND
	d.Controller().ListVolumes(ctx, &csi.ListVolumesRequest{})

	code, body := get(t, "http://"+addr+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d", code)
	}
	for _, want := range []string{
		`csi_plugin_operations_seconds_count{driver_name="poolcsi.io",grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume"} 1`,
		`csi_plugin_operations_seconds_count{driver_name="poolcsi.io",grpc_status_code="NotFound",method_name="/csi.v1.Controller/ControllerGetVolume"} 1`,
		`csi_plugin_operations_seconds_bucket{driver_name="poolcsi.io",grpc_status_code="OK",method_name="/csi.v1.Controller/ListVolumes",le="0.1"} 1`,
		`poolcsi_pool_up{node="node-1",pool="p"} 1`,
		`poolcsi_pool_volumes{node="node-1",pool="p"} 1`,
		`poolcsi_pool_provisioned_bytes{node="node-1",pool="p"} 6.7108864e+07`,
		`poolcsi_pool_volumes_by_condition{condition="normal",node="node-1",pool="p"} 1`,
		`poolcsi_pool_volumes_by_condition{condition="abnormal",node="node-1",pool="p"} 0`,
		`poolcsi_pool_size_bytes{node="node-1",pool="p"}`,
		`poolcsi_pool_free_bytes{node="node-1",pool="p"}`,
		`poolcsi_pool_allocated_bytes{node="node-1",pool="p"}`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if t.Failed() {
		t.Logf("/metrics:\n%s", grepLines(body, "csi_plugin", "poolcsi_"))
	}
}

func grepLines(s string, prefixes ...string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		for _, p := range prefixes {
			if strings.HasPrefix(l, p) {
				out = append(out, l)
			}
		}
	}
	return strings.Join(out, "\n")
}

func TestDemo(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.xfs", "blkid", "mount")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	out, err := exec.Command(csiproc.Binary(t), "demo", "--temp-dir", root).CombinedOutput()
	if err != nil {
		t.Fatalf("poolcsi demo: %v\n%s", err, out)
	}
	for _, want := range []string{"CreateVolume", "NodeStageVolume", "NodePublishVolume", "ControllerExpandVolume", "NodeGetVolumeStats", "CreateSnapshot", "DeleteSnapshot",
		"FilesystemReadOnly", "NodeUnpublishVolume", "NodeUnstageVolume", "DeleteVolume", "nothing is left behind"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
	if entries, _ := os.ReadDir(root); len(entries) != 0 {
		t.Errorf("demo left %d entries in %s", len(entries), root)
	}
	if t.Failed() {
		t.Log(string(out))
	}
}

func TestDemoNeedsRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("covered by running as a user; as root this test drops privileges")
	}
	// The built binary sits in a 0700 directory; give nobody a copy it can run.
	dir, err := os.MkdirTemp("", "poolcsi-nobody-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(csiproc.Binary(t))
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "poolcsi")
	if err := os.WriteFile(bin, raw, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "demo")
	cmd.SysProcAttr = &syscallCred
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "needs root") {
		t.Fatalf("demo as an unprivileged user: %v\n%s", err, out)
	}
}
