package pool

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestLeaseDamageIsReadAndRepaired: whatever stands where a node's lease file
// belongs (anyone who can write the pool can put it there) is read as a
// damaged record, never as an error that refuses for good nor as a record;
// the node's own write either overwrites it in place (garbage, another
// node's name, a tail) or reports ErrLeaseDamaged, and Leases().Repair then lets
// the write succeed, removing links themselves and never their targets.
func TestLeaseDamageIsReadAndRepaired(t *testing.T) {
	const node = "node-a"
	tests := []struct {
		name string
		// plant damages the pool at root; outside is a directory outside it.
		plant func(t *testing.T, root, outside string)
		// repair: the write fails with ErrLeaseDamaged until Leases().Repair.
		repair bool
	}{
		{"directory", func(t *testing.T, root, _ string) {
			must(t, os.MkdirAll(filepath.Join(root, "leases", node, "sub", "deeper"), 0o755))
			must(t, os.WriteFile(filepath.Join(root, "leases", node, "sub", "f"), []byte("x"), 0o644))
		}, true},
		{"symlink out of the pool", func(t *testing.T, root, outside string) {
			must(t, os.MkdirAll(filepath.Join(root, "leases"), 0o755))
			must(t, os.Symlink(filepath.Join(outside, "victim"), filepath.Join(root, "leases", node)))
		}, true},
		{"hard link to another lease", func(t *testing.T, root, _ string) {
			must(t, os.MkdirAll(filepath.Join(root, "leases"), 0o755))
			must(t, os.WriteFile(filepath.Join(root, "leases", "node-b"), []byte(`{"node":"node-b","instance":"b","counter":1}`), 0o644))
			must(t, os.Link(filepath.Join(root, "leases", "node-b"), filepath.Join(root, "leases", node)))
		}, true},
		{"fifo", func(t *testing.T, root, _ string) {
			must(t, os.MkdirAll(filepath.Join(root, "leases"), 0o755))
			must(t, syscall.Mkfifo(filepath.Join(root, "leases", node), 0o644))
		}, true},
		{"too large", func(t *testing.T, root, _ string) {
			must(t, os.MkdirAll(filepath.Join(root, "leases"), 0o755))
			must(t, os.WriteFile(filepath.Join(root, "leases", node), []byte(strings.Repeat("x", 2*maxLease)), 0o644))
		}, false},
		{"garbage with a tail", func(t *testing.T, root, _ string) {
			must(t, os.MkdirAll(filepath.Join(root, "leases"), 0o755))
			must(t, os.WriteFile(filepath.Join(root, "leases", node), []byte(strings.Repeat("garbage ", 100)), 0o644))
		}, false},
		{"another node's name", func(t *testing.T, root, _ string) {
			must(t, os.MkdirAll(filepath.Join(root, "leases"), 0o755))
			must(t, os.WriteFile(filepath.Join(root, "leases", node), []byte(`{"node":"node-z","instance":"z","counter":5,"released":true}`), 0o644))
		}, false},
		{"leases directory a symlink", func(t *testing.T, root, outside string) {
			must(t, os.Symlink(outside, filepath.Join(root, "leases")))
		}, true},
		{"leases directory a file", func(t *testing.T, root, _ string) {
			must(t, os.WriteFile(filepath.Join(root, "leases"), []byte("x"), 0o644))
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := openTemp(t)
			outside := t.TempDir()
			must(t, os.WriteFile(filepath.Join(outside, "victim"), []byte("keep"), 0o644))
			tt.plant(t, p.Path(), outside)
			got, ok, err := p.Leases().Read(node)
			if err != nil || !ok || got.Damaged == "" {
				t.Fatalf("Leases().Read of the damage: %+v ok=%t %v; want a damaged record", got, ok, err)
			}
			rec := Lease{Node: node, Instance: "i", Counter: 3, DurationSeconds: 60}
			err = p.Leases().Write(rec)
			if tt.repair {
				if !errors.Is(err, ErrLeaseDamaged) || errors.Is(err, ErrUnavailable) {
					t.Fatalf("Leases().Write over the damage: %v, want ErrLeaseDamaged", err)
				}
				must(t, p.Leases().Repair(node))
				err = p.Leases().Write(rec)
			}
			if err != nil {
				t.Fatalf("Leases().Write after the repair: %v", err)
			}
			got, ok, err = p.Leases().Read(node)
			if got.Stamp == "" {
				t.Fatalf("Leases().Read gave no stamp: %+v", got)
			}
			got.Stamp = ""
			if err != nil || !ok || got != rec {
				t.Fatalf("Leases().Read after the repair: %+v ok=%t %v, want %+v", got, ok, err, rec)
			}
			if b, err := os.ReadFile(filepath.Join(outside, "victim")); err != nil || string(b) != "keep" {
				t.Fatalf("the link's target outside the pool: %q %v", b, err)
			}
			if b, err := os.ReadFile(filepath.Join(p.Path(), "leases", "node-b")); err == nil && !strings.Contains(string(b), `"node-b"`) {
				t.Fatalf("another node's lease was written through a hard link: %q", b)
			}
		})
	}
}

// TestLeaseStampChangesWithEveryWrite: a rewrite of the same record (someone
// rewriting a live node's lease with a constant one) is a change to a reader.
func TestLeaseStampChangesWithEveryWrite(t *testing.T) {
	p := openTemp(t)
	rec := Lease{Node: "node-a", Instance: "i", Counter: 1, DurationSeconds: 60}
	must(t, p.Leases().Write(rec))
	first, _, err := p.Leases().Read("node-a")
	must(t, err)
	time.Sleep(20 * time.Millisecond) // past the filesystem's timestamp granularity
	must(t, p.Leases().Write(rec))
	second, _, err := p.Leases().Read("node-a")
	must(t, err)
	if first.Stamp == "" || first == second {
		t.Fatalf("the same record written twice reads the same: %+v", first)
	}
}

// TestWriteLeaseOutsideThePool: a pool whose root is not the pool any more
// (its filesystem gone, another one in its place) is ErrUnavailable, never
// damage to repair.
func TestWriteLeaseOutsideThePool(t *testing.T) {
	p := openTemp(t)
	must(t, os.Remove(filepath.Join(p.Path(), poolMeta)))
	err := p.Leases().Write(Lease{Node: "node-a", Instance: "i", Counter: 1})
	if !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrLeaseDamaged) {
		t.Fatalf("Leases().Write into a root without pool.json: %v", err)
	}
	if err := p.Leases().Repair("node-a"); err == nil {
		t.Fatal("Leases().Repair worked in a root without pool.json")
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
