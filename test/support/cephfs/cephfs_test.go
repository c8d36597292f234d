package cephfs

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

// TestTwoClients: what the shared-pool tests rely on. A file written on node A
// is read on node B, a rename on one is seen on the other, and flock excludes
// across the two mounts.
func TestTwoClients(t *testing.T) {
	c := Shared(t)
	t.Logf("bootstrap %s, %d MiB resident, mds_early_reply=%t", c.Bootstrap, c.RSS>>20, c.EarlyReply)
	a, b := filepath.Join(c.Mounts[0], t.Name()), filepath.Join(c.Mounts[1], t.Name())
	if err := os.Mkdir(a, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(a) })
	start := time.Now()
	if err := os.WriteFile(filepath.Join(a, "f"), []byte("from A"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(b, "f")); err != nil || string(got) != "from A" {
		t.Fatalf("read on B: %q %v", got, err)
	}
	if err := os.Rename(filepath.Join(b, "f"), filepath.Join(b, "g")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(a, "g")); err != nil {
		t.Fatalf("rename on B not seen on A: %v", err)
	}
	t.Logf("write on A, read on B, rename on B, stat on A: %s", time.Since(start))

	fa, err := os.OpenFile(filepath.Join(a, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	fb, err := os.OpenFile(filepath.Join(b, "lock"), os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()
	if err := unix.Flock(int(fa.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(fb.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != unix.EWOULDBLOCK {
		t.Fatalf("flock on B while A holds it: %v, want EWOULDBLOCK", err)
	}
	fa.Close()
	deadline := time.Now().Add(10 * time.Second)
	for unix.Flock(int(fb.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
		if time.Now().After(deadline) {
			t.Fatal("B cannot take the lock A released")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
