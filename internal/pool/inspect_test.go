package pool

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestOpenExistingAndLeftovers(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	v, err := p.Reserve(ctx, Spec{Name: "ok", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.MarkReady(v); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Reserve(ctx, Spec{Name: "stuck", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB}); err != nil {
		t.Fatal(err)
	}
	vols := filepath.Join(p.cfg.Path, "volumes")
	os.Mkdir(filepath.Join(vols, ".deleting-"+KeyForName("gone")), 0o750)
	os.Mkdir(filepath.Join(vols, KeyForName("nometa")), 0o750)
	os.WriteFile(filepath.Join(vols, "stray"), nil, 0o600)

	q, err := OpenExisting(p.cfg.Path)
	if err != nil || q.cfg.Name != p.cfg.Name {
		t.Fatalf("OpenExisting = %+v, %v", q, err)
	}
	if _, err := OpenExisting(t.TempDir()); err == nil {
		t.Fatal("a directory without pool.json was opened")
	}
	now := time.Now()
	if got, _ := q.Leftovers(now); len(got) != 3 {
		t.Fatalf("leftovers now = %+v, want 3 (deleting, no metadata, stray)", got)
	}
	if got, _ := q.Leftovers(now.Add(2 * StaleCreate)); len(got) != 4 {
		t.Fatalf("leftovers later = %+v, want the stuck create too", got)
	}
}

// A crash between writing volume.json's temp file and renaming it leaves the
// temp file: pool check reports it, and the next write removes it once stale.
func TestTempLeftovers(t *testing.T) {
	p, err := Open(Config{Name: "t", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	v, err := p.Reserve(context.Background(), Spec{Name: "v", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
	if err != nil {
		t.Fatal(err)
	}
	id := NewVolumeID("t", "v")
	tmp := filepath.Join(p.Dir(id), ".volume.json.tmp-12345")
	if err := os.WriteFile(tmp, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	left, err := p.Leftovers(time.Now())
	if err != nil || len(left) != 1 || left[0].Path != tmp {
		t.Fatalf("leftovers: %+v %v", left, err)
	}
	if err := p.save(v, true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tmp); err != nil {
		t.Fatal("a fresh temp file was removed: it may be another writer's")
	}
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(tmp, old, old); err != nil {
		t.Fatal(err)
	}
	if err := p.save(v, true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Fatalf("a stale temp file survived the next write: %v", err)
	}
}

// TestHalfDoneChangesOfAnotherNode: while another process (another node, on a
// shared pool) holds the pool lock, a volume directory with no volume.json yet
// and a .deleting- directory are a create and a delete under way: they are
// neither listed as damaged volumes nor reported as leftovers. Once the lock
// is free, the same things are damage and leftovers again. On CephFS another
// client's create stays in that state for seconds.
func TestHalfDoneChangesOfAnotherNode(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	other, err := Open(Config{Name: p.cfg.Name, Path: p.cfg.Path, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := other.LockPool(ctx)
	if err != nil {
		t.Fatal(err)
	}
	vols := filepath.Join(p.cfg.Path, "volumes")
	nometa := filepath.Join(vols, KeyForName("creating"))
	os.Mkdir(nometa, 0o750)
	os.WriteFile(filepath.Join(nometa, ".volume.json.tmp-123"), []byte("{"), 0o600)
	os.Mkdir(filepath.Join(vols, ".deleting-"+KeyForName("going")), 0o750)
	snap := filepath.Join(p.cfg.Path, "snapshots", KeyForName("snapping"))
	os.MkdirAll(snap, 0o750)

	check := func(want int) {
		t.Helper()
		entries, err := p.List()
		if err != nil || len(entries) != want {
			t.Fatalf("List = %+v, %v; want %d entries", entries, err, want)
		}
		page, _, err := p.ListPage("", 0, func(Entry) bool { return true })
		if err != nil || len(page) != want {
			t.Fatalf("ListPage = %+v, %v; want %d entries", page, err, want)
		}
		snaps, err := p.Snapshots().List()
		if err != nil || len(snaps) != want {
			t.Fatalf("Snapshots().List = %+v, %v; want %d entries", snaps, err, want)
		}
		left, err := p.Leftovers(time.Now())
		if err != nil || len(left) != 3*want {
			t.Fatalf("Leftovers = %+v, %v; want %d", left, err, 3*want)
		}
	}
	check(0) // under way elsewhere
	unlock()
	check(1) // nobody is changing the pool: the same things are damage
}

// TestFreezeLeftovers: pool check names what freezes across nodes left behind
// once it is older than StaleFreeze — a filesystem recorded frozen, a request
// no controller withdrew, an answer to a request that is gone, a file that is
// no request — and nothing of a freeze under way.
func TestFreezeLeftovers(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	var ids []VolumeID
	for _, name := range []string{"frozen", "asked", "answered"} {
		if _, err := p.Reserve(ctx, Spec{Name: name, Layout: LayoutImage, AccessType: AccessFilesystem, FSType: "ext4", CapacityBytes: MiB}); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, NewVolumeID(p.Name(), name))
	}
	frozen, asked, answered := ids[0], ids[1], ids[2]
	if err := p.Freezes().WriteRecord(frozen, "node-a", "/var/lib/kubelet/staging/x"); err != nil {
		t.Fatal(err)
	}
	if err := p.Freezes().WriteRequest(FreezeRequest{Volume: asked.String(), Node: "node-a", Path: "/var/lib/kubelet/staging/y", Nonce: NewFreezeNonce()}); err != nil {
		t.Fatal(err)
	}
	if err := p.Freezes().WriteAck(FreezeAck{Volume: answered.String(), Node: "node-b", Nonce: NewFreezeNonce(), State: FreezeThawed}); err != nil {
		t.Fatal(err)
	}
	stray := filepath.Join(p.cfg.Path, "freeze", "node-a", "notes.txt")
	if err := os.WriteFile(stray, []byte("hi"), 0o600); err != nil {
		t.Fatal(err)
	}
	reasons := func(now time.Time) map[string]string {
		left, err := p.Leftovers(now)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, l := range left {
			out[l.Path] = l.Reason
		}
		return out
	}
	// A freeze under way: only the stray file.
	if got := reasons(time.Now()); len(got) != 1 || got[stray] == "" {
		t.Fatalf("leftovers of a freeze under way: %v, want the stray file alone", got)
	}
	got := reasons(time.Now().Add(2 * StaleFreeze))
	for path, want := range map[string]string{
		stray:                                  "damaged",
		filepath.Join(p.Dir(frozen), "frozen"): "node node-a froze",
		filepath.Join(p.cfg.Path, "freeze", "node-a", asked.Key+".request"): "no controller withdrew",
		filepath.Join(p.cfg.Path, "freeze", "node-b", answered.Key+".ack"):  "request that is gone",
	} {
		if !strings.Contains(got[path], want) {
			t.Errorf("%s: %q, want %q", path, got[path], want)
		}
	}
	if len(got) != 4 {
		t.Errorf("leftovers: %v, want 4", got)
	}
}

// TestTrashLeftoversByNameTime: an unlocked trash entry is a leftover only once
// neither its change time nor the time in its name (the rename's) is recent: a
// filesystem whose rename keeps the change time (a CephFS did) made a delete
// still under way on another node a leftover.
func TestTrashLeftoversByNameTime(t *testing.T) {
	dir := t.TempDir()
	fl := files{root: dir}
	later := time.Now().Add(time.Hour) // every change time is then an hour old
	for _, name := range []string{
		fmt.Sprintf("v-%s-%d", strings.Repeat("a", 32), later.Add(-time.Minute).UnixNano()), // renamed a minute before
		fmt.Sprintf("v-%s-%d", strings.Repeat("b", 32), later.Add(-time.Hour).UnixNano()),   // an hour before
		"v-" + strings.Repeat("c", 32) + "-notatime",
	} {
		if err := os.MkdirAll(filepath.Join(dir, trashDir, name), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	for _, l := range fl.trashLeftovers(later) {
		got = append(got, filepath.Base(l.Path))
	}
	slices.Sort(got)
	want := []string{fmt.Sprintf("v-%s-%d", strings.Repeat("b", 32), later.Add(-time.Hour).UnixNano()), "v-" + strings.Repeat("c", 32) + "-notatime"}
	if !slices.Equal(got, want) {
		t.Errorf("leftovers %v, want %v", got, want)
	}
}
