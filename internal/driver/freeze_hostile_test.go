package driver

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// stageOther creates, publishes and stages another ext4 image volume on node
// a, at a path of its own: "another filesystem" a hostile record may name.
func stageOther(t *testing.T, a *leaseNode) (id, staging string) {
	t.Helper()
	ctx := context.Background()
	vc := mountCap(rwo, "ext4")
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "other", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id = resp.GetVolume().GetVolumeId()
	if _, err := a.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: a.opts.NodeID, VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	staging = filepath.Join(a.root, "staging-other")
	if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	return id, staging
}

// setStagePath rewrites node's stage record of volume id in the pool, as any
// writer of a shared pool can.
func setStagePath(t *testing.T, p *pool.Pool, id, node, path string) {
	t.Helper()
	vid, _ := pool.ParseVolumeID(id)
	if err := p.Update(context.Background(), vid, func(v *pool.Volume) (bool, error) {
		for i := range v.Staged {
			if v.Staged[i].Node == node {
				v.Staged[i].Path = path
			}
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
}

// noReader tells whether nobody has the FIFO at path open for reading: a
// non-blocking open for writing then fails ENXIO.
func noReader(t *testing.T, path string) bool {
	t.Helper()
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err == nil {
		unix.Close(fd)
		return false
	}
	return errors.Is(err, unix.ENXIO)
}

// TestFreezeIgnoresHostileStagePaths: whatever path a pool writer puts in the
// volume's stage record (and so in the controller's request), node A freezes
// only its own mount of the volume, found from its loop device, or nothing:
// never another filesystem, never the named file, and it never blocks.
func TestFreezeIgnoresHostileStagePaths(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// path makes the hostile path in dir; other is the other volume's
		// staging path.
		path func(t *testing.T, dir, other string) string
		// prefix, when set, is A's --allowed-path-prefix (its own staging
		// path is then outside it).
		prefix string
		frozen bool
	}{
		{name: "link to another filesystem", frozen: true, path: func(t *testing.T, dir, other string) string {
			l := filepath.Join(dir, "link")
			if err := os.Symlink(other, l); err != nil {
				t.Fatal(err)
			}
			return l
		}},
		{name: "another filesystem", frozen: true, path: func(t *testing.T, dir, other string) string { return other }},
		{name: "FIFO", frozen: true, path: func(t *testing.T, dir, other string) string {
			f := filepath.Join(dir, "fifo")
			if err := unix.Mkfifo(f, 0o600); err != nil {
				t.Fatal(err)
			}
			return f
		}},
		{name: "device node", frozen: true, path: func(t *testing.T, dir, other string) string {
			n := filepath.Join(dir, "null")
			if err := unix.Mknod(n, unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))); err != nil {
				// Without CAP_MKNOD: a link to one.
				if err := os.Symlink("/dev/null", n); err != nil {
					t.Fatal(err)
				}
			}
			return n
		}},
		{name: "path outside the prefix", frozen: true, path: func(t *testing.T, dir, other string) string { return "/" }},
		{name: "own mount outside the prefix", prefix: "/nonexistent-prefix", path: func(t *testing.T, dir, other string) string { return "/" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _, id, staging := freezePair(t, false)
			p := a.pools.Pool("shared")
			_, other := stageOther(t, a)
			a.opts.PathPrefix, a.PathPrefix = tt.prefix, tt.prefix
			hostile := tt.path(t, t.TempDir(), other)
			setStagePath(t, p, id, "node-a", hostile)
			vid, _ := pool.ParseVolumeID(id)
			if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: id, Node: "node-a", Path: hostile, Nonce: pool.NewFreezeNonce()}); err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			go func() { defer close(done); a.freezes.Tick(ctx) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the agent blocked on the stage record's path")
			}
			if a.host.Frozen(other) {
				t.Fatal("another filesystem was frozen")
			}
			if a.host.Frozen(staging) != tt.frozen {
				t.Fatalf("the volume's own filesystem frozen: %v, want %v", a.host.Frozen(staging), tt.frozen)
			}
			if fi, err := os.Lstat(hostile); err == nil && fi.Mode()&os.ModeNamedPipe != 0 && !noReader(t, hostile) {
				t.Fatal("the FIFO was opened")
			}
			got, ok, err := p.Freezes().ReadAck("node-a", vid)
			want := map[bool]pool.FreezeState{true: pool.FreezeFrozen, false: pool.FreezeNotStaged}[tt.frozen]
			if err != nil || !ok || got.State != want {
				t.Fatalf("answer %+v %v %v, want %s", got, ok, err, want)
			}
			if err := p.Freezes().RemoveRequest("node-a", vid); err != nil {
				t.Fatal(err)
			}
			a.freezes.Tick(ctx)
			if a.host.Frozen(staging) || !inboxEmpty(t, p, "node-a") {
				t.Fatal("not thawed after the request went")
			}
			noFreezeRecord(t, p, a)
		})
	}
}

