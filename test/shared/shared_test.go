// Package shared tests shared pools end to end: two real `poolcsi serve`
// processes with different node IDs over one pool, on each backend: a btrfs
// filesystem (a loop device) both drivers see at one path, and a CephFS (test/support/cephfs)
// mounted twice with ceph-fuse, one mount per driver, as two nodes are two
// clients of a real network filesystem, each with its own caches, and locks
// that the metadata server grants.
package shared

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
	"github.com/poolcsi/poolcsi/test/support/cephfs"
	"github.com/poolcsi/poolcsi/test/support/mountns"
)

const mib = int64(1) << 20

// TestMain runs the tests in a private mount namespace (test/support/mountns:
// their lost-pool mounts, whose daemon is stopped for seconds, would otherwise
// fail mkfs.btrfs anywhere on the machine meanwhile) and tears down the CephFS
// once every test is done, if one was started.
func TestMain(m *testing.M) {
	mountns.Isolate()
	os.Exit(cephfs.Main(m))
}

type env struct {
	backend string
	root    string
	poolDir string // the pool as node 1 sees it
	pool2   string // the pool as node 2 sees it: another mount of the same filesystem on cephfs
	quota   bool   // dir volumes get an enforced size (btrfs qgroups)
	d1, d2  *csiproc.Driver
}

// backends are the shared filesystems every shared-pool test runs on.
var backends = []string{"btrfs", "cephfs"}

// onEachBackend runs f as a subtest per backend, each with its own pool and drivers.
func onEachBackend(t *testing.T, f func(t *testing.T, e *env)) {
	for _, b := range backends {
		t.Run(b, func(t *testing.T) { f(t, setup(t, b)) })
	}
}

// setup lays out a shared pool on backend and starts two drivers sharing it,
// node 1 through poolDir, node 2 through pool2. Node 1 also has a local pool.
//
//   - btrfs: a loop-mounted btrfs with quota enabled (the admin's step, see
//     docs/pools.md); both drivers use the same path.
//   - cephfs: a directory of the package's one-node CephFS, node 1 through the
//     ceph-fuse mount of "node A", node 2 through that of "node B".
func setup(t *testing.T, backend string) *env { return setupSized(t, backend, 512*mib) }

// setupSized is setup with a btrfs pool of size bytes (sparse).
func setupSized(t *testing.T, backend string, size int64) *env {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	e := &env{backend: backend, root: root}
	switch backend {
	case "btrfs":
		testutil.RequireCommands(t, "mkfs.btrfs", "btrfs")
		mnt := testutil.LoopFS(t, root, "btrfs", size)
		if out, err := exec.Command("btrfs", "quota", "enable", mnt).CombinedOutput(); err != nil {
			t.Fatalf("btrfs quota enable: %v\n%s", err, out)
		}
		e.poolDir = filepath.Join(mnt, "pool")
		e.pool2, e.quota = e.poolDir, true
		if err := os.Mkdir(e.poolDir, 0o755); err != nil {
			t.Fatal(err)
		}
	case "cephfs":
		c := cephfs.Shared(t)
		dir, err := os.MkdirTemp(c.Mounts[0], strings.ReplaceAll(t.Name(), "/", "-")+"-")
		if err != nil {
			t.Fatal(err)
		}
		e.poolDir = dir
		e.pool2 = filepath.Join(c.Mounts[1], filepath.Base(dir))
		// Each test has a pool of its own, left in place when it ends (the
		// cluster goes whole at the end of the package): removing a tree on
		// CephFS that the other client just wrote takes seconds.
	default:
		t.Fatalf("unknown backend %q", backend)
	}
	// The operator's one explicit step for a shared pool: the driver never lays
	// out a share by itself (it could be an empty, unmounted directory).
	if out, err := exec.Command(csiproc.Binary(t), "pool", "init", "--path", e.poolDir, "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}
	e.d1 = csiproc.Start(t, csiproc.Options{NodeID: "node-1", SidecarDeadlines: true,
		Pools: []string{"shared=" + e.poolDir + ",shared", "local=" + filepath.Join(root, "local1")}})
	e.d2 = csiproc.Start(t, csiproc.Options{NodeID: "node-2", SidecarDeadlines: true,
		Pools: []string{"shared=" + e.pool2 + ",shared"}})
	for _, d := range []*csiproc.Driver{e.d1, e.d2} {
		d.LogSlowCalls(t, time.Second)
	}
	return e
}

func mountCap(mode csi.VolumeCapability_AccessMode_Mode, fsType string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func wantCode(t *testing.T, err error, code codes.Code, contains string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want %s", err, code)
	}
	if contains != "" && !strings.Contains(status.Convert(err).Message(), contains) {
		t.Fatalf("error %q does not name %q", status.Convert(err).Message(), contains)
	}
}

// must(call())(t) fails the test on call's error and returns its value.
func must[T any](v T, err error) func(*testing.T) T {
	return func(t *testing.T) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

func createVolume(t *testing.T, d *csiproc.Driver, name string, size int64, params map[string]string, vc *csi.VolumeCapability) *csi.Volume {
	t.Helper()
	ctx := context.Background()
	resp := must(d.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: name, Parameters: params, VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: size},
	}))(t)
	id := resp.GetVolume().GetVolumeId()
	t.Cleanup(func() {
		// Unpublish from every node, then delete: what the sidecars do at the end.
		d.Controller().ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id})
		if _, err := d.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	})
	return resp.GetVolume()
}

