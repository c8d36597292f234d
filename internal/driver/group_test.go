package driver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// groupFixture is a driver with two staged image volumes (ext4 and xfs) in
// pool local, one in pool other, and a record of each member copy: which of
// the local volumes' filesystems were frozen at its moment.
type groupFixture struct {
	*testDriver
	ids      []string // local pool, staged
	other    string   // other pool
	staging  []string
	copies   []string
	failCopy int // the nth copy (1-based) fails, 0 for none
}

func newGroupFixture(t *testing.T) *groupFixture {
	t.Helper()
	td := newTestDriver(t, testOpts{extraPool: true})
	f := &groupFixture{testDriver: td}
	for i, fs := range []string{"ext4", "xfs"} {
		vc := mountCap(rwo, fs)
		id := td.create(t, fmt.Sprintf("v%d", i), vc, map[string]string{ParamPool: "local"})
		if err := td.stage(id, vc); err != nil {
			t.Fatal(err)
		}
		f.ids = append(f.ids, id)
		f.staging = append(f.staging, filepath.Join(td.root, "staging", id))
	}
	f.other = td.create(t, "o", mountCap(rwo, "ext4"), map[string]string{ParamPool: "other"})
	fill := td.fill
	td.fill = func(ctx context.Context, p *pool.Pool, s *pool.Snapshot, v *pool.Volume) error {
		frozen := 0
		for _, st := range f.staging {
			if td.host.Frozen(st) {
				frozen++
			}
		}
		f.copies = append(f.copies, fmt.Sprintf("copy %s with %d frozen", v.ID, frozen))
		if len(f.copies) == f.failCopy {
			return errInjected
		}
		return fill(ctx, p, s, v)
	}
	return f
}

// writeImage puts marker into a volume's image, where no filesystem of the
// fake kernel looks.
func (f *groupFixture) writeImage(t *testing.T, id, marker string) {
	t.Helper()
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	fh, err := os.OpenFile(f.pool.ImagePath(vid), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	if _, err := fh.WriteAt([]byte(marker), 32<<20); err != nil {
		t.Fatal(err)
	}
}

func (f *groupFixture) readImage(t *testing.T, id string, n int) string {
	t.Helper()
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	fh, err := os.Open(f.pool.ImagePath(vid))
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	b := make([]byte, n)
	if _, err := fh.ReadAt(b, 32<<20); err != nil {
		t.Fatal(err)
	}
	return string(bytes.TrimRight(b, "\x00"))
}

// assertNothingLeft checks that a refused or rolled back create left no
// snapshot, no group record, no freeze record and nothing frozen.
func (f *groupFixture) assertNothingLeft(t *testing.T) {
	t.Helper()
	if s, err := f.pool.Snapshots().List(); err != nil || len(s) != 0 {
		t.Errorf("snapshots left: %v %v", s, err)
	}
	if g, err := f.pool.Groups().List(); err != nil || len(g) != 0 {
		t.Errorf("group snapshots left: %v %v", g, err)
	}
	if fr, _ := f.pool.Freezes().Records(); len(fr) != 0 {
		t.Errorf("freeze records left: %v", fr)
	}
	for _, st := range f.staging {
		if f.host.Frozen(st) {
			t.Errorf("%s left frozen", st)
		}
	}
}

func TestCreateVolumeGroupSnapshotRefusals(t *testing.T) {
	missing := "local." + pool.KeyForName("never-created")
	for _, tc := range []struct {
		name     string
		sources  func(f *groupFixture) []string
		params   map[string]string
		failCopy int
		want     codes.Code
	}{
		{name: "mixed pools", sources: func(f *groupFixture) []string { return []string{f.ids[0], f.other} }, want: codes.InvalidArgument},
		{name: "unknown volume", sources: func(f *groupFixture) []string { return []string{f.ids[0], missing} }, want: codes.NotFound},
		{name: "unknown pool", sources: func(*groupFixture) []string { return []string{"nopool." + pool.KeyForName("x")} }, want: codes.NotFound},
		{name: "volume named twice", sources: func(f *groupFixture) []string { return []string{f.ids[0], f.ids[1], f.ids[0]} }, want: codes.InvalidArgument},
		{name: "path in an ID", sources: func(f *groupFixture) []string { return []string{f.ids[0], "local/../../etc"} }, want: codes.InvalidArgument},
		{name: "no volumes", sources: func(*groupFixture) []string { return nil }, want: codes.InvalidArgument},
		{name: "unknown parameter", sources: func(f *groupFixture) []string { return f.ids }, params: map[string]string{"consistency": "app"}, want: codes.InvalidArgument},
		{name: "a deletionPolicy that is none", sources: func(f *groupFixture) []string { return f.ids }, params: map[string]string{"deletionPolicy": "Keep"}, want: codes.InvalidArgument},
		{name: "first member copy fails", sources: func(f *groupFixture) []string { return f.ids }, failCopy: 1, want: codes.Internal},
		{name: "second member copy fails", sources: func(f *groupFixture) []string { return f.ids }, failCopy: 2, want: codes.Internal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newGroupFixture(t)
			f.failCopy = tc.failCopy
			_, err := f.CreateVolumeGroupSnapshot(context.Background(), &csi.CreateVolumeGroupSnapshotRequest{
				Name: "g", SourceVolumeIds: tc.sources(f), Parameters: tc.params,
			})
			wantCode(t, err, tc.want)
			f.assertNothingLeft(t)
		})
	}
}

