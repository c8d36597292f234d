package pool

import (
	"context"
	"os"
	"path/filepath"
	"testing"
)

// TestClearFreezeRemovesNothingOutsideThePool: a volume directory a pool
// writer replaced with a link to a directory outside the pool does not make
// Freezes().ClearRecord remove the "frozen" file there. Before, it removed it by path.
func TestClearFreezeRemovesNothingOutsideThePool(t *testing.T) {
	p := openTemp(t)
	if _, err := p.Reserve(context.Background(), Spec{Name: "v", Layout: LayoutImage, AccessType: AccessFilesystem, FSType: "ext4", CapacityBytes: MiB}); err != nil {
		t.Fatal(err)
	}
	id := NewVolumeID(p.Name(), "v")
	if err := p.Freezes().WriteRecord(id, "node-a", "/x"); err != nil {
		t.Fatal(err)
	}
	if err := p.Freezes().ClearRecord(id); err != nil {
		t.Fatal(err)
	}
	if fs, err := p.Freezes().Records(); err != nil || len(fs) != 0 {
		t.Fatalf("record left: %v %v", fs, err)
	}
	outside := t.TempDir()
	victim := filepath.Join(outside, "frozen")
	if err := os.WriteFile(victim, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := p.Dir(id)
	if err := os.Rename(dir, dir+".moved"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, dir); err != nil {
		t.Fatal(err)
	}
	if err := p.Freezes().ClearRecord(id); err == nil {
		t.Fatal("a volume directory that is a link was not refused")
	}
	if _, err := os.Stat(victim); err != nil {
		t.Fatalf("the file outside the pool was removed: %v", err)
	}
}
