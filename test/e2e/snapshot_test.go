package e2e

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// snapshot cuts a snapshot and registers its deletion.
func (e *env) snapshot(name, source string) *csi.Snapshot {
	e.t.Helper()
	resp, err := e.drv.Controller().CreateSnapshot(ctx(e.t), &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: source})
	if err != nil {
		e.t.Fatalf("CreateSnapshot %s of %s: %v", name, source, err)
	}
	id := resp.GetSnapshot().GetSnapshotId()
	e.t.Cleanup(func() {
		if _, err := e.drv.Controller().DeleteSnapshot(context.Background(), &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
			e.t.Errorf("DeleteSnapshot %s: %v", id, err)
		}
	})
	return resp.GetSnapshot()
}

func snapshotSource(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
}

func volumeSource(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
}

func (e *env) tryCreateFrom(name string, vc *csi.VolumeCapability, size int64, src *csi.VolumeContentSource) (*csi.Volume, error) {
	resp, err := e.drv.Controller().CreateVolume(ctx(e.t), &csi.CreateVolumeRequest{
		Name:                name,
		CapacityRange:       &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities:  []*csi.VolumeCapability{vc},
		VolumeContentSource: src,
	})
	if err == nil {
		id := resp.GetVolume().GetVolumeId()
		e.t.Cleanup(func() {
			if _, err := e.drv.Controller().DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				e.t.Errorf("DeleteVolume %s: %v", id, err)
			}
		})
	}
	return resp.GetVolume(), err
}

// TestSnapshotRestoreAndClone writes random data, snapshots the volume while it is
// staged (and frozen), overwrites the data, restores the snapshot into a larger
// volume and clones the volume directly, then mounts all three on this node at
// once: each shows the data it should, and the restored filesystem has grown.
func TestSnapshotRestoreAndClone(t *testing.T) {
	tests := []struct {
		fsType, poolFS string
		size, bigger   int64
	}{
		// The test's temp dir: ext4 here, so copies are sparse copies.
		{"ext4", "", 320 * mib, 512 * mib},
		{"xfs", "", 320 * mib, 512 * mib},
		// A pool on btrfs: copies are reflinks, and a btrfs clone (same fsid as
		// its source) must mount next to its source.
		{"btrfs", "btrfs", 160 * mib, 256 * mib},
	}
	for _, tt := range tests {
		t.Run(tt.fsType+"-on-"+firstNonEmpty(tt.poolFS, "tmp"), func(t *testing.T) {
			var e *env
			if tt.poolFS == "" {
				e = newEnv(t, "mkfs."+tt.fsType)
			} else {
				e = newEnvOnLoopFS(t, tt.poolFS, 2<<30, "mkfs."+tt.fsType)
			}
			restoreAndClone(t, e, tt.fsType, tt.size, tt.bigger)
		})
	}
}

func firstNonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// newEnvOnLoopFS is newEnv with the pool on a fresh filesystem of poolFS.
func newEnvOnLoopFS(t *testing.T, poolFS string, size int64, tools ...string) *env {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, append([]string{"blkid", "mount", "umount"}, tools...)...)
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	mnt := testutil.LoopFS(t, root, poolFS, size)
	e := &env{t: t, root: root, pool: filepath.Join(mnt, "pool")}
	e.drv = csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"e2e=" + e.pool}})
	return e
}

