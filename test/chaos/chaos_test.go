// Package chaos kills the driver at random points of every mutating call and
// races two drivers with separate mounts of one shared pool, then checks that
// nothing was lost, duplicated or leaked. It is bounded (rounds, not time) and
// seeded: POOLCSI_CHAOS_SEED replays a failure, POOLCSI_CHAOS_ROUNDS runs more.
package chaos

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
	"github.com/poolcsi/poolcsi/test/support/cephfs"
)

const mib = 1 << 20

type env struct {
	root, poolDir string
	d1, d2        *csiproc.Driver
	rng           *rand.Rand
}

func seed(t *testing.T) uint64 {
	s := uint64(time.Now().UnixNano())
	if v := os.Getenv("POOLCSI_CHAOS_SEED"); v != "" {
		var err error
		if s, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("POOLCSI_CHAOS_SEED: %v", err)
		}
	}
	t.Logf("chaos seed %d (replay with POOLCSI_CHAOS_SEED=%d)", s, s)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("FAILED with chaos seed %d: replay with POOLCSI_CHAOS_SEED=%d", s, s)
		}
	})
	return s
}

func rounds(def int) int {
	if v, err := strconv.Atoi(os.Getenv("POOLCSI_CHAOS_ROUNDS")); err == nil && v > 0 {
		return v
	}
	return def
}

// TestMain tears down the CephFS once every test is done, if one was started.
func TestMain(m *testing.M) { os.Exit(cephfs.Main(m)) }

// setup makes a shared pool on backend and starts a driver per view of it:
//
//   - btrfs: a btrfs filesystem (reflinks, qgroups for dir volumes) with the
//     pool on it, mounted a second time by bind at another path, so each driver
//     sees the pool through its own mount, as two nodes do;
//   - cephfs: a directory of the package's one-node CephFS (test/support/cephfs), seen
//     by node 1 through one ceph-fuse mount and by node 2 through the other:
//     two clients with their own caches, whose locks the MDS grants.
func setup(t *testing.T, backend string) *env {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "mkfs.xfs", "xfs_growfs", "blkid", "mount", "umount")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	var poolDir, view2 string
	switch backend {
	case "btrfs":
		testutil.RequireCommands(t, "mkfs.btrfs", "btrfs")
		mnt := testutil.LoopFS(t, root, "btrfs", 4096*mib)
		if out, err := exec.Command("btrfs", "quota", "enable", mnt).CombinedOutput(); err != nil {
			t.Fatalf("btrfs quota enable: %v\n%s", err, out)
		}
		poolDir = filepath.Join(mnt, "pool")
		view2 = filepath.Join(root, "node2-view")
		if err := os.MkdirAll(poolDir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(view2, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if out, err := exec.Command("umount", view2).CombinedOutput(); err != nil {
				t.Errorf("umount %s: %v\n%s", view2, err, out)
			}
		})
		if out, err := exec.Command("mount", "--bind", poolDir, view2).CombinedOutput(); err != nil {
			t.Fatalf("bind the pool for node 2: %v\n%s", err, out)
		}
	case "cephfs":
		c := cephfs.Shared(t)
		dir, err := os.MkdirTemp(c.Mounts[0], strings.ReplaceAll(t.Name(), "/", "-")+"-")
		if err != nil {
			t.Fatal(err)
		}
		poolDir, view2 = dir, filepath.Join(c.Mounts[1], filepath.Base(dir))
	default:
		t.Fatalf("unknown backend %q", backend)
	}
	if out, err := exec.Command(csiproc.Binary(t), "pool", "init", "--path", poolDir, "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("pool init: %v\n%s", err, out)
	}
	e := &env{root: root, poolDir: poolDir, rng: rand.New(rand.NewPCG(seed(t), 7))}
	e.d1 = csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"shared=" + poolDir + ",shared"}, SidecarDeadlines: true})
	e.d2 = csiproc.Start(t, csiproc.Options{NodeID: "node-2", Pools: []string{"shared=" + view2 + ",shared"}, SidecarDeadlines: true})
	for _, d := range []*csiproc.Driver{e.d1, e.d2} {
		d.LogSlowCalls(t, time.Second)
	}
	return e
}

func mountCap(mode csi.VolumeCapability_AccessMode_Mode, fs string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

const (
	rwo = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	rwx = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
)

// retryable are the codes a sidecar or kubelet retries; anything else from a
// call interrupted by a crash is a defect.
func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.Aborted, codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return false
}

// step is one mutating call of a volume's life.
type step struct {
	name string
	call func(ctx context.Context, d *csiproc.Driver) error
}

