package pool

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func reserveBlock(t *testing.T, p *Pool, name string, size int64) *Volume {
	t.Helper()
	v, err := p.Reserve(context.Background(), Spec{Name: name, Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: size})
	if err != nil {
		t.Fatalf("reserve %s: %v", name, err)
	}
	if err := p.Images().Prepare(v); err != nil {
		t.Fatal(err)
	}
	if err := p.MarkReady(v); err != nil {
		t.Fatal(err)
	}
	return v
}

// wantLedger checks the ledger against the records: clean, or with the
// problem named by want (then repaired, and clean after).
func wantLedger(t *testing.T, p *Pool, want string) {
	t.Helper()
	r, err := p.Ledger().Check(context.Background(), false)
	if err != nil {
		t.Fatal(err)
	}
	if want == "" {
		if r.Problem != "" {
			t.Fatalf("ledger: %s", r.Problem)
		}
		return
	}
	if !strings.Contains(r.Problem, want) {
		t.Fatalf("ledger problem %q, want %q", r.Problem, want)
	}
	if _, err := p.Ledger().Check(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	if r, err := p.Ledger().Check(context.Background(), false); err != nil || r.Problem != "" {
		t.Fatalf("after repair: %+v, %v", r, err)
	}
}

func readLedgerFile(t *testing.T, p *Pool) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(p.cfg.Path, ledgerFile))
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func putLedgerFile(t *testing.T, p *Pool, raw []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(p.cfg.Path, ledgerFile), raw, 0o600); err != nil {
		t.Fatal(err)
	}
}

