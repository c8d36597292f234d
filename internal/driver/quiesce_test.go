package driver

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// testFreeze is a short schedule for the fake kernel; MaxHold is only ever
// reached by moving a node's test clock.
var testFreeze = FreezeTiming{Poll: 2 * time.Millisecond, MaxHold: time.Minute, AckTimeout: 10 * time.Second}

// freezePair is node A with an ext4 image volume staged read-write on a
// shared pool, and node B, the controller that snapshots it. A's agent runs
// on A's test clock when agent is true.
func freezePair(t *testing.T, agent bool) (a, b *leaseNode, id, staging string) {
	t.Helper()
	_, a, b, _, id, staging = stagedOnA(t)
	for _, n := range []*leaseNode{a, b} {
		n.freezes.Timing = testFreeze
	}
	a.freezes.Now = a.clock.now
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	if agent {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); a.freezes.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-done })
	}
	return a, b, id, staging
}

func snapshot(b *leaseNode, id, name string) (*csi.CreateSnapshotResponse, error) {
	return b.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: id})
}

// waitFor polls cond for up to 10 s: the agent works on its own goroutine.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting until %s", what)
}

// inboxEmpty tells whether node's inbox holds neither request nor answer.
func inboxEmpty(t *testing.T, p *pool.Pool, node string) bool {
	t.Helper()
	reqs, acked, err := p.Freezes().Inbox(node)
	if err != nil {
		t.Fatal(err)
	}
	return len(reqs) == 0 && len(acked) == 0
}

// noFreezeRecord checks that no freeze record is left: neither in the pool
// (older versions wrote them there) nor in any node's own records.
func noFreezeRecord(t *testing.T, p *pool.Pool, nodes ...*leaseNode) {
	t.Helper()
	fs, err := p.Freezes().Records()
	if err != nil || len(fs) != 0 {
		t.Fatalf("freeze records left in the pool: %+v %v", fs, err)
	}
	for _, n := range nodes {
		if keys, err := n.opts.State.Keys(freeze.RecordKind); err != nil || len(keys) != 0 {
			t.Fatalf("freeze records left on %s: %v %v", n.opts.NodeID, keys, err)
		}
	}
}

// TestRemoteFreezeAroundCopy: the controller on node B snapshots a volume
// staged on node A; A freezes it before B copies, B's copy is made while it
// is frozen, and A thaws once B withdraws its request, leaving nothing in
// the pool.
func TestRemoteFreezeAroundCopy(t *testing.T) {
	a, b, id, staging := freezePair(t, true)
	p := b.pools.Pool("shared")
	image := p.Snapshots().ImagePath(p.Snapshots().NewID("snap"))
	var events []string
	quiesce := b.quiesceCopy
	b.quiesceCopy = func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (func() error, error) {
		thaw, err := quiesce(ctx, p, vid, v)
		if err != nil {
			return nil, err
		}
		_, statErr := os.Stat(image)
		events = append(events, stateOf(a.host.Frozen(staging), statErr == nil))
		return func() error {
			_, statErr := os.Stat(image)
			events = append(events, stateOf(a.host.Frozen(staging), statErr == nil))
			return thaw()
		}, nil
	}
	resp, err := snapshot(b, id, "snap")
	if err != nil {
		t.Fatal(err)
	}
	if !resp.GetSnapshot().GetReadyToUse() {
		t.Fatal("snapshot not ready")
	}
	if want := []string{"frozen, not copied", "frozen, copied"}; strings.Join(events, "; ") != strings.Join(want, "; ") {
		t.Fatalf("A's filesystem and B's copy: %v, want %v", events, want)
	}
	// The snapshot returns once A has let go: nothing frozen, nothing in the inbox.
	if a.host.Frozen(staging) || !inboxEmpty(t, p, "node-a") {
		t.Fatal("the snapshot returned while A still held the freeze")
	}
	noFreezeRecord(t, p, a)
	// The volume is A's again: an unstage is not refused as busy.
	if _, err := a.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("unstage after the thaw: %v", err)
	}
}

func stateOf(frozen, copied bool) string {
	s := map[bool]string{true: "frozen", false: "thawed"}[frozen]
	return s + map[bool]string{true: ", copied", false: ", not copied"}[copied]
}