func TestVolumeGroupSnapshotLifecycle(t *testing.T) {
	f := newGroupFixture(t)
	ctx := context.Background()
	f.writeImage(t, f.ids[0], "data-before")
	f.writeImage(t, f.ids[1], "wal-before")
	// The Kubernetes e2e suite's class puts deletionPolicy among the parameters.
	req := &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: []string{f.ids[1], f.ids[0]},
		Parameters: map[string]string{"deletionPolicy": "Delete", "csi.storage.k8s.io/volumegroupsnapshot/name": "db"}}
	resp, err := f.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetGroupSnapshot()
	if !g.GetReadyToUse() || len(g.GetSnapshots()) != 2 {
		t.Fatalf("group snapshot: %v", g)
	}
	// Both filesystems were frozen before the first copy and thawed after.
	for _, c := range f.copies {
		if !bytes.HasSuffix([]byte(c), []byte("with 2 frozen")) {
			t.Errorf("copies: %v; want every copy with both filesystems frozen", f.copies)
		}
	}
	f.assertThawed(t)
	f.writeImage(t, f.ids[0], "data-after!")
	f.writeImage(t, f.ids[1], "wal-after!")

	var memberIDs []string
	for _, s := range g.GetSnapshots() {
		memberIDs = append(memberIDs, s.GetSnapshotId())
		if s.GetGroupSnapshotId() != g.GetGroupSnapshotId() || !s.GetReadyToUse() {
			t.Errorf("member %v: want ready, in group %s", s, g.GetGroupSnapshotId())
		}
		got, err := f.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: s.GetSnapshotId()})
		if err != nil || got.GetSnapshot().GetGroupSnapshotId() != g.GetGroupSnapshotId() {
			t.Errorf("GetSnapshot of a member: %v, %v", got, err)
		}
	}
	list, err := f.ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil || len(list.GetEntries()) != 2 || list.GetEntries()[0].GetSnapshot().GetGroupSnapshotId() == "" {
		t.Errorf("ListSnapshots: %v, %v", list, err)
	}

	// Idempotent by name and volumes, in any order; other volumes are refused.
	again, err := f.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: f.ids})
	if err != nil || again.GetGroupSnapshot().GetGroupSnapshotId() != g.GetGroupSnapshotId() || len(f.copies) != 2 {
		t.Errorf("retry: %v, %v (copies %v)", again, err, f.copies)
	}
	_, err = f.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: f.ids[:1]})
	wantCode(t, err, codes.AlreadyExists)
	_, err = f.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "db", SourceVolumeId: f.ids[0]})
	if err != nil {
		t.Errorf("a snapshot may have a group's name: %v", err)
	}
	if _, err := f.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "local@" + pool.KeyForName("db")}); err != nil {
		t.Fatal(err)
	}

	// A member is deleted only with its group.
	_, err = f.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: memberIDs[0]})
	wantCode(t, err, codes.InvalidArgument)

	// Each member restores to exactly what its volume held at the group's instant.
	for i, want := range map[string]string{f.ids[0]: "data-before", f.ids[1]: "wal-before"} {
		var sid string
		var size int64
		for _, s := range g.GetSnapshots() {
			if s.GetSourceVolumeId() == i {
				sid, size = s.GetSnapshotId(), s.GetSizeBytes()
			}
		}
		r, err := f.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: "restore-" + sid, Parameters: map[string]string{ParamPool: "local"}, VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "")},
			CapacityRange:       &csi.CapacityRange{RequiredBytes: size},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: sid}}},
		})
		if err != nil {
			t.Fatalf("restore %s: %v", sid, err)
		}
		if got := f.readImage(t, r.GetVolume().GetVolumeId(), 16); got != want {
			t.Errorf("restored %s holds %q, want %q", sid, got, want)
		}
	}

	get := func(ids []string) error {
		_, err := f.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: g.GetGroupSnapshotId(), SnapshotIds: ids})
		return err
	}
	del := func(ids []string) error {
		_, err := f.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: g.GetGroupSnapshotId(), SnapshotIds: ids})
		return err
	}
	wrong := []string{memberIDs[0], "local@" + pool.KeyForName("stranger")}
	for _, tc := range []struct {
		name string
		ids  []string
		want codes.Code
	}{
		{"all members", memberIDs, codes.OK},
		{"reversed", []string{memberIDs[1], memberIDs[0]}, codes.OK},
		{"one missing", memberIDs[:1], codes.InvalidArgument},
		{"a stranger", wrong, codes.InvalidArgument},
		{"none", nil, codes.InvalidArgument},
		{"a path", []string{memberIDs[0], "../x"}, codes.InvalidArgument},
	} {
		t.Run("get "+tc.name, func(t *testing.T) { wantCode(t, get(tc.ids), tc.want) })
		if tc.want != codes.OK {
			t.Run("delete "+tc.name, func(t *testing.T) { wantCode(t, del(tc.ids), tc.want) })
		}
	}
	if s, _ := f.pool.Snapshots().List(); len(s) != 2 {
		t.Fatalf("a refused delete removed members: %v", s)
	}
	for range 2 {
		if err := del(memberIDs); err != nil {
			t.Fatal(err)
		}
	}
	wantCode(t, get(memberIDs), codes.NotFound)
	f.assertNothingLeft(t)
	for _, sid := range memberIDs {
		_, err := f.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: sid})
		wantCode(t, err, codes.NotFound)
	}
}