func restoreAndClone(t *testing.T, e *env, fsType string, size, bigger int64) {
	vc := csiproc.MountCap(fsType, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	const n = 8 * mib
	src := e.create("src", vc, size)
	e.stage(src, vc)
	e.publish(src, vc, false)
	file := func(id string) string { return filepath.Join(e.target(id), "data") }
	original := writeRandom(t, file(src), n)

	snap := e.snapshot("snap", src)
	if !snap.GetReadyToUse() || snap.GetSourceVolumeId() != src || snap.GetSizeBytes() != size {
		t.Fatalf("snapshot %+v", snap)
	}
	if again := e.snapshot("snap", src); again.GetSnapshotId() != snap.GetSnapshotId() {
		t.Fatalf("retried CreateSnapshot gave %s, first %s", again.GetSnapshotId(), snap.GetSnapshotId())
	}
	if !strings.Contains(e.drv.Log(), "Froze filesystem for a snapshot") {
		t.Errorf("the staged source was not frozen around the copy")
	}
	overwritten := writeRandom(t, file(src), n)
	if overwritten == original {
		t.Fatal("random data repeated")
	}

	// Refusals first: nothing is made by them.
	_, err := e.tryCreateFrom("too-small", vc, size-mib, snapshotSource(snap.GetSnapshotId()))
	wantCode(t, "restore below the source's size", err, codes.OutOfRange)
	other := "xfs"
	if fsType == "xfs" {
		other = "ext4"
	}
	_, err = e.tryCreateFrom("wrong-fs", csiproc.MountCap(other, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), bigger, snapshotSource(snap.GetSnapshotId()))
	wantCode(t, "restore into another filesystem", err, codes.InvalidArgument)
	_, err = e.tryCreateFrom("as-block", csiproc.BlockCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), bigger, snapshotSource(snap.GetSnapshotId()))
	wantCode(t, "restore a filesystem snapshot as block", err, codes.InvalidArgument)
	missing := strings.Replace(snap.GetSnapshotId(), "@", "@0", 1)[:len(snap.GetSnapshotId())]
	_, err = e.tryCreateFrom("missing", vc, bigger, snapshotSource(missing))
	wantCode(t, "restore a snapshot that does not exist", err, codes.NotFound)
	_, err = e.drv.Controller().CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: strings.Replace(src, ".", ".0", 1)[:len(src)]})
	wantCode(t, "CreateSnapshot of the same name from another volume", err, codes.AlreadyExists)

	restored, err := e.tryCreateFrom("restored", vc, bigger, snapshotSource(snap.GetSnapshotId()))
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	if restored.GetCapacityBytes() != bigger || restored.GetContentSource().GetSnapshot().GetSnapshotId() != snap.GetSnapshotId() {
		t.Fatalf("restored volume %+v", restored)
	}
	clone, err := e.tryCreateFrom("clone", vc, size, volumeSource(src))
	if err != nil {
		t.Fatalf("clone: %v", err)
	}
	if clone.GetContentSource().GetVolume().GetVolumeId() != src {
		t.Fatalf("clone's content source %+v", clone.GetContentSource())
	}

	for _, id := range []string{restored.GetVolumeId(), clone.GetVolumeId()} {
		e.stage(id, vc)
		e.publish(id, vc, false)
	}
	if got := checksum(t, file(restored.GetVolumeId()), -1); got != original {
		t.Errorf("restored volume holds %s, the snapshot was taken of %s", got, original)
	}
	if got := checksum(t, file(clone.GetVolumeId()), -1); got != overwritten {
		t.Errorf("clone holds %s, its source %s", got, overwritten)
	}
	if got := checksum(t, file(src), -1); got != overwritten {
		t.Errorf("source holds %s after the copies, want %s", got, overwritten)
	}
	if total := e.totalBytes(restored.GetVolumeId(), e.target(restored.GetVolumeId())); total <= size {
		t.Errorf("restored filesystem is %d bytes, not grown beyond the source's %d", total, size)
	}

	wantMethod := "copy"
	if fsType == "btrfs" {
		wantMethod = "reflink"
	}
	if !strings.Contains(e.drv.Log(), `copy="`+wantMethod+`"`) {
		t.Errorf("copies did not use %s", wantMethod)
	}
	list, err := e.drv.Controller().ListSnapshots(ctx(t), &csi.ListSnapshotsRequest{SourceVolumeId: src})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetSnapshot().GetSnapshotId() != snap.GetSnapshotId() {
		t.Fatalf("ListSnapshots by source: %v, %v", list, err)
	}
}

// TestSnapshotOutlivesSource deletes a volume that has a snapshot: allowed, and the
// snapshot still restores.
func TestSnapshotOutlivesSource(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	resp, err := e.drv.Controller().CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "short-lived", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 * mib}, VolumeCapabilities: []*csi.VolumeCapability{vc}})
	if err != nil {
		t.Fatal(err)
	}
	src := resp.GetVolume().GetVolumeId()
	snap := e.snapshot("keep", src)
	if _, err := e.drv.Controller().DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: src}); err != nil {
		t.Fatalf("DeleteVolume of a snapshot's source: %v", err)
	}
	if again := e.snapshot("keep", src); again.GetSnapshotId() != snap.GetSnapshotId() {
		t.Fatalf("retried CreateSnapshot after its source was deleted: %v", again)
	}
	restored, err := e.tryCreateFrom("from-orphan", vc, 0, snapshotSource(snap.GetSnapshotId()))
	if err != nil || restored.GetCapacityBytes() != 64*mib {
		t.Fatalf("restore after the source was deleted: %v, %v", restored, err)
	}
	e.stage(restored.GetVolumeId(), vc)
}