// TestRemoteFreezeNodeSilent: a node that does not answer while its lease is
// live fails the snapshot UNAVAILABLE, naming it, with no request left and
// nothing copied; once its lease has expired by the controller's clock (it
// has fenced itself), the snapshot goes on without it.
func TestRemoteFreezeNodeSilent(t *testing.T) {
	a, b, id, staging := freezePair(t, false)
	b.freezes.Timing.AckTimeout = 20 * time.Millisecond
	p := b.pools.Pool("shared")
	_, err := snapshot(b, id, "snap")
	wantCode(t, err, codes.Unavailable)
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "node-a") {
		t.Fatalf("message does not name the node: %s", msg)
	}
	if !inboxEmpty(t, p, "node-a") {
		t.Fatal("the request was left in A's inbox")
	}
	if _, err := os.Stat(p.Snapshots().ImagePath(p.Snapshots().NewID("snap"))); !os.IsNotExist(err) {
		t.Fatalf("a copy was made: %v", err)
	}
	if a.host.Frozen(staging) {
		t.Fatal("A is frozen")
	}
	// Still renewing: still refused, however long B waits.
	b.clock.add(lease.Default.Duration + lease.Default.Margin)
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	_, err = snapshot(b, id, "snap")
	wantCode(t, err, codes.Unavailable)
	// A stops renewing: after the lease and its margin by B's clock, B goes on.
	b.clock.add(lease.Default.Duration + lease.Default.Margin)
	if _, err := snapshot(b, id, "snap"); err != nil {
		t.Fatalf("after A's lease expired: %v", err)
	}
	if !inboxEmpty(t, p, "node-a") {
		t.Fatal("the request was left in A's inbox")
	}
}

// TestRemoteFreezeEarlyThaw: a node that thaws before the copy ends (its
// maximum hold passed) fails the snapshot ABORTED, and its copy is removed;
// the retry succeeds.
func TestRemoteFreezeEarlyThaw(t *testing.T) {
	a, b, id, staging := freezePair(t, true)
	p := b.pools.Pool("shared")
	quiesce := b.quiesceCopy
	b.quiesceCopy = func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (func() error, error) {
		thaw, err := quiesce(ctx, p, vid, v)
		if err != nil {
			return nil, err
		}
		a.clock.add(testFreeze.MaxHold)
		waitFor(t, "A thaws at its maximum hold", func() bool { return !a.host.Frozen(staging) })
		return thaw, nil
	}
	_, err := snapshot(b, id, "snap")
	wantCode(t, err, codes.Aborted)
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "thawed") || !strings.Contains(msg, "node-a") {
		t.Fatalf("message: %s", msg)
	}
	if _, err := os.Stat(p.Snapshots().ImagePath(p.Snapshots().NewID("snap"))); !os.IsNotExist(err) {
		t.Fatalf("the copy was kept: %v", err)
	}
	waitFor(t, "A clears its inbox", func() bool { return inboxEmpty(t, p, "node-a") })
	noFreezeRecord(t, p, a)
	b.quiesceCopy = quiesce
	a.clock.add(testFreeze.MaxHold) // the cool-down after a whole hold
	if _, err := snapshot(b, id, "snap"); err != nil {
		t.Fatalf("retry: %v", err)
	}
}

