package driver

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
)

func holdStruct(t *testing.T, v any) *structpb.Struct {
	t.Helper()
	s, err := nodecall.ToStruct(v)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// groupHoldFixture is the group fixture seen as one node of a group across nodes,
// whose other member (on another node) is remote.
type groupHoldFixture struct {
	*groupFixture
	gid    string
	remote string
	all    []string
}

func newGroupHoldFixture(t *testing.T) *groupHoldFixture {
	f := &groupHoldFixture{groupFixture: newGroupFixture(t)}
	f.gid = f.pool.Groups().NewID("db").String()
	f.remote = "local." + pool.KeyForName("on-node-b")
	f.all = append([]string{f.remote}, f.ids...)
	return f
}

func (f *groupHoldFixture) hold(t *testing.T, bound time.Duration) (nodecall.GroupHeld, error) {
	t.Helper()
	resp, err := f.FreezeGroupHold(context.Background(), holdStruct(t, nodecall.FreezeGroupHold{Group: f.gid, Name: "db", Members: f.ids, BoundMillis: bound.Milliseconds()}))
	var out nodecall.GroupHeld
	if err == nil {
		if err := nodecall.FromStruct(resp, &out); err != nil {
			t.Fatal(err)
		}
	}
	return out, err
}

func (f *groupHoldFixture) snapshotHeld(t *testing.T, nonce string) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	t.Helper()
	return f.SnapshotHeld(context.Background(), holdStruct(t, nodecall.SnapshotHeld{Group: f.gid, Name: "db", Members: f.ids, All: f.all, Nonce: nonce}))
}

func (f *groupHoldFixture) frozen() int {
	n := 0
	for _, st := range f.staging {
		if f.host.Frozen(st) {
			n++
		}
	}
	return n
}

// The two phases on one node: the hold freezes every staged member and keeps their
// locks until the copy; the copy under it records this node's part under the group's
// ID, checked against the whole group's members; a retry answers the part again;
// the delete of the whole group removes the part.
func TestGroupHoldAcrossNodes(t *testing.T) {
	f := newGroupHoldFixture(t)
	ctx := context.Background()
	h, err := f.hold(t, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if h.Nonce == "" || h.HoldMillis <= 0 || h.HoldMillis > freeze.DefaultTiming.MaxHold.Milliseconds() {
		t.Errorf("hold answered %+v", h)
	}
	if n := f.frozen(); n != 2 {
		t.Errorf("%d members frozen, want 2", n)
	}
	if keys, _ := f.opts.State.Keys(freeze.RecordKind); len(keys) != 2 {
		t.Errorf("freeze records %v: a restart must find both", keys)
	}
	// Between the phases the members are held: a stage (or anything else) waits.
	err = f.stage(f.ids[0], mountCap(rwo, "ext4"))
	wantCode(t, err, codes.Aborted)
	// A retried hold answers the hold in force.
	if again, err := f.hold(t, 30*time.Second); err != nil || again.Nonce != h.Nonce {
		t.Errorf("retried hold: %+v %v, want nonce %s", again, err, h.Nonce)
	}
	// Another nonce's copy is refused, and copies nothing.
	_, err = f.snapshotHeld(t, "not-the-nonce")
	wantCode(t, err, codes.Aborted)
	if s, _ := f.pool.Snapshots().List(); len(s) != 0 {
		t.Fatalf("a refused copy left snapshots: %v", s)
	}

	resp, err := f.snapshotHeld(t, h.Nonce)
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetGroupSnapshot()
	if g.GetGroupSnapshotId() != f.gid || len(g.GetSnapshots()) != 2 || !g.GetReadyToUse() {
		t.Fatalf("part: %v", g)
	}
	for _, c := range f.copies {
		if !strings.HasSuffix(c, "with 2 frozen") {
			t.Errorf("copies %v: want each made with both members frozen", f.copies)
		}
	}
	f.assertThawed(t)
	if err := f.stage(f.ids[0], mountCap(rwo, "ext4")); err != nil {
		t.Errorf("stage after the copy: %v", err)
	}
	// The retry of the copy answers the part again, copying nothing; a retried
	// create's hold freezes nothing again.
	again, err := f.snapshotHeld(t, h.Nonce)
	if err != nil || len(again.GetGroupSnapshot().GetSnapshots()) != 2 || len(f.copies) != 2 {
		t.Errorf("retried copy: %v %v (copies %v)", again, err, f.copies)
	}
	rh, err := f.hold(t, 30*time.Second)
	if err != nil || f.frozen() != 0 || f.host.Faults.Calls("Freeze") != 2 {
		t.Errorf("hold of a recorded part: %+v %v, %d frozen, %d freezes", rh, err, f.frozen(), f.host.Faults.Calls("Freeze"))
	}
	if again, err := f.snapshotHeld(t, rh.Nonce); err != nil || len(again.GetGroupSnapshot().GetSnapshots()) != 2 || len(f.copies) != 2 {
		t.Errorf("retried create's copy: %v %v (copies %v)", again, err, f.copies)
	}
	if _, err := f.ThawGroup(ctx, holdStruct(t, nodecall.ThawGroup{Group: f.gid, Nonce: h.Nonce})); err != nil {
		t.Errorf("thaw of a hold gone: %v", err)
	}

	// Get and Delete name every member of the group, this node's and the others'.
	var ids []string
	for _, v := range f.all {
		gid, _ := pool.ParseGroupSnapshotID(f.gid)
		ids = append(ids, pool.GroupMemberID(gid, v).String())
	}
	got, err := f.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: f.gid, SnapshotIds: ids})
	if err != nil || len(got.GetGroupSnapshot().GetSnapshots()) != 2 {
		t.Errorf("get of the part: %v %v", got, err)
	}
	_, err = f.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: f.gid, SnapshotIds: ids[1:]})
	wantCode(t, err, codes.InvalidArgument)
	for range 2 {
		if _, err := f.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: f.gid, SnapshotIds: ids}); err != nil {
			t.Fatal(err)
		}
	}
	f.assertNothingLeft(t)
}

