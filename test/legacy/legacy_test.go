// Package legacy is a CSI client built on spec v1.12.0, the last spec with
// VolumeCondition, as kubelet v1.36 (spec v1.9) and csi-external-health-monitor
// v0.15 are. It drives a real `poolcsi serve` (built on spec v1.13.0) and proves
// that what those consumers decode from it is right: the VOLUME_CONDITION
// capabilities, and volume_condition on ControllerGetVolume, ListVolumes and
// NodeGetVolumeStats, normal and abnormal, from the same health checks as the
// v1.13 VolumeHealth RPCs.
package legacy

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const mib = 1 << 20

func requireRoot(t *testing.T, why string) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("prerequisite missing in CI: needs root (%s)", why)
	}
	t.Skipf("needs root (%s)", why)
}

// serve builds poolcsi from the repository and runs it on a fresh local pool.
func serve(t *testing.T) (*grpc.ClientConn, string) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "poolcsi")
	build := exec.Command("go", "build", "-o", bin, "./cmd/poolcsi")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build poolcsi: %v\n%s", err, out)
	}
	sockDir, err := os.MkdirTemp("", "poolcsi-legacy-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	sock := filepath.Join(sockDir, "csi.sock")
	poolDir := filepath.Join(dir, "pool")
	var log bytes.Buffer
	cmd := exec.Command(bin, "serve", "--endpoint", "unix://"+sock, "--node-id", "node-1", "--pool", "local="+poolDir, "-v", "2", "--stats-health-ttl=0",
		"--allowed-path-prefix", os.TempDir()) // the staging and target paths are in the temp directory
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("poolcsi log:\n%s", log.String())
		}
	})
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
		cancel()
		if err == nil {
			return conn, poolDir
		}
		if time.Now().After(deadline) {
			t.Fatalf("poolcsi not ready: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestCapabilities(t *testing.T) {
	conn, _ := serve(t)
	ctx := context.Background()
	cc, err := csi.NewControllerClient(conn).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, c := range cc.GetCapabilities() {
		found = found || c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_VOLUME_CONDITION
	}
	if !found {
		t.Errorf("controller capabilities lack VOLUME_CONDITION (the health monitor exits without it): %v", cc)
	}
	nc, err := csi.NewNodeClient(conn).NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	found = false
	for _, c := range nc.GetCapabilities() {
		found = found || c.GetRpc().GetType() == csi.NodeServiceCapability_RPC_VOLUME_CONDITION
	}
	if !found {
		t.Errorf("node capabilities lack VOLUME_CONDITION (kubelet reads no condition without it): %v", nc)
	}
}

// The health monitor's calls: a volume is normal, its image is truncated
// behind the driver's back (abnormal, saying why), and repaired (normal).
func TestControllerCondition(t *testing.T) {
	conn, poolDir := serve(t)
	ctx := context.Background()
	ctrl := csi.NewControllerClient(conn)
	vol, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-legacy",
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	t.Cleanup(func() { _, _ = ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}) })
	check := func(wantAbnormal bool, wantIn string) {
		t.Helper()
		g, err := ctrl.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
		if err != nil {
			t.Fatal(err)
		}
		c := g.GetStatus().GetVolumeCondition()
		if c == nil || c.GetAbnormal() != wantAbnormal || !strings.Contains(c.GetMessage(), wantIn) {
			t.Errorf("ControllerGetVolume condition %v, want abnormal=%t naming %q", c, wantAbnormal, wantIn)
		}
		l, err := ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(l.GetEntries()) != 1 {
			t.Fatalf("ListVolumes: %v", l)
		}
		c = l.GetEntries()[0].GetStatus().GetVolumeCondition()
		if c == nil || c.GetAbnormal() != wantAbnormal || !strings.Contains(c.GetMessage(), wantIn) {
			t.Errorf("ListVolumes condition %v, want abnormal=%t naming %q", c, wantAbnormal, wantIn)
		}
	}
	check(false, "healthy")
	images, _ := filepath.Glob(filepath.Join(poolDir, "*", "*", "disk.img"))
	if len(images) != 1 {
		t.Fatalf("image of the volume: %v", images)
	}
	if err := os.Truncate(images[0], 8*mib); err != nil {
		t.Fatal(err)
	}
	check(true, "ImageTruncated")
	if err := os.Truncate(images[0], 16*mib); err != nil {
		t.Fatal(err)
	}
	check(false, "healthy")
}

// Kubelet's call: NodeGetVolumeStats on a published filesystem volume carries
// the condition; filled past the threshold it is abnormal, emptied normal again.
func TestNodeStatsCondition(t *testing.T) {
	requireRoot(t, "stages a volume: loop device, mkfs, mount")
	conn, _ := serve(t)
	ctx := context.Background()
	ctrl, node := csi.NewControllerClient(conn), csi.NewNodeClient(conn)
	vc := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	vol, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-stats", VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 * mib}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	t.Cleanup(func() {
		_, _ = node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		_, _ = node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		_, _ = ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	})
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	check := func(wantAbnormal bool, wantIn string) {
		t.Helper()
		s, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target, StagingTargetPath: staging})
		if err != nil {
			t.Fatal(err)
		}
		c := s.GetVolumeCondition()
		if c == nil || c.GetAbnormal() != wantAbnormal || !strings.Contains(c.GetMessage(), wantIn) {
			t.Errorf("NodeGetVolumeStats condition %v, want abnormal=%t naming %q", c, wantAbnormal, wantIn)
		}
		if len(s.GetUsage()) == 0 {
			t.Error("the condition replaced the usage")
		}
	}
	check(false, "healthy")
	fill := filepath.Join(target, "fill")
	f, err := os.Create(fill)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, mib)
	for i := 0; i < 64; i++ {
		if _, err := f.Write(buf); err != nil {
			break // full
		}
	}
	f.Close()
	syscall.Sync()
	check(true, "VolumeNearlyFull")
	if err := os.Remove(fill); err != nil {
		t.Fatal(err)
	}
	syscall.Sync()
	check(false, "healthy")
}