func (f *groupFixture) assertThawed(t *testing.T) {
	t.Helper()
	for _, st := range f.staging {
		if f.host.Frozen(st) {
			t.Errorf("%s left frozen", st)
		}
	}
	if fr, _ := f.pool.Freezes().Records(); len(fr) != 0 {
		t.Errorf("freeze records left: %v", fr)
	}
	if n, m := f.host.Faults.Calls("Freeze"), f.host.Faults.Calls("Thaw"); n != 2 || m != 2 {
		t.Errorf("freezes %d, thaws %d; want 2 each", n, m)
	}
}

// A record a crash left before its group was ready is rolled back and cut
// again: a member copied then is of another instant than the others.
func TestInterruptedGroupIsCutAgain(t *testing.T) {
	f := newGroupFixture(t)
	ctx := context.Background()
	vids := make([]pool.VolumeID, len(f.ids))
	for i, id := range f.ids {
		vids[i], _ = pool.ParseVolumeID(id)
	}
	g, err := f.pool.Groups().Reserve(ctx, "db", vids)
	if err != nil {
		t.Fatal(err)
	}
	gid := f.pool.Groups().NewID("db")
	v, err := f.pool.Load(vids[0])
	if err != nil {
		t.Fatal(err)
	}
	stale, err := f.pool.Groups().ReserveMember(ctx, gid, g, v, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.writeImage(t, f.ids[0], "now")
	resp, err := f.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: f.ids})
	if err != nil || !resp.GetGroupSnapshot().GetReadyToUse() || len(f.copies) != 2 {
		t.Fatalf("%v, %v, copies %v", resp, err, f.copies)
	}
	if s, err := f.pool.Snapshots().Load(pool.SnapshotID{Pool: "local", Key: stale.ID[len("local@"):]}); err != nil || !s.ReadyToUse {
		t.Errorf("member after the retry: %v, %v", s, err)
	}
	if !slices.Contains(f.copies, fmt.Sprintf("copy %s with 2 frozen", f.ids[0])) {
		t.Errorf("copies %v", f.copies)
	}
}