// A SIGKILL between any two steps of a change leaves the pool in one of the
// states below (each made here the way the kill would leave it: the steps
// after it never ran). pool check names what is outdated, and the next change
// converges: the ledger then matches the records exactly.
func TestLedgerConvergesAfterAKillAtEveryStep(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		// crash leaves p as a kill at one step would.
		crash func(t *testing.T, p *Pool)
		// check is what pool check says before the next change ("" clean).
		check string
	}{
		{"create: after the mkdir, before the ledger", func(t *testing.T, p *Pool) {
			old := readLedgerFile(t, p)
			v := reserveBlock(t, p, "new", 8*MiB)
			putLedgerFile(t, p, old)
			id, _ := ParseVolumeID(v.ID)
			_ = os.Remove(p.MetadataPath(id))
		}, "outdated"}, // the counts still match: only the stamp moved
		{"create: after the ledger, before volume.json", func(t *testing.T, p *Pool) {
			v := reserveBlock(t, p, "new", 8*MiB)
			id, _ := ParseVolumeID(v.ID)
			if err := os.Remove(p.MetadataPath(id)); err != nil {
				t.Fatal(err)
			}
		}, ""},
		{"create: done", func(t *testing.T, p *Pool) { reserveBlock(t, p, "new", 8*MiB) }, ""},
		{"delete: after the rename, before the ledger", func(t *testing.T, p *Pool) {
			old := readLedgerFile(t, p)
			if err := p.Delete(ctx, p.NewID("a")); err != nil {
				t.Fatal(err)
			}
			putLedgerFile(t, p, old)
		}, "outdated"},
		{"delete: after the ledger, before the trash is emptied", func(t *testing.T, p *Pool) {
			tx, end, err := p.Ledger().begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			v, _ := p.Load(p.NewID("a"))
			if _, _, err := p.files().toTrash(volumesDir, p.NewID("a").Key, "v-", false); err != nil {
				t.Fatal(err)
			}
			if err := tx.apply(func(l *ledger) { l.Volumes--; l.ProvisionedBytes -= v.CapacityBytes }); err != nil {
				t.Fatal(err)
			}
			end()
		}, ""},
		{"grow: after the ledger, before volume.json", func(t *testing.T, p *Pool) {
			id := p.NewID("a")
			old, err := os.ReadFile(p.MetadataPath(id))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.Grow(ctx, id, 32*MiB, 0, nil); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p.MetadataPath(id), old, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(p.ImagePath(id), 16*MiB); err != nil {
				t.Fatal(err)
			}
		}, ""},
		{"snapshot: after the ledger, before snapshot.json", func(t *testing.T, p *Pool) {
			src, _ := p.Load(p.NewID("a"))
			s, err := p.Snapshots().Reserve(ctx, "snap", src, 0)
			if err != nil {
				t.Fatal(err)
			}
			sid, _ := ParseSnapshotID(s.ID)
			if err := os.Remove(filepath.Join(p.Snapshots().Dir(sid), snapshotMetaFile)); err != nil {
				t.Fatal(err)
			}
		}, ""},
		{"snapshot fill: reflinked bytes counted, record not written", func(t *testing.T, p *Pool) {
			src, _ := p.Load(p.NewID("a"))
			s, err := p.Snapshots().Reserve(ctx, "snap", src, 0)
			if err != nil {
				t.Fatal(err)
			}
			sid, _ := ParseSnapshotID(s.ID)
			filled := *s
			filled.CopyMethod, filled.AllocatedBytes, filled.ReadyToUse = CopyReflink, 3*MiB, true
			if err := p.Snapshots().saveFilled(ctx, sid, &filled); err != nil {
				t.Fatal(err)
			}
			if err := p.Snapshots().save(s); err != nil { // the record as it was
				t.Fatal(err)
			}
		}, ""},
		{"ledger missing (a pool an older version made)", func(t *testing.T, p *Pool) {
			_ = os.Remove(filepath.Join(p.cfg.Path, ledgerFile))
		}, ""},
		{"a volume an older driver made, unknown to the ledger", func(t *testing.T, p *Pool) {
			id := p.NewID("foreign")
			if err := os.Mkdir(p.Dir(id), 0o750); err != nil {
				t.Fatal(err)
			}
			v := &Volume{ID: id.String(), Name: "foreign", Pool: p.cfg.Name, Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: 5 * MiB, State: StateReady}
			if err := p.save(v, true); err != nil {
				t.Fatal(err)
			}
		}, "outdated"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := openTemp(t)
			reserveBlock(t, p, "a", 16*MiB)
			reserveBlock(t, p, "b", 4*MiB)
			tt.crash(t, p)
			r, err := p.Ledger().Check(ctx, false)
			if err != nil {
				t.Fatal(err)
			}
			// "outdated": the stamp shows a change the ledger did not count,
			// which is no problem (the driver rebuilds it, never trusts it).
			if r.Problem != "" || r.Stale != (tt.check == "outdated") {
				t.Fatalf("pool check: problem %q, stale %v; want no problem, stale %v", r.Problem, r.Stale, tt.check == "outdated")
			}
			// The next change converges, and the ledger then matches.
			reserveBlock(t, p, "next", MiB)
			wantLedger(t, p, "")
			l, err := p.Ledger().read()
			if err != nil {
				t.Fatal(err)
			}
			u, _ := p.Ledger().Usage()
			if l.Pending.Kind == "" && l.tally() != tallyOf(u) {
				t.Fatalf("ledger %+v, records %+v", l.tally(), tallyOf(u))
			}
		})
	}
}