func publish(t *testing.T, d *csiproc.Driver, id, node string, vc *csi.VolumeCapability, readOnly bool) error {
	_, err := d.Controller().ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{
		VolumeId: id, NodeId: node, VolumeCapability: vc, Readonly: readOnly,
	})
	return err
}

func unpublish(t *testing.T, d *csiproc.Driver, id, node string) {
	t.Helper()
	must(d.Controller().ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: node}))(t)
}

// stagePublish stages and publishes id on d's node and returns the target path;
// both are undone in t.Cleanup.
func stagePublish(t *testing.T, d *csiproc.Driver, dir, id string, vc *csi.VolumeCapability) string {
	t.Helper()
	ctx := context.Background()
	staging := filepath.Join(dir, "staging")
	target := filepath.Join(dir, "target")
	t.Cleanup(func() {
		if _, err := d.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			t.Errorf("unstage: %v", err)
		}
	})
	must(d.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}))(t)
	t.Cleanup(func() {
		if _, err := d.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
			t.Errorf("unpublish: %v", err)
		}
	})
	must(d.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc}))(t)
	return target
}

func TestImageFence(t *testing.T) { onEachBackend(t, testImageFence) }

func testImageFence(t *testing.T, e *env) {
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	v := createVolume(t, e.d1, "fenced", 32*mib, map[string]string{"pool": "shared", "layout": "image"}, vc)
	id := v.GetVolumeId()
	if len(v.GetAccessibleTopology()) != 0 {
		t.Errorf("a shared pool volume has topology %v; it should be reachable from every node", v.GetAccessibleTopology())
	}

	if err := publish(t, e.d1, id, "node-1", vc, false); err != nil {
		t.Fatal(err)
	}
	// The second node's own controller sees the fence through the shared pool.
	wantCode(t, publish(t, e.d2, id, "node-2", vc, false), codes.FailedPrecondition, "node-1")
	wantCode(t, publish(t, e.d2, id, "node-2", vc, true), codes.FailedPrecondition, "node-1")
	// The node side of the fence: node 2 refuses to stage what node 1 holds.
	_, err := e.d2.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(e.root, "n2-staging"), VolumeCapability: vc})
	wantCode(t, err, codes.FailedPrecondition, "node-1")
	// Same node, same mode: idempotent. Same node, other mode: ALREADY_EXISTS.
	if err := publish(t, e.d2, id, "node-1", vc, false); err != nil {
		t.Fatalf("repeated publish: %v", err)
	}
	wantCode(t, publish(t, e.d1, id, "node-1", vc, true), codes.AlreadyExists, "")
	wantCode(t, publish(t, e.d1, id, "node-9", vc, false), codes.NotFound, "node-9")
	wantCode(t, publish(t, e.d1, id, "../x", vc, false), codes.InvalidArgument, "")

	lv := must(e.d2.Controller().ListVolumes(ctx, &csi.ListVolumesRequest{}))(t)
	if len(lv.Entries) != 1 || strings.Join(lv.Entries[0].GetStatus().GetPublishedNodeIds(), ",") != "node-1" {
		t.Fatalf("ListVolumes = %v, want published to node-1", lv.Entries)
	}
	_, err = e.d2.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
	wantCode(t, err, codes.FailedPrecondition, "node-1")

	unpublish(t, e.d2, id, "node-1")
	unpublish(t, e.d2, id, "node-1") // idempotent
	if err := publish(t, e.d2, id, "node-2", vc, false); err != nil {
		t.Fatalf("publish to node-2 after node-1 unpublished: %v", err)
	}
	// The operator cannot clear the fence of node 2 while its driver renews
	// its lease: it is alive and may be writing.
	wantCode(t, publish(t, e.d1, id, "node-1", vc, false), codes.FailedPrecondition, "node-2")
	unfence := func() ([]byte, error) {
		return exec.Command(csiproc.Binary(t), "pool", "unfence", "--path", e.poolDir, "--volume", id, "--node", "node-2").CombinedOutput()
	}
	if out, err := unfence(); err == nil || !strings.Contains(string(out), "--wait") {
		t.Fatalf("poolcsi pool unfence of a live node: %v\n%s", err, out)
	}
	// Node 2's driver stops cleanly, holding nothing staged there: it releases
	// its lease, and the operator clears its fence at once.
	e.d2.Stop()
	out, err := unfence()
	if err != nil || !strings.Contains(string(out), "node-2") {
		t.Fatalf("poolcsi pool unfence: %v\n%s", err, out)
	}
	e.d2.Launch(t)
	if err := publish(t, e.d1, id, "node-1", vc, false); err != nil {
		t.Fatalf("publish to node-1 after unfencing node-2: %v", err)
	}
	unpublish(t, e.d1, id, "node-1")
	if err := publish(t, e.d2, id, "node-2", vc, false); err != nil {
		t.Fatal(err)
	}
	target := stagePublish(t, e.d2, filepath.Join(e.root, "n2"), id, vc)
	if err := os.WriteFile(filepath.Join(target, "hello"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestRWXDirVolume: a dir volume written from both nodes at once. On btrfs its
// size is enforced by a qgroup and grows with ControllerExpandVolume; CephFS
// has no quota poolcsi sets, so there the volume says its size is not enforced,
// and its stats are the filesystem's.
func TestRWXDirVolume(t *testing.T) { onEachBackend(t, testRWXDirVolume) }

func testRWXDirVolume(t *testing.T, e *env) {
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
	v := createVolume(t, e.d1, "rwx", 50*mib, map[string]string{"pool": "shared", "layout": "dir"}, vc)
	id := v.GetVolumeId()
	if got := v.GetVolumeContext(); e.quota && (got["sizeEnforced"] != "true" || got["quota"] != "btrfs-qgroup") {
		t.Fatalf("volume context %v, want an enforced btrfs-qgroup size", got)
	} else if !e.quota && (got["sizeEnforced"] != "false" || got["quota"] != "none") {
		t.Fatalf("volume context %v, want sizeEnforced=false on %s", got, e.backend)
	}
	for _, n := range []struct {
		d    *csiproc.Driver
		node string
	}{{e.d1, "node-1"}, {e.d2, "node-2"}} {
		if err := publish(t, n.d, id, n.node, vc, false); err != nil {
			t.Fatalf("publish to %s: %v", n.node, err)
		}
	}
	t1 := stagePublish(t, e.d1, filepath.Join(e.root, "n1"), id, vc)
	t2 := stagePublish(t, e.d2, filepath.Join(e.root, "n2"), id, vc)

	if err := os.WriteFile(filepath.Join(t1, "note"), []byte("from node 1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(t2, "note")); err != nil || string(got) != "from node 1" {
		t.Fatalf("read through node 2: %q, %v", got, err)
	}
	if err := os.WriteFile(filepath.Join(t2, "reply"), []byte("from node 2"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(t2, "reply"), filepath.Join(t2, "reply.done")); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(t1, "reply.done")); err != nil || string(got) != "from node 2" {
		t.Fatalf("read through node 1: %q, %v", got, err)
	}
	lv := must(e.d1.Controller().ListVolumes(ctx, &csi.ListVolumesRequest{}))(t)
	if got := strings.Join(lv.Entries[0].GetStatus().GetPublishedNodeIds(), ","); got != "node-1,node-2" {
		t.Fatalf("published nodes %q", got)
	}
	if !e.quota {
		if n, err := writeZeros(filepath.Join(t1, "big"), 8*mib); err != nil {
			t.Fatalf("write: %d bytes, %v", n, err)
		}
		st := must(e.d2.Node().NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: t2}))(t)
		if u := st.GetUsage()[0]; u.GetTotal() <= 0 || u.GetAvailable() <= 0 {
			t.Fatalf("stats of an unenforced volume %v: want the filesystem's size and free space", u)
		}
		exp := must(e.d2.Controller().ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
			VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 120 * mib},
		}))(t)
		if exp.GetCapacityBytes() != 120*mib || exp.GetNodeExpansionRequired() {
			t.Fatalf("expand = %v, want 120 MiB without node expansion", exp)
		}
		return
	}

	n, err := writeZeros(filepath.Join(t1, "big"), 90*mib)
	if !errors.Is(err, unix.EDQUOT) && !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("90 MiB into a 50 MiB volume: wrote %d bytes, err %v; want EDQUOT", n, err)
	}
	if n < 40*mib || n > 52*mib {
		t.Fatalf("the write stopped at %d bytes, not near the 50 MiB limit", n)
	}
	t.Logf("90 MiB write into the 50 MiB volume stopped after %.1f MiB: %v", float64(n)/float64(mib), err)
	st := must(e.d2.Node().NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: t2}))(t)
	if u := st.GetUsage()[0]; u.GetTotal() != 50*mib || u.GetUsed() < 40*mib {
		t.Fatalf("stats %v: want total 50 MiB and the used bytes of the write", u)
	}

	if err := os.Remove(filepath.Join(t1, "big")); err != nil {
		t.Fatal(err)
	}
	syncfs(t, t1) // btrfs returns freed space to the qgroup at commit
	exp := must(e.d2.Controller().ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
		VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 120 * mib},
	}))(t)
	if exp.GetCapacityBytes() != 120*mib || exp.GetNodeExpansionRequired() {
		t.Fatalf("expand = %v, want 120 MiB without node expansion", exp)
	}
	if n, err := writeZeros(filepath.Join(t2, "big"), 90*mib); err != nil {
		t.Fatalf("90 MiB into the 120 MiB volume: wrote %d bytes: %v", n, err)
	}
	st = must(e.d1.Node().NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: t1}))(t)
	if u := st.GetUsage()[0]; u.GetTotal() != 120*mib || u.GetUsed() < 90*mib {
		t.Fatalf("stats after expansion %v", u)
	}
}

