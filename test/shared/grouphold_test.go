package shared

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestGroupHoldRealXFS: a node plugin (the real binary over the real kernel) takes
// its part of a group snapshot across nodes (docs/design/central-controller.md §7.1)
// of an xfs volume of a local pool written without pause: while its hold lasts the
// writer is held; the copy under the hold is a clean filesystem; the writer writes
// again once the copy is done; a hold nobody copies under ends by itself at its
// bound, and a copy then is ABORTED.
func TestGroupHoldRealXFS(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.xfs", "xfs_repair", "blkid")
	ctx := context.Background()
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	poolDir := filepath.Join(root, "pool")
	if err := os.Mkdir(poolDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(csiproc.Binary(t), "pool", "init", "--path", poolDir, "--name", "local", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("poolcsi pool init: %v\n%s", err, out)
	}
	d := csiproc.Start(t, csiproc.Options{NodeID: "node-1", SidecarDeadlines: true, Pools: []string{"local=" + poolDir}})
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "xfs")
	id := createVolume(t, d, "member", 300*mib, map[string]string{"pool": "local", "layout": "image"}, vc).GetVolumeId()
	target := stagePublish(t, d, filepath.Join(root, "n1"), id, vc)
	w := startFsyncWriter(t, filepath.Join(target, "log"))
	w.waitWrites(t, 20)

	gid := pool.GroupSnapshotID{SnapshotID: pool.NewSnapshotID("local", "db")}
	remote := "local." + pool.KeyForName("on-another-node")
	invoke := func(method string, req any, resp proto.Message) error {
		s, err := nodecall.ToStruct(req)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return d.Conn.Invoke(ctx, nodecall.GroupHoldFullMethod(method), s, resp)
	}
	hold := func(bound time.Duration) nodecall.GroupHeld {
		t.Helper()
		var out structpb.Struct
		var held nodecall.GroupHeld
		// A volume is not frozen again for as long as its last hold lasted (its budget).
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			err := invoke(nodecall.MethodFreezeGroupHold, nodecall.FreezeGroupHold{Group: gid.String(), Name: "db", Members: []string{id}, BoundMillis: bound.Milliseconds()}, &out)
			if err == nil {
				break
			}
			if status.Code(err) != codes.Aborted || time.Now().After(deadline) {
				t.Fatalf("hold: %v", err)
			}
		}
		if err := nodecall.FromStruct(&out, &held); err != nil {
			t.Fatal(err)
		}
		return held
	}
	// heldWriter tells whether the writer made at most one write (the one held) over
	// a quarter of a second.
	heldWriter := func() bool {
		n := w.count()
		time.Sleep(250 * time.Millisecond)
		return w.count() <= n+1
	}
	copyHeld := func(nonce string) (*csi.CreateVolumeGroupSnapshotResponse, error) {
		var part csi.CreateVolumeGroupSnapshotResponse
		err := invoke(nodecall.MethodSnapshotHeld, nodecall.SnapshotHeld{Group: gid.String(), Name: "db", Members: []string{id}, All: []string{id, remote}, Nonce: nonce}, &part)
		return &part, err
	}

	held := hold(30 * time.Second)
	if !heldWriter() {
		t.Fatal("the writer went on writing during the hold: the filesystem is not frozen")
	}
	part, err := copyHeld(held.Nonce)
	if err != nil {
		t.Fatal(err)
	}
	w.waitWrites(t, w.count()+5) // thawed after the copy
	snaps := part.GetGroupSnapshot().GetSnapshots()
	if len(snaps) != 1 || snaps[0].GetSnapshotId() != pool.GroupMemberID(gid, id).String() {
		t.Fatalf("part %v", part)
	}
	key := strings.SplitN(snaps[0].GetSnapshotId(), "@", 2)[1]
	checkClean(t, "xfs", filepath.Join(poolDir, "snapshots", key, "image"))
	members := []string{pool.GroupMemberID(gid, id).String(), pool.GroupMemberID(gid, remote).String()}
	if _, err := csi.NewGroupControllerClient(d.Conn).DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: gid.String(), SnapshotIds: members}); err != nil {
		t.Fatal(err)
	}

	// A hold nobody copies under ends at its bound.
	held = hold(500 * time.Millisecond)
	for deadline := time.Now().Add(10 * time.Second); heldWriter(); {
		if time.Now().After(deadline) {
			t.Fatal("the hold did not end at its bound")
		}
	}
	if _, err := copyHeld(held.Nonce); status.Code(err) != codes.Aborted {
		t.Fatalf("copy after the bound: %v, want ABORTED", err)
	}
	l, err := d.Controller().ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil || len(l.GetEntries()) != 0 {
		t.Errorf("snapshots after a copy refused: %v %v", l, err)
	}
	w.stop()
}