// TestFreezeBudgetAgainstNonceRotation: a pool writer that sends a new
// request (a new nonce) whenever the last one was answered or thawed, for two
// hours by the node's clock, gets the volume frozen for at most the budget
// in any hour, never for longer than the maximum hold at once, and never
// again within the cool-down after a hold. Before the budget, each nonce was
// a new hold: frozen nearly all the time.
func TestFreezeBudgetAgainstNonceRotation(t *testing.T) {
	ctx := context.Background()
	a, _, id, staging := freezePair(t, false)
	p := a.pools.Pool("shared")
	vid, _ := pool.ParseVolumeID(id)
	budget := a.freezes.Timing.BudgetInForce()
	const step = 15 * time.Second
	nonce := ""
	rotate := func() {
		nonce = pool.NewFreezeNonce()
		if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: id, Node: "node-a", Path: staging, Nonce: nonce}); err != nil {
			t.Fatal(err)
		}
	}
	rotate()
	var frozenAt []bool // per step
	refusals := 0
	for range int(2 * time.Hour / step) {
		a.freezes.Tick(ctx)
		frozenAt = append(frozenAt, a.host.Frozen(staging))
		if ack, ok, err := p.Freezes().ReadAck("node-a", vid); err == nil && ok && ack.Nonce == nonce && ack.State != pool.FreezeFrozen {
			if ack.State == pool.FreezeFailed && strings.Contains(ack.Reason, "budget") {
				refusals++
			}
			rotate()
		}
		a.clock.add(step)
	}
	perHour := int(time.Hour / step)
	for i := 0; i+perHour <= len(frozenAt); i += perHour / 12 {
		n := 0
		for _, f := range frozenAt[i : i+perHour] {
			if f {
				n++
			}
		}
		// One step of slack: a step counts as frozen when it began so.
		if got := time.Duration(n) * step; got > budget+step {
			t.Fatalf("frozen for %s in the hour from step %d: over the budget of %s", got, i, budget)
		}
	}
	run := 0
	for _, f := range frozenAt {
		if run = map[bool]int{true: run + 1, false: 0}[f]; time.Duration(run)*step > a.freezes.Timing.MaxHold+step {
			t.Fatalf("frozen for %s at once, over the maximum hold of %s", time.Duration(run)*step, a.freezes.Timing.MaxHold)
		}
	}
	if refusals == 0 {
		t.Fatal("no request was refused for the budget")
	}
	total := 0
	for _, f := range frozenAt {
		if f {
			total++
		}
	}
	t.Logf("frozen %s of 2h under nonce rotation (budget %s/h, maximum hold %s); %d refusals", time.Duration(total)*step, budget, a.freezes.Timing.MaxHold, refusals)
}