// TestFreezeControllerDies: a request whose controller died mid-copy is
// thawed at the maximum hold by the node's clock, written down first, and
// never frozen again; a node plugin that restarts while frozen writes the
// thaw down before it thaws.
func TestFreezeControllerDies(t *testing.T) {
	ctx := context.Background()
	a, _, id, staging := freezePair(t, false)
	p := a.pools.Pool("shared")
	vid, _ := pool.ParseVolumeID(id)
	nonce := pool.NewFreezeNonce()
	if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: id, Node: "node-a", Path: staging, Nonce: nonce}); err != nil {
		t.Fatal(err)
	}
	ack := func() pool.FreezeAck {
		t.Helper()
		a, ok, err := p.Freezes().ReadAck("node-a", vid)
		if err != nil || !ok {
			t.Fatalf("answer: %+v %v %v", a, ok, err)
		}
		return a
	}
	a.freezes.Tick(ctx)
	if !a.host.Frozen(staging) || ack().State != pool.FreezeFrozen || ack().Nonce != nonce {
		t.Fatalf("not frozen: %v %+v", a.host.Frozen(staging), ack())
	}
	a.clock.add(testFreeze.MaxHold - time.Second)
	a.freezes.Tick(ctx)
	if !a.host.Frozen(staging) {
		t.Fatal("thawed before the maximum hold")
	}
	a.clock.add(time.Second)
	a.freezes.Tick(ctx)
	if a.host.Frozen(staging) || ack().State != pool.FreezeThawed {
		t.Fatalf("after the maximum hold: frozen %v, %+v", a.host.Frozen(staging), ack())
	}
	noFreezeRecord(t, p, a)
	a.freezes.Tick(ctx)
	if a.host.Frozen(staging) {
		t.Fatal("the same request froze it again")
	}

	// A new request (a retry) within the cool-down after that hold is
	// refused, as failed (the controller fails UNAVAILABLE and retries);
	// after it, frozen. Then the node plugin dies while frozen: the next
	// start writes the thaw down before it thaws.
	if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: id, Node: "node-a", Path: staging, Nonce: pool.NewFreezeNonce()}); err != nil {
		t.Fatal(err)
	}
	a.freezes.Tick(ctx)
	if a.host.Frozen(staging) || ack().State != pool.FreezeFailed || !strings.Contains(ack().Reason, "budget") {
		t.Fatalf("a retry right after a whole hold: frozen %v, %+v", a.host.Frozen(staging), ack())
	}
	a.clock.add(testFreeze.MaxHold)
	if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: id, Node: "node-a", Path: staging, Nonce: pool.NewFreezeNonce()}); err != nil {
		t.Fatal(err)
	}
	a.freezes.Tick(ctx)
	if !a.host.Frozen(staging) || ack().State != pool.FreezeFrozen {
		t.Fatal("the retry was not frozen")
	}
	// What a new process starts with: no holds, no in-process locks.
	a.locks = newVolumeLocks()
	a.freezes = newFreezes(a.core)
	a.freezes.Timing = testFreeze
	a.freezes.Now = a.clock.now
	a.freezes.ThawAfterCrash(ctx)
	waitFor(t, "the recovery is done", a.freezes.Recovered)
	if a.host.Frozen(staging) || ack().State != pool.FreezeThawed {
		t.Fatalf("after a restart: frozen %v, %+v", a.host.Frozen(staging), ack())
	}
	a.freezes.Tick(ctx)
	if a.host.Frozen(staging) {
		t.Fatal("the restarted plugin froze an answered request again")
	}
	// The controller's retry withdraws it: the answer goes too.
	if err := p.Freezes().RemoveRequest("node-a", vid); err != nil {
		t.Fatal(err)
	}
	a.freezes.Tick(ctx)
	if !inboxEmpty(t, p, "node-a") {
		t.Fatal("the answer to a withdrawn request stayed")
	}
}

// TestFreezeInboxHostile: whatever is planted in a node's inbox freezes
// nothing it should not, blocks nothing, reads nothing outside the pool, and
// is answered only when it is a well-formed request.
func TestFreezeInboxHostile(t *testing.T) {
	ctx := context.Background()
	req := func(volume, node, path string) []byte {
		raw, _ := json.Marshal(pool.FreezeRequest{Volume: volume, Node: node, Path: path, Nonce: pool.NewFreezeNonce()})
		return raw
	}
	otherKey := strings.Repeat("ab", 16)
	tests := []struct {
		name string
		// plant puts the entry into inbox; key is the volume key it is named after.
		plant func(t *testing.T, inbox, key, id, staging string) (string, error)
		// want is the answer expected for the volume the entry is named
		// after ("" = none).
		want pool.FreezeState
		// frozen: the volume's own filesystem is frozen (only ever that).
		frozen bool
	}{
		{name: "link to a file outside the pool", plant: func(t *testing.T, inbox, key, id, staging string) (string, error) {
			target := filepath.Join(t.TempDir(), "outside")
			if err := os.WriteFile(target, req(id, "node-a", staging), 0o600); err != nil {
				t.Fatal(err)
			}
			return key + ".request", os.Symlink(target, filepath.Join(inbox, key+".request"))
		}},
		{name: "FIFO", plant: func(t *testing.T, inbox, key, id, staging string) (string, error) {
			return key + ".request", unix.Mkfifo(filepath.Join(inbox, key+".request"), 0o600)
		}},
		{name: "100 MB request", plant: func(t *testing.T, inbox, key, id, staging string) (string, error) {
			f, err := os.Create(filepath.Join(inbox, key+".request"))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			return key + ".request", f.Truncate(100 << 20)
		}},
		{name: "not JSON", plant: writeEntry(func(key, id, staging string) (string, []byte) { return key + ".request", []byte("freeze /\n") })},
		{name: "name not a key", plant: writeEntry(func(key, id, staging string) (string, []byte) {
			return "..request", req(id, "node-a", staging)
		})},
		{name: "bad volume ID", plant: writeEntry(func(key, id, staging string) (string, []byte) {
			return key + ".request", req("shared/../../etc", "node-a", staging)
		})},
		{name: "names another volume than its file", plant: writeEntry(func(key, id, staging string) (string, []byte) {
			return otherKey + ".request", req(id, "node-a", staging)
		})},
		{name: "for another node", plant: writeEntry(func(key, id, staging string) (string, []byte) {
			return key + ".request", req(id, "node-b", staging)
		})},
		{name: "relative path", plant: writeEntry(func(key, id, staging string) (string, []byte) {
			return key + ".request", req(id, "node-a", "staging")
		})},
		{name: "a volume not staged here", want: pool.FreezeNotStaged, plant: writeEntry(func(key, id, staging string) (string, []byte) {
			return otherKey + ".request", req("shared."+otherKey, "node-a", staging)
		})},
		// The path a request names is never used: the node freezes its own
		// mount of the volume, and nothing at "/".
		{name: "the volume at another path", want: pool.FreezeFrozen, frozen: true, plant: writeEntry(func(key, id, staging string) (string, []byte) {
			return key + ".request", req(id, "node-a", "/")
		})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _, id, staging := freezePair(t, false)
			p := a.pools.Pool("shared")
			vid, _ := pool.ParseVolumeID(id)
			inbox := filepath.Join(p.Path(), "freeze", "node-a")
			if err := os.MkdirAll(inbox, 0o750); err != nil {
				t.Fatal(err)
			}
			name, err := tt.plant(t, inbox, vid.Key, id, staging)
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			go func() { defer close(done); a.freezes.Tick(ctx); a.freezes.Tick(ctx) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the agent blocked on the entry")
			}
			if a.host.Frozen(staging) != tt.frozen {
				t.Fatalf("frozen: %v, want %v", a.host.Frozen(staging), tt.frozen)
			}
			if !tt.frozen {
				noFreezeRecord(t, p, a)
			}
			key, _ := strings.CutSuffix(name, ".request")
			got, ok, err := p.Freezes().ReadAck("node-a", p.IDOf(key))
			switch {
			case tt.want == "" && (ok || err != nil) && key != "..":
				t.Fatalf("answered: %+v %v", got, err)
			case tt.want != "" && (!ok || got.State != tt.want):
				t.Fatalf("answer %+v %v, want %s", got, err, tt.want)
			}
			if _, err := os.Lstat(filepath.Join(inbox, name)); err != nil {
				t.Fatalf("the agent removed a request it does not own: %v", err)
			}
		})
	}
}

