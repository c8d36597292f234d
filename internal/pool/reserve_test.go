package pool

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// fillUp writes path until the filesystem refuses (ENOSPC), as a pod filling
// its sparse image, or anyone writing a shared pool, leaves it.
func fillUp(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, chunk := range []int{1 << 20, 4 << 10, 512} {
		buf := make([]byte, chunk)
		for {
			if _, err := f.Write(buf); err != nil {
				if !errors.Is(err, unix.ENOSPC) {
					t.Fatal(err)
				}
				break
			}
		}
	}
	if err := f.Sync(); err != nil && !errors.Is(err, unix.ENOSPC) {
		t.Fatal(err)
	}
}

// A pool that is full to the last block can still be emptied through the
// driver: an unstage (its stage record cleared) and a delete (the rename into
// trash/, the ledger) spend the pool's reserve; a create cannot.
func TestFullPoolCanBeEmptied(t *testing.T) {
	mnt := testutil.LoopFS(t, t.TempDir(), "ext4", 32*MiB, "-q", "-m", "0")
	p, err := Open(Config{Name: "full", Path: filepath.Join(mnt, "pool")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	v := reserveBlock(t, p, "v", 8*MiB)
	id, _ := ParseVolumeID(v.ID)
	if err := p.Update(ctx, id, func(v *Volume) (bool, error) {
		v.SetStaged("node-1", "/var/lib/kubelet/plugins/x/globalmount", false, time.Now())
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	fillUp(t, filepath.Join(mnt, "filler"))
	if _, err := p.Reserve(ctx, Spec{Name: "more", Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: MiB}); err == nil {
		t.Fatal("a create on a full pool succeeded")
	}
	if err := p.Update(ctx, id, func(v *Volume) (bool, error) {
		v.ClearStaged("node-1")
		return true, nil
	}); err != nil {
		t.Fatalf("unstage on a full pool: %v", err)
	}
	if err := p.Delete(ctx, id); err != nil {
		t.Fatalf("delete on a full pool: %v", err)
	}
	if p.VolumeExists(id) {
		t.Fatal("the volume is still there")
	}
	wantLedger(t, p, "")
}