// writeZeros writes size bytes in 1 MiB chunks and fsyncs, returning how much
// was written before the first error.
func writeZeros(path string, size int64) (int64, error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, mib)
	var n int64
	for n < size {
		w, err := f.Write(buf)
		n += int64(w)
		if err != nil {
			return n, err
		}
	}
	return n, f.Sync()
}

func syncfs(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
}

// TestDeleteDirVolumeTouchesNothingElse is csi-driver-nfs #855 turned into a
// test: deleting one volume must not reach its siblings or the pool.
func TestDeleteDirVolumeTouchesNothingElse(t *testing.T) {
	onEachBackend(t, testDeleteDirVolumeTouchesNothingElse)
}

func testDeleteDirVolumeTouchesNothingElse(t *testing.T, e *env) {
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
	params := map[string]string{"pool": "shared", "layout": "dir"}
	doomed := createVolume(t, e.d1, "doomed", 20*mib, params, vc).GetVolumeId()
	sibling := createVolume(t, e.d1, "sibling", 20*mib, params, vc).GetVolumeId()
	dataOf := func(id string) string {
		vid, _ := pool.ParseVolumeID(id)
		return filepath.Join(e.poolDir, "volumes", vid.Key, "data")
	}

	canaries := []string{
		filepath.Join(e.poolDir, "canary"),
		filepath.Join(e.poolDir, "volumes", "canary"),
		filepath.Join(dataOf(sibling), "canary"),
		filepath.Join(dataOf(sibling), "nested", "deeper", "canary"),
	}
	for _, c := range canaries {
		os.MkdirAll(filepath.Dir(c), 0o755)
		if err := os.WriteFile(c, []byte("alive"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// What a pod may leave in its volume: deep trees, a symlink pointing out of
	// the volume at the pool, and on btrfs a subvolume of its own.
	d := dataOf(doomed)
	os.MkdirAll(filepath.Join(d, "a", "b", "c"), 0o755)
	os.WriteFile(filepath.Join(d, "a", "b", "c", "file"), []byte("x"), 0o644)
	if err := os.Symlink(e.poolDir, filepath.Join(d, "a", "escape")); err != nil {
		t.Fatal(err)
	}
	if e.backend == "btrfs" {
		if out, err := exec.Command("btrfs", "subvolume", "create", filepath.Join(d, "a", "podsub")).CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	} else if err := os.Mkdir(filepath.Join(d, "a", "podsub"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(d, "a", "podsub", "f"), []byte("x"), 0o644)

	// A target left mounted with no record (a crashed kubelet) still stops it.
	leftover := filepath.Join(e.root, "leftover")
	os.MkdirAll(leftover, 0o755)
	t.Cleanup(func() { exec.Command("umount", leftover).Run() })
	if out, err := exec.Command("mount", "--bind", d, leftover).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	_, err := e.d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: doomed})
	wantCode(t, err, codes.FailedPrecondition, leftover)
	if out, err := exec.Command("umount", leftover).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}

	// Never delete what a node has mounted, nor what is published.
	target := stagePublishNoCleanup(t, e.d2, filepath.Join(e.root, "n2"), doomed, vc)
	_, err = e.d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: doomed})
	wantCode(t, err, codes.FailedPrecondition, "")
	must(e.d2.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: doomed, TargetPath: target}))(t)
	must(e.d2.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: doomed, StagingTargetPath: filepath.Join(e.root, "n2", "staging")}))(t)
	if err := publish(t, e.d1, doomed, "node-2", vc, false); err != nil {
		t.Fatal(err)
	}
	_, err = e.d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: doomed})
	wantCode(t, err, codes.FailedPrecondition, "node-2")
	unpublish(t, e.d1, doomed, "node-2")

	must(e.d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: doomed}))(t)
	must(e.d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: doomed}))(t) // idempotent
	vid, _ := pool.ParseVolumeID(doomed)
	if _, err := os.Stat(filepath.Join(e.poolDir, "volumes", vid.Key)); !os.IsNotExist(err) {
		t.Fatalf("the deleted volume's directory is still there: %v", err)
	}
	for _, c := range append(canaries, filepath.Join(e.poolDir, "pool.json"), filepath.Join(e.poolDir, "nodes", "node-1.json")) {
		if _, err := os.Stat(c); err != nil {
			t.Errorf("deleting a sibling volume removed %s: %v", c, err)
		}
	}
	entries, _ := os.ReadDir(filepath.Join(e.poolDir, "volumes"))
	var names []string
	for _, de := range entries {
		names = append(names, de.Name())
	}
	if len(names) != 2 { // the sibling and the canary, no trash left behind
		t.Errorf("volumes/ holds %v", names)
	}
}