// treeState lists every path under root with its size and mode, to show a
// refused request changed nothing on disk.
func treeState(t *testing.T, root string) string {
	t.Helper()
	var lines []string
	err := filepath.WalkDir(root, func(path string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(path)
		if err != nil {
			return err
		}
		lines = append(lines, path+" "+fi.Mode().String()+" "+fi.ModTime().String()+" "+fmt.Sprint(fi.Size()))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// TestSnapshotHostileIDs sends snapshot IDs that try to leave the pool, or to
// name a volume, to every call that takes one: hostile ones are
// INVALID_ARGUMENT, none deletes or creates anything.
func TestSnapshotHostileIDs(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	vol := e.create("victim", vc, 64*mib)
	snap := e.snapshot("victim-snap", vol)
	key := vol[strings.Index(vol, ".")+1:]
	before := treeState(t, e.pool)

	hostile := []string{
		"../../etc@" + key,
		"e2e@../../volumes/" + key,
		"e2e@" + key + "/../../" + key,
		"e2e@" + key[:31] + "\x00",
		"e2e@..",
		"/etc/passwd",
		strings.Repeat("a/", 200),
	}
	c := e.drv.Controller()
	for _, id := range hostile {
		_, err := c.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: id})
		wantCode(t, "DeleteSnapshot "+id, err, codes.InvalidArgument)
		_, err = c.GetSnapshot(ctx(t), &csi.GetSnapshotRequest{SnapshotId: id})
		wantCode(t, "GetSnapshot "+id, err, codes.InvalidArgument)
		_, err = c.ListSnapshots(ctx(t), &csi.ListSnapshotsRequest{SnapshotId: id})
		wantCode(t, "ListSnapshots "+id, err, codes.InvalidArgument)
		_, err = e.tryCreateFrom("from-hostile", vc, 64*mib, snapshotSource(id))
		wantCode(t, "CreateVolume from "+id, err, codes.InvalidArgument)
	}
	// Well-formed IDs that name no snapshot: the volume's own ID, and a snapshot
	// ID carrying the volume's key. Deleting them succeeds and deletes nothing.
	for _, id := range []string{vol, "e2e@" + key, "nopool@" + key} {
		if _, err := c.DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
			t.Errorf("DeleteSnapshot %s: %v", id, err)
		}
		_, err := c.GetSnapshot(ctx(t), &csi.GetSnapshotRequest{SnapshotId: id})
		wantCode(t, "GetSnapshot "+id, err, codes.NotFound)
	}
	_, err := c.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: "../" + key})
	wantCode(t, "CreateSnapshot of a hostile source", err, codes.InvalidArgument)
	_, err = c.CreateSnapshot(ctx(t), &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: vol, Parameters: map[string]string{"path": "/"}})
	wantCode(t, "CreateSnapshot with an unknown parameter", err, codes.InvalidArgument)

	if after := treeState(t, e.pool); after != before {
		t.Errorf("refused requests changed the pool:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if _, err := c.GetSnapshot(ctx(t), &csi.GetSnapshotRequest{SnapshotId: snap.GetSnapshotId()}); err != nil {
		t.Errorf("the real snapshot is gone: %v", err)
	}
}

// TestThawAfterCrash leaves a volume frozen with a freeze marker, as a driver
// of an older version killed in the middle of a snapshot copy would, and
// checks the restarted driver thaws it — pods' writes would otherwise hang
// until someone ran fsfreeze -u. The marker names a path the driver does not
// use: it thaws its own mount of the volume, in the background after Probe
// answers, then removes the marker.
func TestThawAfterCrash(t *testing.T) {
	e := newEnv(t, "mkfs.ext4", "fsfreeze")
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	id := e.create("pvc-frozen", vc, 32*mib)
	e.stage(id, vc)
	staging := e.staging(id)
	// Registered before the freeze: a failing test must not leave it frozen.
	t.Cleanup(func() { exec.Command("fsfreeze", "-u", staging).Run() })
	if out, err := exec.Command("fsfreeze", "-f", staging).CombinedOutput(); err != nil {
		t.Fatalf("fsfreeze -f: %v\n%s", err, out)
	}
	key := id[strings.IndexByte(id, '.')+1:]
	marker := filepath.Join(e.pool, "volumes", key, "frozen")
	if err := os.WriteFile(marker, []byte("node-1\n/elsewhere"), 0o600); err != nil {
		t.Fatal(err)
	}
	e.drv.Restart(t)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(marker); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("freeze marker still there")
		}
	}
	// Unfreezing a filesystem that is not frozen fails: that failure is the proof.
	if out, err := exec.Command("fsfreeze", "-u", staging).CombinedOutput(); err == nil {
		t.Fatalf("the filesystem was still frozen after the restart (%s)", out)
	}
}