// TestRestartRecoveryNeverBlocksServing: a start whose thaws hang (a FIFO
// where an older version's pool record points, a mount whose thaw does not
// return) still returns from thawAfterCrash at once, so Serve goes on to
// answer Probe; nothing is frozen for a request until the recovery is done,
// and the FIFO is never opened. Before, the start opened the pool record's
// path and waited for every thaw.
func TestRestartRecoveryNeverBlocksServing(t *testing.T) {
	ctx := context.Background()
	a, _, id, staging := freezePair(t, false)
	p := a.pools.Pool("shared")
	vid, _ := pool.ParseVolumeID(id)
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	// An older version's record in the pool naming the FIFO, and a "frozen"
	// record of another volume that is itself a FIFO.
	if err := p.Freezes().WriteRecord(vid, "node-a", fifo); err != nil {
		t.Fatal(err)
	}
	otherID, _ := stageOther(t, a)
	ovid, _ := pool.ParseVolumeID(otherID)
	if err := unix.Mkfifo(filepath.Join(p.Dir(ovid), "frozen"), 0o600); err != nil {
		t.Fatal(err)
	}
	dev, _, _ := a.host.Find(p.ImagePath(vid))
	if err := a.opts.State.Put(freeze.RecordKind, id, freeze.Record{Volume: id, Path: staging, Device: dev}); err != nil {
		t.Fatal(err)
	}
	a.host.FreezeDevice(dev)
	unblock := make(chan struct{})
	a.host.Faults.OnCall("Thaw", func() { <-unblock })
	t.Cleanup(func() {
		select {
		case <-unblock:
		default:
			close(unblock)
		}
	})

	start := time.Now()
	a.freezes.ThawAfterCrash(ctx)
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("thawAfterCrash held the start up for %s", took)
	}
	if _, err := a.Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatal(err)
	}
	if !noReader(t, fifo) {
		t.Fatal("the FIFO a pool record names was opened")
	}
	// No freeze while a thaw of the recovery is pending.
	if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: id, Node: "node-a", Path: staging, Nonce: pool.NewFreezeNonce()}); err != nil {
		t.Fatal(err)
	}
	a.freezes.Tick(ctx)
	if _, ok, _ := p.Freezes().ReadAck("node-a", vid); ok {
		t.Fatal("a request was answered before the recovery was done")
	}
	close(unblock)
	waitFor(t, "the recovery is done", a.freezes.Recovered)
	if a.host.Frozen(staging) {
		t.Fatal("not thawed after the restart")
	}
	if keys, _ := a.opts.State.Keys(freeze.RecordKind); len(keys) != 0 {
		t.Fatalf("node records left: %v", keys)
	}
	a.freezes.Tick(ctx)
	if ack, ok, err := p.Freezes().ReadAck("node-a", vid); err != nil || !ok || ack.State != pool.FreezeFrozen {
		t.Fatalf("after the recovery: %+v %v %v", ack, ok, err)
	}
}

// TestFreezeRecoveryGivesUp: a recovery whose thaw never returns is given up
// at its timeout, and the agent works again (the stuck volume stays locked).
func TestFreezeRecoveryGivesUp(t *testing.T) {
	ctx := context.Background()
	a, _, id, staging := freezePair(t, false)
	dev, _, _ := a.host.Find(a.pools.Pool("shared").ImagePath(mustVolumeID(id)))
	if err := a.opts.State.Put(freeze.RecordKind, id, freeze.Record{Volume: id, Path: staging, Device: dev}); err != nil {
		t.Fatal(err)
	}
	unblock := make(chan struct{})
	defer close(unblock)
	a.host.Faults.OnCall("Thaw", func() { <-unblock })
	a.freezes.RecoveryTimeout = 50 * time.Millisecond
	a.freezes.ThawAfterCrash(ctx)
	waitFor(t, "the recovery is given up", a.freezes.Recovered)
}

// TestFreezeBoundNeedsNoAgent: a node whose agent stops answering after it
// froze (stuck, as on a write to a hung pool or a log on a frozen filesystem)
// is thawed at the bound all the same, by the thaw armed with the freeze; its
// answer still reads "frozen", and the controller discards the copy all the
// same, by its own clock against the bound the answer carries (ABORTED).
func TestFreezeBoundNeedsNoAgent(t *testing.T) {
	ctx := context.Background()
	a, b, id, staging := freezePair(t, false)
	a.freezes.Timing.MaxHold = 200 * time.Millisecond
	b.freezes.Timing.AckTimeout = time.Second // B waits that long for the stuck A to let go
	p := b.pools.Pool("shared")
	vid, _ := pool.ParseVolumeID(id)
	// A's agent answers once, then is stuck.
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			a.freezes.Tick(ctx)
			if ack, ok, _ := p.Freezes().ReadAck("node-a", vid); ok && ack.State == pool.FreezeFrozen {
				return
			}
		}
	}()
	quiesce := b.quiesceCopy
	b.quiesceCopy = func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (func() error, error) {
		thaw, err := quiesce(ctx, p, vid, v)
		if err != nil {
			return nil, err
		}
		<-answered
		waitFor(t, "the bound thaws A without its agent", func() bool { return !a.host.Frozen(staging) })
		if ack, ok, _ := p.Freezes().ReadAck("node-a", vid); !ok || ack.State != pool.FreezeFrozen || ack.HoldMillis != 200 {
			t.Errorf("A's answer: %+v", ack)
		}
		return thaw, nil
	}
	_, err := snapshot(b, id, "snap")
	wantCode(t, err, codes.Aborted)
	if !strings.Contains(err.Error(), "outlasted") {
		t.Fatalf("message: %v", err)
	}
	// The agent comes back: it lets go of the hold, and nothing is left.
	a.freezes.Tick(ctx)
	if a.host.Frozen(staging) || !inboxEmpty(t, p, "node-a") {
		t.Fatal("A did not let go")
	}
	noFreezeRecord(t, p, a)
}