func stagePublishNoCleanup(t *testing.T, d *csiproc.Driver, dir, id string, vc *csi.VolumeCapability) string {
	t.Helper()
	ctx := context.Background()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	t.Cleanup(func() { // in case the test fails before undoing them itself
		d.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		d.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	})
	must(d.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}))(t)
	must(d.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc}))(t)
	return target
}

func TestLocalPoolTopology(t *testing.T) {
	e := setup(t, "btrfs") // the shared pool is not what this is about
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	topo := func(node string) *csi.TopologyRequirement {
		seg := &csi.Topology{Segments: map[string]string{"topology.poolcsi.io/node": node}}
		return &csi.TopologyRequirement{Requisite: []*csi.Topology{seg}, Preferred: []*csi.Topology{seg}}
	}
	_, err := e.d1.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "elsewhere", Parameters: map[string]string{"pool": "local"}, VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}, AccessibilityRequirements: topo("node-2"),
	})
	wantCode(t, err, codes.ResourceExhausted, "node-1")
	if _, err := os.Stat(filepath.Join(e.root, "local1", "volumes", pool.KeyForName("elsewhere"))); !os.IsNotExist(err) {
		t.Fatalf("a refused volume left a directory: %v", err)
	}

	resp := must(e.d1.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: "here", Parameters: map[string]string{"pool": "local"}, VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}, AccessibilityRequirements: topo("node-1"),
	}))(t)
	id := resp.GetVolume().GetVolumeId()
	t.Cleanup(func() { e.d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}) })
	at := resp.GetVolume().GetAccessibleTopology()
	if len(at) != 1 || at[0].GetSegments()["topology.poolcsi.io/node"] != "node-1" || len(at[0].GetSegments()) != 1 {
		t.Fatalf("accessible topology %v, want node-1 only", at)
	}
	// A node that cannot reach the local pool cannot have its volume published.
	wantCode(t, publish(t, e.d1, id, "node-2", vc, false), codes.NotFound, "node-1")
}