func writeEntry(f func(key, id, staging string) (string, []byte)) func(t *testing.T, inbox, key, id, staging string) (string, error) {
	return func(t *testing.T, inbox, key, id, staging string) (string, error) {
		name, raw := f(key, id, staging)
		return name, os.WriteFile(filepath.Join(inbox, name), raw, 0o600)
	}
}

// TestGroupSnapshotFreezesOtherNode: a group snapshot cut by the controller on
// node B freezes its member staged on node A through A's inbox before the
// copy, and fails UNAVAILABLE, leaving no group behind, while A is silent
// and still holds its lease.
func TestGroupSnapshotFreezesOtherNode(t *testing.T) {
	for _, agent := range []bool{true, false} {
		t.Run(map[bool]string{true: "A answers", false: "A is silent"}[agent], func(t *testing.T) {
			a, b, id, staging := freezePair(t, agent)
			b.freezes.Timing.AckTimeout = 200 * time.Millisecond
			var frozenAtCopy []bool
			fill := b.fill
			b.fill = func(ctx context.Context, p *pool.Pool, s *pool.Snapshot, v *pool.Volume) error {
				frozenAtCopy = append(frozenAtCopy, a.host.Frozen(staging))
				return fill(ctx, p, s, v)
			}
			resp, err := b.CreateVolumeGroupSnapshot(context.Background(), &csi.CreateVolumeGroupSnapshotRequest{Name: "group", SourceVolumeIds: []string{id}})
			p := b.pools.Pool("shared")
			if !agent {
				wantCode(t, err, codes.Unavailable)
				if len(frozenAtCopy) != 0 {
					t.Fatalf("copied %d members without A's freeze", len(frozenAtCopy))
				}
				if snaps, err := b.ListSnapshots(context.Background(), &csi.ListSnapshotsRequest{}); err != nil || len(snaps.GetEntries()) != 0 {
					t.Fatalf("snapshots left: %v %v", snaps.GetEntries(), err)
				}
				if !inboxEmpty(t, p, "node-a") {
					t.Fatal("the request was left in A's inbox")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !resp.GetGroupSnapshot().GetReadyToUse() || len(resp.GetGroupSnapshot().GetSnapshots()) != 1 {
				t.Fatalf("group %+v", resp.GetGroupSnapshot())
			}
			if len(frozenAtCopy) != 1 || !frozenAtCopy[0] {
				t.Fatalf("A's filesystem frozen at each copy: %v", frozenAtCopy)
			}
			waitFor(t, "A thaws and clears its inbox", func() bool { return !a.host.Frozen(staging) && inboxEmpty(t, p, "node-a") })
			noFreezeRecord(t, p, a)
		})
	}
}

// TestControllerOnItsOwnNodeAsksThroughTheInbox: a controller-only process
// on the node that has the volume staged does not see the node plugin's
// mounts (its pod has no kubelet directory; here, a fake kernel of its own),
// so it asks its own node through the inbox; before, it found no mount, froze
// nothing and skipped the inbox as "here".
func TestControllerOnItsOwnNodeAsksThroughTheInbox(t *testing.T) {
	a, b, id, staging := freezePair(t, true)
	b.opts.NodeID, b.opts.Mode = "node-a", ModeController
	b.freezes = newFreezes(b.core)
	b.freezes.Timing = testFreeze
	var frozen []bool
	quiesce := b.quiesceCopy
	b.quiesceCopy = func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (func() error, error) {
		thaw, err := quiesce(ctx, p, vid, v)
		if err != nil {
			return nil, err
		}
		frozen = append(frozen, a.host.Frozen(staging))
		return thaw, nil
	}
	if _, err := snapshot(b, id, "snap"); err != nil {
		t.Fatal(err)
	}
	if len(frozen) != 1 || !frozen[0] {
		t.Fatalf("the node plugin's filesystem frozen at the copy: %v", frozen)
	}
	waitFor(t, "A thaws and clears its inbox", func() bool { return !a.host.Frozen(staging) && inboxEmpty(t, b.pools.Pool("shared"), "node-a") })
}

// cloneOf asks node b for a clone of volume id.
func cloneOf(b *leaseNode, id, name string) (*csi.CreateVolumeResponse, error) {
	return b.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:                name,
		VolumeCapabilities:  []*csi.VolumeCapability{mountCap(rwo, "ext4")},
		CapacityRange:       &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}},
	})
}

