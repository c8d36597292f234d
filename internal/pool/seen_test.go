package pool

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// listTree is every path below root with its kind and size, sorted.
func listTree(t *testing.T, root string) string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		out = append(out, strings.TrimPrefix(path, root)+" "+info.Mode().String()+" "+string(rune('0'+info.Size()%10)))
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", root, err)
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// coverWays are the ways a pool's filesystem leaves its path, with the real
// kernel: dir is a mount point holding the pool.
var coverWays = []struct {
	name  string
	cover func(t *testing.T, dir string)
}{
	{"tmpfs over the path", func(t *testing.T, dir string) { testutil.Tmpfs(t, dir, "64m") }},
	{"empty dir bound over the path", func(t *testing.T, dir string) {
		if err := unix.Mount(t.TempDir(), dir, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	}},
	{"the pool's mount gone, the bare directory covered", func(t *testing.T, dir string) {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
		testutil.Tmpfs(t, dir, "64m")
	}},
	{"another pool of the same name over the path", func(t *testing.T, dir string) {
		testutil.Tmpfs(t, dir, "64m")
		if _, err := Initialise(Config{Name: "p", Path: dir, Shared: true}); err != nil {
			t.Fatal(err)
		}
	}},
	{"pool.json deleted", func(t *testing.T, dir string) {
		if err := os.Remove(filepath.Join(dir, poolMeta)); err != nil {
			t.Fatal(err)
		}
	}},
}

// TestSeenPoolNeverLaidOutAgain: a pool the driver may lay out by itself (a
// mount stanza's) that showed itself to this process is never laid out again
// once its path stops showing it, whichever way: Check is unavailable, no
// lease is written, and nothing at all changes in what shows at the path.
func TestSeenPoolNeverLaidOutAgain(t *testing.T) {
	testutil.RequireRoot(t)
	for _, w := range coverWays {
		t.Run(w.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pool")
			if err := os.Mkdir(dir, 0o750); err != nil {
				t.Fatal(err)
			}
			testutil.Tmpfs(t, dir, "64m")
			p, err := Open(Config{Name: "p", Path: dir, Shared: true, RequireMount: true})
			if err != nil || p.OpenError() != nil {
				t.Fatalf("open: %v %v", err, p.OpenError())
			}
			if err := p.Leases().Write(Lease{Node: "node-a", Instance: "i", Counter: 1, DurationSeconds: 40}); err != nil {
				t.Fatal(err)
			}
			w.cover(t, dir)
			before := listTree(t, dir)
			if err := p.Check(); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("Check = %v, want unavailable", err)
			}
			if err := p.LayOut(); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("LayOut = %v, want unavailable", err)
			}
			if err := p.Leases().Write(Lease{Node: "node-a", Instance: "i", Counter: 2, DurationSeconds: 40}); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("lease written where the pool does not show: %v", err)
			}
			if after := listTree(t, dir); after != before {
				t.Fatalf("the path changed:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

// TestFirstLayoutHasAUID: a pool laid out gets a uid; a pool.json without
// one (laid out before) is served, and one of another uid or none where one
// was seen is another pool.
func TestFirstLayoutHasAUID(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	p, err := Open(Config{Name: "p", Path: dir})
	if err != nil || p.OpenError() != nil {
		t.Fatalf("open: %v %v", err, p.OpenError())
	}
	readInfo := func() poolInfo {
		raw, err := os.ReadFile(filepath.Join(dir, poolMeta))
		if err != nil {
			t.Fatal(err)
		}
		var info poolInfo
		if err := json.Unmarshal(raw, &info); err != nil {
			t.Fatal(err)
		}
		return info
	}
	info := readInfo()
	if len(info.UID) != 32 {
		t.Fatalf("uid %q", info.UID)
	}
	write := func(info poolInfo) {
		raw, _ := json.Marshal(info)
		if err := os.WriteFile(filepath.Join(dir, poolMeta), raw, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	for _, other := range []string{"", "0123"} {
		write(poolInfo{SchemaVersion: SchemaVersion, Name: "p", UID: other})
		if err := p.Check(); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "another pool") {
			t.Fatalf("uid %q: Check = %v, want another pool", other, err)
		}
	}
	write(info)
	if err := p.Check(); err != nil {
		t.Fatalf("the pool back: %v", err)
	}
	// A pool laid out before uids: served, by this process and a new one.
	write(poolInfo{SchemaVersion: SchemaVersion, Name: "p"})
	q, err := Open(Config{Name: "p", Path: dir})
	if err != nil || q.OpenError() != nil || q.Check() != nil {
		t.Fatalf("a pool without uid: %v %v %v", err, q.OpenError(), q.Check())
	}
	if readInfo().UID != "" {
		t.Fatal("a pool without uid was given one")
	}
}

// TestLateFirstLayoutOnce: a pool that never showed itself to this process
// (the first mount of a share, late) is laid out by Check; two processes
// laying it out at once agree on one uid; the guard refuses a layout and
// nothing is written then.
func TestLateFirstLayoutOnce(t *testing.T) {
	testutil.RequireRoot(t)
	dir := filepath.Join(t.TempDir(), "pool")
	if err := os.Mkdir(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	cfg := Config{Name: "p", Path: dir, Shared: true, RequireMount: true}
	guarded, err := Open(cfg, WithLayoutGuard(func() error { return errors.New("this node holds devices of the pool") }))
	if err != nil || !errors.Is(guarded.OpenError(), ErrUnavailable) {
		t.Fatalf("open before the mount: %v %v", err, guarded.OpenError())
	}
	var ps []*Pool
	for range 4 {
		p, err := Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	testutil.Tmpfs(t, dir, "64m") // the share, mounted late
	if err := guarded.Check(); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "holds devices") {
		t.Fatalf("guarded Check = %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("the guard let %v be written", ents)
	}
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Go(func() {
			if err := p.Check(); err != nil {
				t.Errorf("late layout: %v", err)
			}
		})
	}
	wg.Wait()
	for _, p := range ps {
		if err := p.Check(); err != nil {
			t.Fatalf("after the layout: %v", err)
		}
	}
	guarded.SetLayoutGuard(nil)
	if err := guarded.Check(); err != nil {
		t.Fatalf("the guarded pool once laid out elsewhere: %v", err)
	}
}