// TestUnenforcedDirVolume: a pool whose filesystem has no usable quota still
// makes dir volumes, and says everywhere that their size is not enforced.
func TestUnenforcedDirVolume(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	mnt := testutil.LoopFS(t, root, "ext4", 64*mib, "-q")
	d := csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"plain=" + filepath.Join(mnt, "pool")}})
	vc := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
	v := createVolume(t, d, "loose", 16*mib, map[string]string{"layout": "dir"}, vc)
	if got := v.GetVolumeContext(); got["sizeEnforced"] != "false" || got["quota"] != "none" {
		t.Fatalf("volume context %v, want sizeEnforced=false", got)
	}
	lv := must(d.Controller().ListVolumes(context.Background(), &csi.ListVolumesRequest{}))(t)
	if lv.Entries[0].GetVolume().GetVolumeContext()["sizeEnforced"] != "false" {
		t.Fatalf("ListVolumes does not say the size is not enforced: %v", lv.Entries[0])
	}
	vid, _ := pool.ParseVolumeID(v.GetVolumeId())
	raw := must(os.ReadFile(filepath.Join(mnt, "pool", "volumes", vid.Key, "volume.json")))(t)
	var meta pool.Volume
	if err := json.Unmarshal(raw, &meta); err != nil {
		t.Fatal(err)
	}
	if meta.Quota == nil || meta.Quota.Enforced || !strings.Contains(meta.Quota.Reason, "project quota") {
		t.Fatalf("volume.json quota = %+v, want not enforced with the reason", meta.Quota)
	}
	// The log line is written before CreateVolume returns.
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(d.Log(), "size is NOT enforced") {
		if time.Now().After(deadline) {
			t.Fatalf("the log does not say the size is not enforced:\n%s", d.Log())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestUninitialisedSharedPoolIsNotReady starts a driver on an empty directory
// configured as a shared pool — what an unmounted share looks like — and checks
// that it writes nothing there and is not ready until the operator lays it out.
func TestUninitialisedSharedPoolIsUnavailable(t *testing.T) {
	testutil.RequireRoot(t)
	root := t.TempDir()
	share := filepath.Join(root, "share")
	if err := os.Mkdir(share, 0o755); err != nil {
		t.Fatal(err)
	}
	d := csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"shared=" + share + ",shared"}})
	// The process serves (liveness); the pool is unavailable and says how to
	// initialise it, in its calls and in storage health.
	_, err := d.Controller().CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "v",
		VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")},
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 16 * mib}})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "pool init") {
		t.Fatalf("CreateVolume on an uninitialised shared pool = %v, want UNAVAILABLE saying how to initialise it", err)
	}
	sh, err := d.Node().NodeGetStorageHealth(context.Background(), &csi.NodeGetStorageHealthRequest{})
	if err != nil || len(sh.GetBackendHealth()) != 1 || !strings.Contains(sh.GetBackendHealth()[0].GetMessage(), "pool init") {
		t.Fatalf("storage health of an uninitialised shared pool: %v %v", sh, err)
	}
	if entries, _ := os.ReadDir(share); len(entries) != 0 {
		t.Fatalf("the driver wrote into what may be an unmounted share: %v", entries)
	}
	if out, err := exec.Command(csiproc.Binary(t), "pool", "init", "--path", share, "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}
	if sh, err := d.Node().NodeGetStorageHealth(context.Background(), &csi.NodeGetStorageHealthRequest{}); err != nil || len(sh.GetBackendHealth()) != 0 {
		t.Fatalf("storage health after pool init: %v %v", sh, err)
	}
}

