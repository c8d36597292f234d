package pool

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

func trashNames(t *testing.T, p *Pool) []string {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(p.cfg.Path, trashDir))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

func reserveImage(t *testing.T, p *Pool, name string) VolumeID {
	t.Helper()
	v, err := p.Reserve(context.Background(), Spec{Name: name, Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Images().Prepare(v); err != nil {
		t.Fatal(err)
	}
	return NewVolumeID("test", name)
}

// TestDeleteLeavesTheRemovalToTheEmptier: with an emptier serving the pool,
// a delete answers once the volume is renamed into the trash: it is gone for
// every reader then, its entry waits in the trash until EmptyTrash, and the
// ledger no longer counts it. Without one (or once it stopped) a delete
// removes the data itself, as before.
func TestDeleteLeavesTheRemovalToTheEmptier(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	var woken atomic.Int32
	p.ServeTrash(func() { woken.Add(1) })
	id := reserveImage(t, p, "a")
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if woken.Load() != 1 {
		t.Fatalf("the emptier was woken %d times, want 1", woken.Load())
	}
	if _, err := p.Load(id); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Load of the deleted volume = %v, want ErrNotFound", err)
	}
	if entries, err := p.List(); err != nil || len(entries) != 0 {
		t.Fatalf("List = %+v, %v; want nothing", entries, err)
	}
	if got := trashNames(t, p); len(got) != 1 {
		t.Fatalf("trash holds %v, want the deleted volume's entry", got)
	}
	if err := p.Delete(ctx, id); err != nil { // a retry: nothing to move, nothing queued
		t.Fatal(err)
	}
	if err := p.EmptyTrash(false); err != nil {
		t.Fatal(err)
	}
	if got := trashNames(t, p); len(got) != 0 {
		t.Fatalf("trash holds %v after EmptyTrash", got)
	}

	// A capacity figure or decision counts the blocks of what was answered
	// deleted: it removes what is still queued first.
	id = reserveImage(t, p, "c")
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if got := trashNames(t, p); len(got) != 1 {
		t.Fatalf("trash holds %v, want the deleted volume's entry", got)
	}
	if u, err := p.Ledger().Usage(); err != nil || u.Volumes != 0 || u.ProvisionedBytes != 0 {
		t.Fatalf("Usage = %+v, %v; want no volume", u, err)
	}
	if got := trashNames(t, p); len(got) != 0 {
		t.Fatalf("trash holds %v after a measurement", got)
	}
	id = reserveImage(t, p, "d")
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	reserveImage(t, p, "e") // its admission
	if got := trashNames(t, p); len(got) != 0 {
		t.Fatalf("trash holds %v after a create's admission", got)
	}

	p.ServeTrash(nil)
	id = reserveImage(t, p, "b")
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if got := trashNames(t, p); len(got) != 0 {
		t.Fatalf("a delete without an emptier left %v in the trash", got)
	}
}

// TestEmptyTrashAtStartSparesHeldEntries: the whole-trash pass removes what
// a crash left and skips an entry whose lock a call holds (a delete under way,
// here or on another node, removing it itself).
func TestEmptyTrashAtStartSparesHeldEntries(t *testing.T) {
	p := openTemp(t)
	left := reserveImage(t, p, "left")
	held := reserveImage(t, p, "held")
	for _, id := range []VolumeID{left, held} {
		if _, _, err := p.files().toTrash(volumesDir, id.Key, "v-", true); err != nil {
			t.Fatal(err)
		}
	}
	var heldName string
	for _, n := range trashNames(t, p) {
		if len(n) > len("v-"+held.Key) && n[:len("v-"+held.Key)] == "v-"+held.Key {
			heldName = n
		}
	}
	f, err := os.Open(filepath.Join(p.cfg.Path, trashDir, heldName, lockFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if err := p.EmptyTrash(true); err != nil {
		t.Fatal(err)
	}
	if got := trashNames(t, p); len(got) != 1 || got[0] != heldName {
		t.Fatalf("trash holds %v, want only %s (its lock is held)", got, heldName)
	}
}

// TestEmptyTrashThroughALinkRemovesNothingOutside: a shared pool is hostile.
// A trash directory swapped for a link between the delete and the emptier,
// or a link inside an entry, removes nothing outside the pool's trash.
func TestEmptyTrashThroughALinkRemovesNothingOutside(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	p.ServeTrash(func() {})
	outside := t.TempDir()
	canary := filepath.Join(outside, "canary")
	if err := os.WriteFile(canary, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A link inside the entry: RemoveAll takes the link, not its target.
	id := reserveImage(t, p, "a")
	if err := os.Symlink(outside, filepath.Join(p.Dir(id), "escape")); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := p.EmptyTrash(true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(canary); err != nil {
		t.Fatalf("emptying an entry with a link in it removed %s: %v", canary, err)
	}
	// The trash itself swapped for a link to outside after the rename.
	id = reserveImage(t, p, "b")
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	names := trashNames(t, p)
	if len(names) != 1 {
		t.Fatalf("trash holds %v", names)
	}
	victim := filepath.Join(outside, names[0])
	if err := os.MkdirAll(filepath.Join(victim, "data"), 0o750); err != nil {
		t.Fatal(err)
	}
	trash := filepath.Join(p.cfg.Path, trashDir)
	if err := os.Rename(trash, trash+".real"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, trash); err != nil {
		t.Fatal(err)
	}
	if err := p.EmptyTrash(true); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("EmptyTrash through a link = %v, want ErrCorrupt", err)
	}
	for _, f := range []string{canary, victim} {
		if _, err := os.Stat(f); err != nil {
			t.Fatalf("emptying a trash that is a link removed %s: %v", f, err)
		}
	}
}