// TestFreezeIgnoresAliasedImages: a pool writer who makes a volume's image a
// link (symbolic or hard) to another volume's image attached on node A, and
// names A among its stages, gets no freeze of the other volume: A freezes
// only a device its own stage records name for the volume asked, never the
// device the pool's image path resolves to. Before, A found the device by
// the image path's identity (links followed) and froze the other volume,
// and the budget, kept by volume ID, gave every alias a hold of its own.
func TestFreezeIgnoresAliasedImages(t *testing.T) {
	ctx := context.Background()
	for _, kind := range []string{"symlink", "hard link"} {
		t.Run(kind, func(t *testing.T) {
			a, _, _, _ := freezePair(t, false)
			p := a.pools.Pool("shared")
			otherID, other := stageOther(t, a)
			resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "alias", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "ext4")}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
			if err != nil {
				t.Fatal(err)
			}
			alias := mustVolumeID(resp.GetVolume().GetVolumeId())
			target := p.ImagePath(mustVolumeID(otherID))
			if err := os.Remove(p.ImagePath(alias)); err != nil {
				t.Fatal(err)
			}
			link := os.Link
			if kind == "symlink" {
				link = os.Symlink
			}
			if err := link(target, p.ImagePath(alias)); err != nil {
				t.Fatal(err)
			}
			if err := p.Update(ctx, alias, func(v *pool.Volume) (bool, error) {
				v.Staged = []pool.StageRecord{{Node: "node-a", Path: other, At: time.Now()}}
				return true, nil
			}); err != nil {
				t.Fatal(err)
			}
			if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: alias.String(), Node: "node-a", Path: other, Nonce: pool.NewFreezeNonce()}); err != nil {
				t.Fatal(err)
			}
			a.freezes.Tick(ctx)
			if a.host.Frozen(other) {
				t.Fatal("the other volume's filesystem was frozen through an alias of its image")
			}
			if got, ok, err := p.Freezes().ReadAck("node-a", alias); err != nil || !ok || got.State != pool.FreezeNotStaged {
				t.Fatalf("answer %+v %v %v, want %s", got, ok, err, pool.FreezeNotStaged)
			}
			noFreezeRecord(t, p, a)
		})
	}
}