// A hold ends by itself at its bound: thawed, unlocked, and a copy then is ABORTED
// and records nothing.
func TestGroupHoldEndsAtItsBound(t *testing.T) {
	f := newGroupHoldFixture(t)
	h, err := f.hold(t, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the hold to end at its bound", func() bool { return f.frozen() == 0 })
	waitFor(t, "the members' locks to go", func() bool { return f.stage(f.ids[0], mountCap(rwo, "ext4")) == nil })
	_, err = f.snapshotHeld(t, h.Nonce)
	wantCode(t, err, codes.Aborted)
	f.assertNothingLeft(t)
}

// A copy that outlasts the hold is discarded: ABORTED, and what it copied removed.
func TestGroupHoldCopyOutlastsTheHold(t *testing.T) {
	f := newGroupHoldFixture(t)
	fill := f.fill
	f.fill = func(ctx context.Context, p *pool.Pool, s *pool.Snapshot, v *pool.Volume) error {
		time.Sleep(200 * time.Millisecond)
		return fill(ctx, p, s, v)
	}
	h, err := f.hold(t, 150*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.snapshotHeld(t, h.Nonce)
	wantCode(t, err, codes.Aborted)
	f.assertNothingLeft(t)
}

// A restart forgets the hold and thaws what it froze (its records); the copy of the
// old hold is then ABORTED.
func TestGroupHoldRestart(t *testing.T) {
	f := newGroupHoldFixture(t)
	h, err := f.hold(t, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	old := f.freezes
	t.Cleanup(func() { old.ThawGroup(context.Background(), f.gid, "") })
	// The new process: no in-process locks, no hold in memory, the same records.
	f.locks = newVolumeLocks()
	f.freezes = newFreezes(f.core)
	f.freezes.ThawAfterCrash(context.Background())
	waitFor(t, "the recovery is done", f.freezes.Recovered)
	if n := f.frozen(); n != 0 {
		t.Errorf("%d members still frozen after the restart", n)
	}
	_, err = f.snapshotHeld(t, h.Nonce)
	wantCode(t, err, codes.Aborted)
	if s, _ := f.pool.Snapshots().List(); len(s) != 0 {
		t.Errorf("snapshots after a copy without its hold: %v", s)
	}
}

// Hostile or wrong requests are refused before anything is frozen.
func TestGroupHoldRefusals(t *testing.T) {
	f := newGroupHoldFixture(t)
	ctx := context.Background()
	other := f.pool.Groups().NewID("other").String()
	for _, tc := range []struct {
		name string
		req  any
	}{
		{"group of another name", nodecall.FreezeGroupHold{Group: other, Name: "db", Members: f.ids, BoundMillis: 1000}},
		{"no bound", nodecall.FreezeGroupHold{Group: f.gid, Name: "db", Members: f.ids}},
		{"bound too long", nodecall.FreezeGroupHold{Group: f.gid, Name: "db", Members: f.ids, BoundMillis: time.Hour.Milliseconds()}},
		{"a path member", nodecall.FreezeGroupHold{Group: f.gid, Name: "db", Members: []string{"../x"}, BoundMillis: 1000}},
		{"a member twice", nodecall.FreezeGroupHold{Group: f.gid, Name: "db", Members: []string{f.ids[0], f.ids[0]}, BoundMillis: 1000}},
		{"two pools", nodecall.FreezeGroupHold{Group: f.gid, Name: "db", Members: []string{f.ids[0], f.other}, BoundMillis: 1000}},
		{"a hostile name", nodecall.FreezeGroupHold{Group: f.gid, Name: "../db", Members: f.ids, BoundMillis: 1000}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := f.FreezeGroupHold(ctx, holdStruct(t, tc.req))
			wantCode(t, err, codes.InvalidArgument)
			if n := f.frozen(); n != 0 {
				t.Errorf("%d frozen", n)
			}
		})
	}
	bad := &structpb.Struct{Fields: map[string]*structpb.Value{"boundMillis": structpb.NewStringValue("soon")}}
	_, err := f.FreezeGroupHold(ctx, bad)
	wantCode(t, err, codes.InvalidArgument)
	h, err := f.hold(t, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for _, all := range [][]string{f.ids[:1], {f.ids[0], f.ids[1], "../x"}, {f.ids[0], f.ids[1], "other." + pool.KeyForName("x")}} {
		_, err := f.SnapshotHeld(ctx, holdStruct(t, nodecall.SnapshotHeld{Group: f.gid, Name: "db", Members: f.ids, All: all, Nonce: h.Nonce}))
		wantCode(t, err, codes.InvalidArgument)
	}
	_, err = f.ThawGroup(ctx, holdStruct(t, nodecall.ThawGroup{Group: "../x"}))
	wantCode(t, err, codes.InvalidArgument)
	if _, err := f.ThawGroup(ctx, holdStruct(t, nodecall.ThawGroup{Group: f.gid})); err != nil {
		t.Fatal(err)
	}
	f.assertNothingLeft(t)
}
