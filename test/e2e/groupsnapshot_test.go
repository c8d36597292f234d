package e2e

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestGroupSnapshotRestoresOneInstant is a database's data (ext4) and WAL
// (xfs) volumes, staged and mounted on real loop devices: written, snapshotted
// together, written again, and each member restored into a new volume, staged
// and mounted: each holds exactly what it held at the group's instant. pool
// list and check know the group's record, and its delete removes it all.
func TestGroupSnapshotRestoresOneInstant(t *testing.T) {
	e := newEnv(t, "mkfs.ext4", "mkfs.xfs")
	const n = 8 * mib
	type member struct {
		fsType, id, before, after string
		vc                        *csi.VolumeCapability
	}
	members := []*member{{fsType: "ext4"}, {fsType: "xfs"}}
	file := func(id string) string { return filepath.Join(e.target(id), "data") }
	byID := map[string]*member{}
	var ids []string
	for _, m := range members {
		m.vc = csiproc.MountCap(m.fsType, csiproc.RWO)
		m.id = e.create("pvc-"+m.fsType, m.vc, 320*mib)
		e.stage(m.id, m.vc)
		e.publish(m.id, m.vc, false)
		m.before = writeRandom(t, file(m.id), n)
		byID[m.id] = m
		ids = append(ids, m.id)
	}

	gc := csi.NewGroupControllerClient(e.drv.Conn)
	resp, err := gc.CreateVolumeGroupSnapshot(ctx(t), &csi.CreateVolumeGroupSnapshotRequest{Name: "db-backup", SourceVolumeIds: ids})
	if err != nil {
		t.Fatalf("CreateVolumeGroupSnapshot: %v", err)
	}
	g := resp.GetGroupSnapshot()
	var snapIDs []string
	for _, s := range g.GetSnapshots() {
		snapIDs = append(snapIDs, s.GetSnapshotId())
	}
	deleted := false
	t.Cleanup(func() {
		if deleted {
			return
		}
		if _, err := gc.DeleteVolumeGroupSnapshot(context.Background(), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: g.GetGroupSnapshotId(), SnapshotIds: snapIDs}); err != nil {
			t.Errorf("DeleteVolumeGroupSnapshot: %v", err)
		}
	})
	if !g.GetReadyToUse() || len(snapIDs) != 2 {
		t.Fatalf("group snapshot %+v", g)
	}
	if got := strings.Count(e.drv.Log(), "Froze filesystem for a snapshot"); got != 2 {
		t.Errorf("%d filesystems frozen for the group, want 2", got)
	}
	for _, m := range members {
		m.after = writeRandom(t, file(m.id), n)
		if m.after == m.before {
			t.Fatal("random data repeated")
		}
	}
	_, err = e.drv.Controller().DeleteSnapshot(ctx(t), &csi.DeleteSnapshotRequest{SnapshotId: snapIDs[0]})
	wantCode(t, "DeleteSnapshot of a member", err, codes.InvalidArgument)

	poolcsi := func(args ...string) (string, int) {
		out, err := exec.Command(csiproc.Binary(t), append([]string{"pool"}, args...)...).CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return string(out), ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), 0
	}
	if out, code := poolcsi("list", "--path", e.pool); code != 0 || !strings.Contains(out, g.GetGroupSnapshotId()) || !strings.Contains(out, "db-backup") {
		t.Errorf("pool list exited %d, without the group:\n%s", code, out)
	}
	if out, code := poolcsi("check", "--path", e.pool); code != 0 {
		t.Errorf("pool check of a pool with a group snapshot exited %d:\n%s", code, out)
	}

	for _, s := range g.GetSnapshots() {
		m := byID[s.GetSourceVolumeId()]
		if m == nil || s.GetGroupSnapshotId() != g.GetGroupSnapshotId() {
			t.Fatalf("member %+v", s)
		}
		restored, err := e.tryCreateFrom("restored-"+m.fsType, m.vc, s.GetSizeBytes(), snapshotSource(s.GetSnapshotId()))
		if err != nil {
			t.Fatalf("restore %s: %v", s.GetSnapshotId(), err)
		}
		id := restored.GetVolumeId()
		e.stage(id, m.vc)
		e.publish(id, m.vc, false)
		if got := checksum(t, file(id), -1); got != m.before {
			t.Errorf("%s restored holds %s, the group was cut of %s (after: %s)", m.fsType, got, m.before, m.after)
		}
		if got := checksum(t, file(m.id), -1); got != m.after {
			t.Errorf("%s source holds %s, want %s", m.fsType, got, m.after)
		}
	}

	for range 2 {
		if _, err := gc.DeleteVolumeGroupSnapshot(ctx(t), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: g.GetGroupSnapshotId(), SnapshotIds: snapIDs}); err != nil {
			t.Fatalf("DeleteVolumeGroupSnapshot: %v", err)
		}
	}
	deleted = true
	list, err := e.drv.Controller().ListSnapshots(ctx(t), &csi.ListSnapshotsRequest{})
	if err != nil || len(list.GetEntries()) != 0 {
		t.Errorf("snapshots after the group's delete: %v, %v", list, err)
	}
	_, err = gc.GetVolumeGroupSnapshot(ctx(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: g.GetGroupSnapshotId(), SnapshotIds: snapIDs})
	wantCode(t, "GetVolumeGroupSnapshot after delete", err, codes.NotFound)
}