// A ledger that is not what a driver writes is damage: it is rebuilt from the
// records, never trusted, and never lets admission promise more than the pool
// can back; nothing hangs on it.
func TestDamagedLedgerIsRebuiltNeverTrusted(t *testing.T) {
	tests := []struct {
		name  string
		plant func(t *testing.T, path string)
	}{
		{"garbage", func(t *testing.T, path string) { _ = os.WriteFile(path, []byte("{not json"), 0o600) }},
		{"empty", func(t *testing.T, path string) { _ = os.WriteFile(path, nil, 0o600) }},
		// What a crash can leave of a write that was not fsynced (a create's
		// or a delete's, WriteDerivedFile): the file at its new size, its data
		// never written.
		{"zeros of a ledger's length", func(t *testing.T, path string) { _ = os.WriteFile(path, make([]byte, 260), 0o600) }},
		{"huge", func(t *testing.T, path string) {
			_ = os.WriteFile(path, []byte(strings.Repeat(" ", maxLedger+1)), 0o600)
		}},
		{"link to /dev/zero", func(t *testing.T, path string) { _ = os.Symlink("/dev/zero", path) }},
		{"FIFO", func(t *testing.T, path string) {
			if err := unix.Mkfifo(path, 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{"counts nothing, checksum not recomputed", func(t *testing.T, path string) {
			raw, _ := os.ReadFile(path)
			s := strings.Replace(string(raw), `"provisionedBytes":`, `"provisionedBytes":0,"x":`, 1)
			_ = os.WriteFile(path, []byte(s), 0o600)
		}},
		{"a directory", func(t *testing.T, path string) { _ = os.Mkdir(path, 0o700) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := openTemp(t)
			big := reserveBlock(t, p, "big", 64*MiB)
			path := filepath.Join(p.cfg.Path, ledgerFile)
			_ = os.Remove(path)
			tt.plant(t, path)
			// The pool can back its free space less what big promises: a
			// create beyond that is refused, whatever the ledger said. A
			// ledger trusted while damaged would forget big's 64 MiB, so
			// asking for half of that beyond what is available tells the
			// two apart, with room for the free space of the temp
			// directory, which the pool shares with whatever else runs on
			// the machine, to move meanwhile by tens of MiB (it did by
			// more than 2 MiB under load, the margin this test had).
			// An admission is a failure only if the space was not there
			// after it either, and is tried again (a few times) if it was.
			const margin = 32 * MiB
			for try := 1; ; try++ {
				u, err := p.Ledger().Usage()
				if err != nil {
					t.Fatal(err)
				}
				avail := p.Ledger().AvailableBytes(u)
				over := (avail/MiB)*MiB + margin
				v, err := p.Reserve(context.Background(), Spec{Name: "over-" + strconv.Itoa(try), Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: over})
				if errors.Is(err, ErrNoSpace) {
					break
				}
				after, uerr := p.Ledger().Usage()
				if err == nil && uerr == nil && try < 5 && p.Ledger().AvailableBytes(after)+over > avail+margin {
					t.Logf("try %d: the temp directory's free space grew meanwhile (%d then %d bytes before this create); trying again", try, avail, p.Ledger().AvailableBytes(after)+over)
					id, _ := ParseVolumeID(v.ID)
					if derr := p.Delete(context.Background(), id); derr != nil {
						t.Fatal(derr)
					}
					continue
				}
				t.Fatalf("a create beyond what the pool can back (%d > %d, %s promised) = %v, want ErrNoSpace", over, avail, big.Name, err)
			}
			reserveBlock(t, p, "fits", MiB)
			if tt.name == "a directory" {
				return // not ours to replace: admission measures; pool check names it
			}
			wantLedger(t, p, "")
		})
	}
}

// The ledger's bound admits without measuring; near the limit the pool is
// measured and the ledger checked against it, so a ledger that counts too
// much (drift) refuses nothing the pool can back, and is repaired.
func TestLedgerDriftIsRepairedBeforeARefusal(t *testing.T) {
	ctx := context.Background()
	p := openTemp(t)
	reserveBlock(t, p, "a", 8*MiB)
	tx, end, err := p.Ledger().begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A count nobody's record holds, with a valid checksum and stamps: as an
	// interrupted change would leave, settled wrongly.
	if err := tx.apply(func(l *ledger) { l.Volumes += 3; l.ProvisionedBytes += 1 << 45 }); err != nil {
		t.Fatal(err)
	}
	end()
	wantLedgerProblem := func() string {
		r, err := p.Ledger().Check(ctx, false)
		if err != nil {
			t.Fatal(err)
		}
		return r.Problem
	}
	if got := wantLedgerProblem(); !strings.Contains(got, "drift") {
		t.Fatalf("pool check: %q, want drift", got)
	}
	reserveBlock(t, p, "b", MiB) // the bound refuses; the measurement admits
	if got := wantLedgerProblem(); got != "" {
		t.Fatalf("after a measured admission: %q", got)
	}
}

// Two pool handles over one directory (two controllers on two nodes) keep one
// ledger between them.
func TestLedgerSharedByTwoControllers(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	p1, err := Open(Config{Name: "s", Path: dir})
	if err != nil {
		t.Fatal(err)
	}
	p2, err := Open(Config{Name: "s", Path: dir})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 2)
	for i, p := range []*Pool{p1, p2} {
		go func() {
			for j := range 20 {
				name := string(rune('a'+i)) + "-" + string(rune('a'+j))
				v, err := p.Reserve(context.Background(), Spec{Name: name, Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: MiB})
				if err != nil {
					done <- err
					return
				}
				if j%3 == 0 {
					id, _ := ParseVolumeID(v.ID)
					if err := p.Delete(context.Background(), id); err != nil {
						done <- err
						return
					}
				}
			}
			done <- nil
		}()
	}
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	wantLedger(t, p1, "")
}

func TestQuotaIDClaims(t *testing.T) {
	ctx := context.Background()
	p := openTemp(t)
	a, b := p.NewID("a"), p.NewID("b")
	for _, id := range []VolumeID{a, b} {
		if err := os.MkdirAll(p.Dir(id), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := p.files().touch(volumeRel(id, lockFile)); err != nil {
			t.Fatal(err)
		}
	}
	claim := func(id VolumeID, q uint64) bool {
		t.Helper()
		ok, err := p.QuotaIDs().Claim(ctx, "xfs-project", id, q)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	steps := []struct {
		name string
		do   func() bool
		want bool
	}{
		{"a claims 100", func() bool { return claim(a, 100) }, true},
		{"a again (a retried create)", func() bool { return claim(a, 100) }, true},
		{"b cannot take a's while a is creating", func() bool { return claim(b, 100) }, false},
		{"b takes a's once a is gone", func() bool {
			if err := os.RemoveAll(p.Dir(a)); err != nil {
				t.Fatal(err)
			}
			return claim(b, 100)
		}, true},
		{"b's claim records b", func() bool {
			raw, _ := os.ReadFile(filepath.Join(p.cfg.Path, quotaClaimRel("xfs-project", 100)))
			return string(raw) == b.Key
		}, true},
		{"a damaged claim is never taken", func() bool {
			_ = os.Symlink("/etc/passwd", filepath.Join(p.cfg.Path, quotaClaimRel("xfs-project", 200)))
			return claim(b, 200)
		}, false},
		{"a kind that names a path is refused", func() bool {
			ok, err := p.QuotaIDs().Claim(ctx, "../x", b, 1)
			return ok || err == nil
		}, false},
	}
	for _, s := range steps {
		if got := s.do(); got != s.want {
			t.Fatalf("%s: %t, want %t", s.name, got, s.want)
		}
	}
}

// forgeLedger rewrites the pool's ledger as anyone who can write a shared pool
// can: it counts nothing, with the stamps kept and the unkeyed checksum
// recomputed.
func forgeLedger(t *testing.T, p *Pool) {
	t.Helper()
	var l ledger
	if err := json.Unmarshal(readLedgerFile(t, p), &l); err != nil {
		t.Fatal(err)
	}
	l.Volumes, l.ProvisionedBytes, l.Pending = 0, 0, pending{}
	l.Sum = l.checksum(nil)
	raw, _ := json.Marshal(l)
	putLedgerFile(t, p, raw)
}

// A ledger rewritten by a pool writer never admits what the pool cannot back:
// with the cluster's share key its checksum is keyed (a forged one is damage,
// rebuilt from the records), and a shared pool without a key measures the pool
// before every admission. A local pool without a key is the node's own.
func TestForgedLedgerAdmitsNothing(t *testing.T) {
	for _, tt := range []struct {
		name   string
		shared bool
		keys   [][]byte
	}{
		{"keyed shared pool", true, [][]byte{[]byte("0123456789abcdef0123456789abcdef")}},
		{"keyed by the second key", true, [][]byte{[]byte("another key of thirty-two bytes!"), []byte("0123456789abcdef0123456789abcdef")}},
		{"shared pool without a key", true, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pool")
			if _, err := Initialise(Config{Name: "s", Path: dir, Shared: true}); err != nil {
				t.Fatal(err)
			}
			p, err := Open(Config{Name: "s", Path: dir, Shared: tt.shared})
			if err != nil {
				t.Fatal(err)
			}
			p.Ledger().SetKeys(tt.keys)
			var st unix.Statfs_t
			if err := unix.Statfs(dir, &st); err != nil {
				t.Fatal(err)
			}
			// Each of the two is 60% of the free space: both never fit.
			size := min(int64(st.Bavail)*st.Bsize*6/10/MiB*MiB, MaxCapacity)
			ctx := context.Background()
			if _, err := p.Reserve(ctx, Spec{Name: "a", Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: size}); err != nil {
				t.Fatal(err)
			}
			forgeLedger(t, p)
			// A second controller, started after the forgery, knows nothing
			// of the ledger but the key.
			p2, err := Open(Config{Name: "s", Path: dir, Shared: tt.shared})
			if err != nil {
				t.Fatal(err)
			}
			p2.Ledger().SetKeys(tt.keys)
			if _, err := p2.Reserve(ctx, Spec{Name: "b", Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: size}); !errors.Is(err, ErrNoSpace) {
				t.Fatalf("after a forged ledger, a create the pool cannot back = %v, want ErrNoSpace", err)
			}
			if got, err := p2.Ledger().Capacity(); err != nil || got > int64(st.Bavail)*st.Bsize-size/2 {
				t.Fatalf("GetCapacity after a forged ledger = %d, %v: counts a's promise as free", got, err)
			}
		})
	}
}

// A ledger put back from an earlier copy (every field valid, the directories
// unchanged since: a growth happened in between) is not trusted by a driver
// that has seen a later one.
func TestReplayedLedgerIsNotTrusted(t *testing.T) {
	ctx := context.Background()
	p := openTemp(t)
	reserveBlock(t, p, "a", 8*MiB)
	old := readLedgerFile(t, p)
	tx, end, err := p.Ledger().begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.apply(func(l *ledger) { l.ProvisionedBytes += 64 * MiB }); err != nil {
		t.Fatal(err)
	}
	end()
	putLedgerFile(t, p, old)
	if _, err := p.Ledger().read(); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a ledger put back from an earlier copy: %v, want ErrCorrupt", err)
	}
}

// pool check without the cluster's key does not call a keyed ledger damaged,
// nor rewrite it; a driver with the key keeps trusting it.
func TestKeyedLedgerIsNotDamageToACheckWithoutTheKey(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "pool")
	p, err := Open(Config{Name: "k", Path: dir})
	if err != nil {
		t.Fatal(err)
	}
	p.Ledger().SetKeys([][]byte{[]byte("0123456789abcdef0123456789abcdef")})
	reserveBlock(t, p, "a", 8*MiB)
	before := readLedgerFile(t, p)
	check, err := Open(Config{Name: "k", Path: dir})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := check.Ledger().Check(ctx, true); err != nil || r.Problem != "" {
		t.Fatalf("pool check without the key: %+v, %v", r, err)
	}
	if !bytes.Equal(before, readLedgerFile(t, p)) {
		t.Fatal("pool check without the key rewrote the keyed ledger")
	}
	if _, err := p.Ledger().read(); err != nil {
		t.Fatalf("the keyed driver no longer trusts its ledger: %v", err)
	}
}