// A link put in place of a dir volume's data directory, pointing at another
// subvolume, is removed as a link when the volume is deleted: the subvolume it
// names (here, a sibling volume's) is not deleted through it.
func TestDeleteDirVolumeWhoseDataIsALink(t *testing.T) {
	onEachBackend(t, testDeleteDirVolumeWhoseDataIsALink)
}

func testDeleteDirVolumeWhoseDataIsALink(t *testing.T, e *env) {
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
	params := map[string]string{"pool": "shared", "layout": "dir"}
	doomed := createVolume(t, e.d1, "linked", 20*mib, params, vc).GetVolumeId()
	victim := createVolume(t, e.d1, "victim", 20*mib, params, vc).GetVolumeId()
	p, err := pool.OpenExisting(e.poolDir)
	if err != nil {
		t.Fatal(err)
	}
	dv, _ := pool.ParseVolumeID(doomed)
	vv, _ := pool.ParseVolumeID(victim)
	canary := filepath.Join(p.DataPath(vv), "canary")
	if err := os.WriteFile(canary, []byte("alive"), 0o644); err != nil {
		t.Fatal(err)
	}
	if e.backend == "btrfs" {
		if out, err := exec.Command("btrfs", "subvolume", "delete", p.DataPath(dv)).CombinedOutput(); err != nil {
			t.Fatalf("btrfs subvolume delete: %v\n%s", err, out)
		}
	} else if err := os.RemoveAll(p.DataPath(dv)); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(p.DataPath(vv), p.DataPath(dv)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.d1.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: doomed}); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if raw, err := os.ReadFile(canary); err != nil || string(raw) != "alive" {
		t.Fatalf("the other volume's data went with the link: %q %v", raw, err)
	}
}