func TestGroupControllerIsAdvertised(t *testing.T) {
	for _, tc := range []struct {
		mode Mode
		want bool
	}{{ModeAll, true}, {ModeController, true}, {ModeNode, false}} {
		t.Run(string(tc.mode), func(t *testing.T) {
			td := newTestDriver(t, testOpts{modify: func(o *Options) { o.Mode = tc.mode }})
			caps, err := td.GetPluginCapabilities(context.Background(), &csi.GetPluginCapabilitiesRequest{})
			if err != nil {
				t.Fatal(err)
			}
			got := slices.ContainsFunc(caps.GetCapabilities(), func(c *csi.PluginCapability) bool {
				return c.GetService().GetType() == csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE
			})
			if got != tc.want {
				t.Errorf("GROUP_CONTROLLER_SERVICE advertised: %v, want %v", got, tc.want)
			}
		})
	}
}

// A member no freeze reaches (block, dir) that is staged read-write is written
// while the members are copied one after another: the group is refused before
// anything is reserved. Staged read-only, or not at all, it is no writer.
func TestGroupRefusesAWrittenMemberItCannotFreeze(t *testing.T) {
	const (
		rox = csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
		rwx = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
		mrx = csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	)
	block := func(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability { return blockCap(mode) }
	dir := func(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability { return mountCap(mode, "") }
	for _, tc := range []struct {
		name   string
		layout string // of the extra member
		create *csi.VolumeCapability
		stage  *csi.VolumeCapability // nil: not staged here
		others []pool.StageRecord    // stage records of other nodes
		want   codes.Code
		says   []string // in the refusal
	}{
		{name: "block staged read-write", layout: "image", create: block(rwo), stage: block(rwo), want: codes.FailedPrecondition,
			says: []string{"block volume", "no filesystem poolcsi can freeze", "read-write on node node-1", "unstage it", "CreateSnapshot"}},
		{name: "block staged read-write on another node", layout: "image", create: block(rwo), others: []pool.StageRecord{{Node: "node-2", Path: "/var/lib/kubelet/x"}}, want: codes.FailedPrecondition,
			says: []string{"block volume", "read-write on node node-2;"}},
		{name: "dir staged read-write", layout: "dir", create: dir(rwx), stage: dir(rwx), want: codes.FailedPrecondition,
			says: []string{"dir volume", "cannot be frozen", "read-write on node node-1", "scale its workload down", "CreateSnapshot"}},
		{name: "dir staged read-write on two nodes", layout: "dir", create: dir(rwx), stage: dir(rwx),
			others: []pool.StageRecord{{Node: "node-2", Path: "/var/lib/kubelet/x"}, {Node: "node-3", Path: "/var/lib/kubelet/y", ReadOnly: true}}, want: codes.FailedPrecondition,
			says: []string{"read-write on nodes node-1, node-2;"}},
		{name: "block staged read-only", layout: "image", create: block(rwo), stage: block(rox), want: codes.OK},
		{name: "dir staged read-only", layout: "dir", create: dir(rwx), stage: dir(mrx), others: []pool.StageRecord{{Node: "node-2", Path: "/var/lib/kubelet/x", ReadOnly: true}}, want: codes.OK},
		{name: "block not staged", layout: "image", create: block(rwo), want: codes.OK},
		{name: "dir not staged", layout: "dir", create: dir(rwx), want: codes.OK},
		{name: "filesystem staged read-write, frozen", layout: "image", create: mountCap(rwo, "ext4"), stage: mountCap(rwo, "ext4"), want: codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newGroupFixture(t)
			ctx := context.Background()
			id := f.create(t, "extra", tc.create, map[string]string{ParamPool: "local", ParamLayout: tc.layout})
			if tc.stage != nil {
				if err := f.stage(id, tc.stage); err != nil {
					t.Fatal(err)
				}
				if tc.layout == "image" && tc.stage.GetMount() != nil {
					f.staging = append(f.staging, filepath.Join(f.root, "staging", id))
				}
			}
			vid, _ := pool.ParseVolumeID(id)
			if len(tc.others) > 0 {
				err := f.pool.Update(ctx, vid, func(v *pool.Volume) (bool, error) {
					v.Staged = append(v.Staged, tc.others...)
					return true, nil
				})
				if err != nil {
					t.Fatal(err)
				}
			}
			before, err := f.pool.Load(vid)
			if err != nil {
				t.Fatal(err)
			}
			sources := append(slices.Clone(f.ids), id)
			resp, err := f.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: sources})
			wantCode(t, err, tc.want)
			if tc.want != codes.OK {
				t.Logf("refusal: %v", err)
				for _, s := range tc.says {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("refusal %q does not say %q", err, s)
					}
				}
				if !strings.Contains(err.Error(), "volume "+id+" is") || strings.Contains(err.Error(), f.ids[0]) {
					t.Errorf("refusal %q should name volume %s and no other", err, id)
				}
				f.assertNothingLeft(t)
				if _, err := f.pool.Groups().Load(f.pool.Groups().NewID("db")); !errors.Is(err, pool.ErrNotFound) {
					t.Errorf("group record after a refusal: %v", err)
				}
				list, err := f.ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
				if err != nil || len(list.GetEntries()) != 0 {
					t.Errorf("ListSnapshots after a refusal: %v, %v", list, err)
				}
				if n := f.host.Faults.Calls("Freeze"); n != 0 || len(f.copies) != 0 {
					t.Errorf("a refused group froze %d filesystems and made copies %v", n, f.copies)
				}
				if after, err := f.pool.Load(vid); err != nil || !slices.Equal(after.Staged, before.Staged) {
					t.Errorf("stage records changed by a refusal: %v -> %v (%v)", before.Staged, after.Staged, err)
				}
				return
			}
			if g := resp.GetGroupSnapshot(); !g.GetReadyToUse() || len(g.GetSnapshots()) != 3 {
				t.Fatalf("group snapshot %v", g)
			}
			for _, c := range f.copies {
				if want := fmt.Sprintf("with %d frozen", len(f.staging)); !strings.HasSuffix(c, want) {
					t.Errorf("copies %v: want every one %s", f.copies, want)
				}
			}
		})
	}
}

// A group that finished answers its retry from its records, even when a
// member it could not freeze is written by then.
func TestFinishedGroupRetryIgnoresNewWriters(t *testing.T) {
	f := newGroupFixture(t)
	ctx := context.Background()
	id := f.create(t, "raw", blockCap(rwo), map[string]string{ParamPool: "local"})
	req := &csi.CreateVolumeGroupSnapshotRequest{Name: "db", SourceVolumeIds: append(slices.Clone(f.ids), id)}
	first, err := f.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.stage(id, blockCap(rwo)); err != nil {
		t.Fatal(err)
	}
	again, err := f.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil || again.GetGroupSnapshot().GetGroupSnapshotId() != first.GetGroupSnapshot().GetGroupSnapshotId() || len(f.copies) != 3 {
		t.Errorf("retry of a finished group: %v, %v (copies %v)", again, err, f.copies)
	}
	// Another group of the same volumes is cut now, with a writer: refused.
	req.Name = "db-2"
	_, err = f.CreateVolumeGroupSnapshot(ctx, req)
	wantCode(t, err, codes.FailedPrecondition)
}