// TestFreezeBudgetKeptByDevice: volumes whose node records name one device
// (an image that was a hard link to another when it was staged) share that
// device's budget: right after a hold of the device for one volume, a
// request for the other is refused by the cool-down, and a device held for
// one volume is never frozen again for another. Before, the budget was kept
// by volume ID: every alias got a fresh one.
func TestFreezeBudgetKeptByDevice(t *testing.T) {
	ctx := context.Background()
	a, _, _, _ := freezePair(t, false)
	p := a.pools.Pool("shared")
	otherID, other := stageOther(t, a)
	ovid := mustVolumeID(otherID)
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "alias", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "ext4")}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	alias := mustVolumeID(resp.GetVolume().GetVolumeId())
	if err := os.Remove(p.ImagePath(alias)); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(p.ImagePath(ovid), p.ImagePath(alias)); err != nil {
		t.Fatal(err)
	}
	recs, err := a.VolumeRecords(ovid)
	if err != nil || len(recs) != 1 || recs[0].Device == "" {
		t.Fatalf("records of the other volume: %+v %v", recs, err)
	}
	rec := recs[0]
	rec.Volume = alias.String()
	if err := a.opts.State.Put(layout.StagesKind, rec.Key(), rec); err != nil {
		t.Fatal(err)
	}
	if err := p.Update(ctx, alias, func(v *pool.Volume) (bool, error) {
		v.Staged = []pool.StageRecord{{Node: "node-a", Path: other, At: time.Now()}}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	ask := func(vid pool.VolumeID) {
		t.Helper()
		if err := p.Freezes().WriteRequest(pool.FreezeRequest{Volume: vid.String(), Node: "node-a", Path: other, Nonce: pool.NewFreezeNonce()}); err != nil {
			t.Fatal(err)
		}
		a.freezes.Tick(ctx)
	}
	answer := func(vid pool.VolumeID) pool.FreezeAck {
		t.Helper()
		got, ok, err := p.Freezes().ReadAck("node-a", vid)
		if err != nil || !ok {
			t.Fatalf("no answer for %s: %v", vid, err)
		}
		return got
	}
	ask(ovid)
	if !a.host.Frozen(other) {
		t.Fatalf("the volume's own request: not frozen (%+v)", answer(ovid))
	}
	// Held for the other volume: not frozen again for the alias.
	ask(alias)
	if got := answer(alias); got.State != pool.FreezeFailed {
		t.Fatalf("a request for the alias while the device is held: %+v", got)
	}
	if err := p.Freezes().RemoveRequest("node-a", alias); err != nil {
		t.Fatal(err)
	}
	a.clock.add(10 * time.Second)
	if err := p.Freezes().RemoveRequest("node-a", ovid); err != nil {
		t.Fatal(err)
	}
	a.freezes.Tick(ctx)
	if a.host.Frozen(other) {
		t.Fatal("not thawed after the request went")
	}
	// Within the cool-down of the device's hold: refused for the alias too.
	ask(alias)
	if a.host.Frozen(other) {
		t.Fatal("the alias got a budget of its own: frozen again within the cool-down")
	}
	if got := answer(alias); got.State != pool.FreezeFailed || !strings.Contains(got.Reason, "budget") {
		t.Fatalf("answer %+v, want a refusal for the budget", got)
	}
}

// TestFailedFreezeKeepsACrashRecord: a freeze that fails on a filesystem
// already frozen (left so by a crash whose thaw has not run, or was given up)
// keeps the record that tells the next start to thaw it. Before, the failed
// freeze deleted the volume's record, its own and the crash's alike, and the
// filesystem stayed frozen for good.
func TestFailedFreezeKeepsACrashRecord(t *testing.T) {
	ctx := context.Background()
	a, _, id, staging := freezePair(t, false)
	vid := mustVolumeID(id)
	dev, _, _ := a.host.Find(a.pools.Pool("shared").ImagePath(vid))
	crash := freeze.Record{Volume: id, Path: staging, Device: dev}
	if err := a.opts.State.Put(freeze.RecordKind, id, crash); err != nil {
		t.Fatal(err)
	}
	a.host.FreezeDevice(dev)
	if h, _, err := a.freezes.FreezeVolumeHere(ctx, vid, dev, time.Second); err == nil || h != nil {
		t.Fatalf("froze a frozen filesystem: %+v %v", h, err)
	}
	var got freeze.Record
	if ok, err := a.opts.State.Get(freeze.RecordKind, id, &got); err != nil || !ok || got != crash {
		t.Fatalf("the crash's freeze record after a failed freeze: %+v %t %v", got, ok, err)
	}
	// A failed freeze of a filesystem nobody froze leaves no record.
	if err := a.host.ThawMount("", staging, dev); err != nil {
		t.Fatal(err)
	}
	if err := a.opts.State.Delete(freeze.RecordKind, id); err != nil {
		t.Fatal(err)
	}
	a.host.Faults.FailNth("Freeze", 1, errors.New("the filesystem refuses"))
	if _, _, err := a.freezes.FreezeVolumeHere(ctx, vid, dev, time.Second); err == nil {
		t.Fatal("the failed freeze succeeded")
	}
	if keys, _ := a.opts.State.Keys(freeze.RecordKind); len(keys) != 0 {
		t.Fatalf("records left by a failed freeze: %v", keys)
	}
}

// mustVolumeID parses an ID the test made.
func mustVolumeID(s string) pool.VolumeID {
	id, _ := pool.ParseVolumeID(s)
	return id
}