// TestGroupSnapshotRefusesAWrittenBlockVolume is a database whose WAL is a
// block volume, staged and published read-write on a real loop device, next to
// an ext4 data volume: poolcsi can freeze no filesystem in the block volume,
// so the group would not be one instant, and it is refused FAILED_PRECONDITION
// with nothing frozen, reserved or written. What the refusal says to do works:
// the block volume snapshots on its own, and once unstaged the group is cut.
func TestGroupSnapshotRefusesAWrittenBlockVolume(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	data := csiproc.MountCap("ext4", csiproc.RWO)
	dataID := e.create("pvc-data", data, 64*mib)
	e.stage(dataID, data)
	e.publish(dataID, data, false)
	writeRandom(t, filepath.Join(e.target(dataID), "data"), mib)
	wal := csiproc.BlockCap(csiproc.RWO)
	walID := e.create("pvc-wal", wal, 64*mib)
	e.stage(walID, wal)
	e.publish(walID, wal, false)
	writeRandom(t, e.target(walID), mib)

	gc := csi.NewGroupControllerClient(e.drv.Conn)
	req := &csi.CreateVolumeGroupSnapshotRequest{Name: "db-backup", SourceVolumeIds: []string{dataID, walID}}
	_, err := gc.CreateVolumeGroupSnapshot(ctx(t), req)
	wantCode(t, "CreateVolumeGroupSnapshot with a written block volume", err, codes.FailedPrecondition)
	for _, s := range []string{"volume " + walID, "block volume", "read-write on node node-1", "unstage", "CreateSnapshot"} {
		if err != nil && !strings.Contains(err.Error(), s) {
			t.Errorf("refusal %q does not say %q", err, s)
		}
	}
	if got := strings.Count(e.drv.Log(), "Froze filesystem for a snapshot"); got != 0 {
		t.Errorf("a refused group froze %d filesystems", got)
	}
	list, err := e.drv.Controller().ListSnapshots(ctx(t), &csi.ListSnapshotsRequest{})
	if err != nil || len(list.GetEntries()) != 0 {
		t.Errorf("snapshots after a refused group: %v, %v", list, err)
	}
	if groups, err := os.ReadDir(filepath.Join(e.pool, "groupsnapshots")); err == nil && len(groups) != 0 || err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("group records after a refused group: %v, %v", groups, err)
	}

	// On its own the block volume snapshots, as before.
	e.snapshot("wal-alone", walID)

	// Its writer gone, the group is cut.
	e.unpublish(walID)
	e.unstage(walID)
	resp, err := gc.CreateVolumeGroupSnapshot(ctx(t), req)
	if err != nil {
		t.Fatalf("CreateVolumeGroupSnapshot with the block volume unstaged: %v", err)
	}
	g := resp.GetGroupSnapshot()
	var snapIDs []string
	for _, s := range g.GetSnapshots() {
		snapIDs = append(snapIDs, s.GetSnapshotId())
	}
	if _, err := gc.DeleteVolumeGroupSnapshot(ctx(t), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: g.GetGroupSnapshotId(), SnapshotIds: snapIDs}); err != nil {
		t.Errorf("DeleteVolumeGroupSnapshot: %v", err)
	}
	if !g.GetReadyToUse() || len(snapIDs) != 2 {
		t.Errorf("group snapshot %+v", g)
	}
}