// TestCloneFreezesOtherNode: a clone of a volume staged read-write on another
// node is copied while that node holds its filesystem frozen, as a snapshot
// is (it was once frozen only when staged on the controller's own node: a
// shared pool's clone copied a filesystem being written). A node that thaws
// before the copy ends fails the clone ABORTED, and the retry makes it.
func TestCloneFreezesOtherNode(t *testing.T) {
	for _, early := range []bool{false, true} {
		t.Run(map[bool]string{false: "frozen throughout", true: "thawed early"}[early], func(t *testing.T) {
			a, b, id, staging := freezePair(t, true)
			p := b.pools.Pool("shared")
			var events []string
			quiesce := b.quiesceCopy
			b.quiesceCopy = func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (func() error, error) {
				thaw, err := quiesce(ctx, p, vid, v)
				if err != nil {
					return nil, err
				}
				events = append(events, map[bool]string{true: "frozen", false: "thawed"}[a.host.Frozen(staging)])
				if early {
					a.clock.add(testFreeze.MaxHold)
					waitFor(t, "A thaws at its maximum hold", func() bool { return !a.host.Frozen(staging) })
				}
				return thaw, nil
			}
			resp, err := cloneOf(b, id, "copy")
			if early {
				wantCode(t, err, codes.Aborted)
				waitFor(t, "A clears its inbox", func() bool { return inboxEmpty(t, p, "node-a") })
				b.quiesceCopy, early = quiesce, false
				// Within the cool-down after a whole hold the node refuses
				// (UNAVAILABLE, retried); after it, the retry makes it.
				if _, err := cloneOf(b, id, "copy"); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "budget") {
					t.Fatalf("retry within the cool-down: %v", err)
				}
				waitFor(t, "A clears its inbox", func() bool { return inboxEmpty(t, p, "node-a") })
				a.clock.add(testFreeze.MaxHold)
				if resp, err = cloneOf(b, id, "copy"); err != nil {
					t.Fatalf("retry: %v", err)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			if len(events) == 0 || events[0] != "frozen" {
				t.Fatalf("A's filesystem when B began the copy: %v, want frozen", events)
			}
			if resp.GetVolume().GetVolumeId() == "" {
				t.Fatal("no clone")
			}
			if a.host.Frozen(staging) || !inboxEmpty(t, p, "node-a") {
				t.Fatal("the clone returned while A still held the freeze")
			}
			noFreezeRecord(t, p, a)
		})
	}
}