// killDuring runs s against d while a SIGKILL lands at a random moment within
// the call's first ~40 ms (or not at all, one time in four), restarts d, and
// then retries s until it succeeds: the retry must converge.
func (e *env) killDuring(t *testing.T, d *csiproc.Driver, s step) {
	t.Helper()
	killAfter := time.Duration(e.rng.IntN(40_000)) * time.Microsecond
	kill := e.rng.IntN(4) != 0
	var wg sync.WaitGroup
	if kill {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(killAfter)
			d.Kill()
		}()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	err := s.call(ctx, d)
	cancel()
	wg.Wait()
	if kill {
		d.Launch(t)
	}
	if err == nil {
		return
	}
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = s.call(ctx, d)
		cancel()
		if err == nil {
			return
		}
		if !retryable(err) || attempt > 20 {
			t.Fatalf("%s after a kill at %v (killed=%t): retry %d: %v", s.name, killAfter, kill, attempt, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func writeFile(t *testing.T, path string, n int) string {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	if _, err := io.CopyN(io.MultiWriter(f, h), rand.NewChaCha8([32]byte{1}), int64(n)); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func sum(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// poolCheck runs the operator's check: the pool must be clean.
func (e *env) poolCheck(t *testing.T) {
	t.Helper()
	out, err := exec.Command(csiproc.Binary(t), "pool", "check", "--path", e.poolDir).CombinedOutput()
	if err != nil {
		t.Fatalf("pool check after the round: %v\n%s", err, out)
	}
}

// TestKillAnywhere walks volumes of both layouts through their whole life
// (create, publish, stage, expand on the controller and the node, snapshot,
// restore from it, and back),
// killing the driver at a random moment of every mutating call; each call's
// retry must converge, the data written before must read back, and the pool
// must be clean with nothing leaked.
func TestKillAnywhere(t *testing.T) {
	e := setup(t, "btrfs")
	for round := 0; round < rounds(3); round++ {
		for _, layout := range []string{"image", "dir"} {
			t.Run(fmt.Sprintf("round%d-%s", round, layout), func(t *testing.T) { e.life(t, layout, round) })
		}
	}
	e.poolCheck(t)
}

func (e *env) life(t *testing.T, layout string, round int) {
	name := fmt.Sprintf("pvc-%s-%d", layout, round)
	// xfs, so NodeExpandVolume grows online here (ext4 needs CAP_SYS_RESOURCE).
	vc := mountCap(rwo, "xfs")
	params := map[string]string{"layout": layout}
	size := int64(320 * mib)
	if layout == "dir" {
		vc = mountCap(rwx, "")
	}
	dir := filepath.Join(e.root, name)
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	var id, data string
	snapName := name + "-snap"
	var snapID, restoredID string
	d := e.d1
	t.Cleanup(func() { // a failed life leaves no mount or loop device behind
		c := context.Background()
		if id == "" {
			return
		}
		_, _ = d.Node().NodeUnpublishVolume(c, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		_, _ = d.Node().NodeUnstageVolume(c, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		_, _ = d.Controller().ControllerUnpublishVolume(c, &csi.ControllerUnpublishVolumeRequest{VolumeId: id})
		if restoredID != "" {
			_, _ = d.Controller().DeleteVolume(c, &csi.DeleteVolumeRequest{VolumeId: restoredID})
		}
		if snapID != "" {
			_, _ = d.Controller().DeleteSnapshot(c, &csi.DeleteSnapshotRequest{SnapshotId: snapID})
		}
		_, _ = d.Controller().DeleteVolume(c, &csi.DeleteVolumeRequest{VolumeId: id})
	})
	steps := []step{
		{"CreateVolume", func(ctx context.Context, d *csiproc.Driver) error {
			r, err := d.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, Parameters: params,
				VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: size}})
			id = r.GetVolume().GetVolumeId()
			return err
		}},
		{"ControllerPublishVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: vc})
			return err
		}},
		{"NodeStageVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
			return err
		}},
		{"NodePublishVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc})
			return err
		}},
		{"write", func(context.Context, *csiproc.Driver) error {
			data = writeFile(t, filepath.Join(target, "data"), 3*mib)
			return nil
		}},
		{"ControllerExpandVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Controller().ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size}})
			return err
		}},
		{"NodeExpandVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Node().NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target, StagingTargetPath: staging,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size}})
			return err
		}},
		{"CreateSnapshot", func(ctx context.Context, d *csiproc.Driver) error {
			r, err := d.Controller().CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: snapName, SourceVolumeId: id})
			snapID = r.GetSnapshot().GetSnapshotId()
			return err
		}},
		{"CreateVolume from the snapshot", func(ctx context.Context, d *csiproc.Driver) error {
			r, err := d.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name + "-restored", Parameters: params,
				VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * size},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}}})
			restoredID = r.GetVolume().GetVolumeId()
			return err
		}},
		{"DeleteVolume of the restored volume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: restoredID})
			return err
		}},
		{"NodeUnpublishVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
			return err
		}},
		{"NodeUnstageVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		}},
		// The data must have survived every kill: stage and read it again.
		{"NodeStageVolume again", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
			return err
		}},
		{"check data", func(context.Context, *csiproc.Driver) error {
			if got := sum(t, filepath.Join(staging, "data")); got != data {
				t.Fatalf("data changed across the kills: %s, want %s", got, data)
			}
			return nil
		}},
		{"NodeUnstageVolume again", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		}},
		{"ControllerUnpublishVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"})
			return err
		}},
		{"DeleteSnapshot", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Controller().DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapID})
			return err
		}},
		{"DeleteVolume", func(ctx context.Context, d *csiproc.Driver) error {
			_, err := d.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		}},
	}
	for _, s := range steps {
		if s.name == "write" || s.name == "check data" {
			if err := s.call(context.Background(), d); err != nil {
				t.Fatal(err)
			}
			continue
		}
		e.killDuring(t, d, s)
	}
	e.poolCheck(t)
}

// TestTwoControllersRace races the two drivers, each on its own mount of the
// pool, on one name at a time: create with create, create with delete, publish
// with publish to the other node, stage with stage on the other node. Losers
// get a retryable code or the same answer, never INTERNAL; one image per name;
// the fence holds; the pool is clean at the end.
func TestTwoControllersRace(t *testing.T) {
	for _, backend := range []string{"btrfs", "cephfs"} {
		t.Run(backend, func(t *testing.T) { twoControllersRace(t, setup(t, backend)) })
	}
}

func twoControllersRace(t *testing.T, e *env) {
	vc := mountCap(rwo, "ext4")
	both := func(f func(d *csiproc.Driver, node string) error) (error, error) {
		var wg sync.WaitGroup
		var e1, e2 error
		wg.Add(2)
		go func() { defer wg.Done(); e1 = f(e.d1, "node-1") }()
		go func() { defer wg.Done(); e2 = f(e.d2, "node-2") }()
		wg.Wait()
		return e1, e2
	}
	ctx := func() context.Context {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		t.Cleanup(cancel)
		return c
	}
	for round := 0; round < rounds(8); round++ {
		name := fmt.Sprintf("race-%d", round)
		create := func(d *csiproc.Driver, _ string) error {
			_, err := d.Controller().CreateVolume(ctx(), &csi.CreateVolumeRequest{Name: name,
				VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 32 * mib}})
			return err
		}
		e1, e2 := both(create)
		for _, err := range []error{e1, e2} {
			if err != nil && !retryable(err) {
				t.Fatalf("racing creates of %s: %v", name, err)
			}
		}
		r, err := e.d1.Controller().CreateVolume(ctx(), &csi.CreateVolumeRequest{Name: name,
			VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 32 * mib}})
		if err != nil {
			t.Fatalf("create after the race: %v", err)
		}
		id := r.GetVolume().GetVolumeId()

		// Publish to two nodes at once: exactly one writer.
		e1, e2 = both(func(d *csiproc.Driver, node string) error {
			_, err := d.Controller().ControllerPublishVolume(ctx(), &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: vc})
			return err
		})
		if (e1 == nil) == (e2 == nil) {
			t.Fatalf("racing publishes to two nodes: %v / %v (exactly one must win)", e1, e2)
		}
		for _, n := range []string{"node-1", "node-2"} {
			if _, err := e.d1.Controller().ControllerUnpublishVolume(ctx(), &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: n}); err != nil {
				t.Fatal(err)
			}
		}
		// Stage on two nodes at once, no publish at all: exactly one writer,
		// and the volume mounts there.
		stagings := map[string]string{"node-1": filepath.Join(e.root, name, "s1"), "node-2": filepath.Join(e.root, name, "s2")}
		t.Cleanup(func() { // a failed round leaves no mount or loop device behind
			for node, d := range map[string]*csiproc.Driver{"node-1": e.d1, "node-2": e.d2} {
				_, _ = d.Node().NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagings[node]})
			}
			_, _ = e.d1.Controller().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id})
		})
		e1, e2 = both(func(d *csiproc.Driver, node string) error {
			_, err := d.Node().NodeStageVolume(ctx(), &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: stagings[node], VolumeCapability: vc})
			return err
		})
		if (e1 == nil) == (e2 == nil) {
			t.Fatalf("racing stages on two nodes: %v / %v (exactly one must win)", e1, e2)
		}
		for node, d := range map[string]*csiproc.Driver{"node-1": e.d1, "node-2": e.d2} {
			if _, err := d.Node().NodeUnstageVolume(ctx(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: stagings[node]}); err != nil {
				t.Fatalf("unstage on %s: %v", node, err)
			}
		}
		// Create racing delete of the same name: each answers OK or a
		// retryable code, and what is left is consistent either way.
		e1, e2 = both(func(d *csiproc.Driver, node string) error {
			if node == "node-1" {
				return create(d, node)
			}
			_, err := d.Controller().DeleteVolume(ctx(), &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		})
		for _, err := range []error{e1, e2} {
			if err != nil && !retryable(err) && status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("create racing delete: %v / %v", e1, e2)
			}
		}
		if _, err := e.d2.Controller().DeleteVolume(ctx(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatalf("delete after the race: %v", err)
		}
	}
	p, err := pool.OpenExisting(e.poolDir)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := p.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 0 {
		t.Fatalf("volumes left after every round deleted them: %d", len(entries))
	}
	e.poolCheck(t)
}
