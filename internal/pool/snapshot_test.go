package pool

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

func TestParseSnapshotID(t *testing.T) {
	key := KeyForName("snap-1")
	tests := []struct {
		name    string
		in      string
		ok      bool
		hostile bool
	}{
		{"valid", "local@" + key, true, false},
		{"valid dashed pool", "my-pool@" + key, true, false},
		{"volume ID", "local." + key, false, false},
		{"empty", "", false, false},
		{"sanity's fake ID", "reallyfakesnapshotid", false, false},
		{"no separator", "local" + key, false, false},
		{"two separators", "a@b@" + key, false, false},
		{"traversal in pool", "../../etc@" + key, false, true},
		{"slash in pool", "lo/cal@" + key, false, true},
		{"traversal key", "local@../../../../etc/passwd", false, true},
		{"dotdot key", "local@..", false, true},
		{"NUL", "local@" + key[:31] + "\x00", false, true},
		{"newline", "local@" + key[:31] + "\n", false, true},
		{"invalid UTF-8", "local@" + key[:31] + "\xff", false, true},
		{"uppercase key", "local@" + strings.ToUpper(key), false, false},
		{"short key", "local@" + key[:31], false, false},
		{"long key", "local@" + key + "0", false, false},
		{"uppercase pool", "Local@" + key, false, false},
		{"300 chars", strings.Repeat("a", 300), false, true},
		{"pool too long", strings.Repeat("a", 33) + "@" + key, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := ParseSnapshotID(tt.in)
			if tt.ok {
				if err != nil {
					t.Fatalf("ParseSnapshotID(%q): %v", tt.in, err)
				}
				if id.String() != tt.in {
					t.Fatalf("round trip: %q != %q", id.String(), tt.in)
				}
				if _, err := ParseVolumeID(tt.in); err == nil {
					t.Fatalf("snapshot ID %q also parses as a volume ID", tt.in)
				}
				return
			}
			if !errors.Is(err, ErrInvalidID) {
				t.Fatalf("ParseSnapshotID(%q) = %v, %v; want ErrInvalidID", tt.in, id, err)
			}
			if got := HostileID(tt.in); got != tt.hostile {
				t.Fatalf("HostileID(%q) = %v, want %v", tt.in, got, tt.hostile)
			}
		})
	}
}

func TestVolumeIDIsNeverASnapshotID(t *testing.T) {
	vid := NewVolumeID("local", "x").String()
	if _, err := ParseSnapshotID(vid); err == nil {
		t.Fatalf("volume ID %q parses as a snapshot ID", vid)
	}
}

// TestCopyImageSparse copies a file with holes on the test's filesystem and checks
// the copy has the same bytes, the asked size, and no more allocated blocks than
// the source (holes stay holes, whichever method was used).
func TestCopyImageSparse(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	chunk := make([]byte, 1<<20)
	rand.Read(chunk)
	for _, off := range []int64{0, 40 << 20, 63 << 20} {
		if _, err := f.WriteAt(chunk, off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()

	dst := filepath.Join(dir, "dst")
	method, err := fsx.CopyImage(context.Background(), src, dst, 128<<20)
	if err != nil {
		t.Fatal(err)
	}
	if method != CopyReflink && method != CopyFull {
		t.Fatalf("method %q", method)
	}
	a, _ := os.ReadFile(src)
	b, _ := os.ReadFile(dst)
	if len(b) != 128<<20 {
		t.Fatalf("copy is %d bytes, want %d", len(b), 128<<20)
	}
	if !bytes.Equal(a, b[:len(a)]) || !bytes.Equal(b[len(a):], make([]byte, len(b)-len(a))) {
		t.Fatal("copy differs from its source")
	}
	var ss, ds unix.Stat_t
	if err := unix.Stat(src, &ss); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(dst, &ds); err != nil {
		t.Fatal(err)
	}
	if ds.Blocks > ss.Blocks+8 {
		t.Fatalf("copy allocates %d blocks, its source %d: holes were filled", ds.Blocks, ss.Blocks)
	}
	t.Logf("method %s, source %d KiB allocated, copy %d KiB", method, ss.Blocks/2, ds.Blocks/2)

	if _, err := fsx.CopyImage(context.Background(), src, dst, 0); !errors.Is(err, os.ErrExist) {
		t.Fatalf("copy over an existing file: %v, want ErrExist", err)
	}
}

func TestSnapshotReserveListDelete(t *testing.T) {
	p, err := Open(Config{Name: "t", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	src := &Volume{ID: NewVolumeID("t", "v1").String(), Layout: LayoutImage, AccessType: AccessFilesystem, FSType: "ext4", CapacityBytes: 64 << 20}
	s, err := p.Snapshots().Reserve(ctx, "snap", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	if s.ReadyToUse || s.ID != NewSnapshotID("t", "snap").String() || s.SizeBytes != 64<<20 {
		t.Fatalf("reserved %+v", s)
	}
	again, err := p.Snapshots().Reserve(ctx, "snap", src, 0)
	if err != nil || again.ID != s.ID {
		t.Fatalf("retry: %+v, %v", again, err)
	}
	other := *src
	other.ID = NewVolumeID("t", "v2").String()
	if _, err := p.Snapshots().Reserve(ctx, "snap", &other, 0); !errors.Is(err, ErrExists) {
		t.Fatalf("same name, other source: %v, want ErrExists", err)
	}
	if _, err := p.Snapshots().Reserve(ctx, "big", src, 1<<60); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("snapshot larger than the pool: %v, want ErrNoSpace", err)
	}
	list, err := p.Snapshots().List()
	if err != nil || len(list) != 1 || list[0].Snapshot == nil || list[0].Snapshot.Name != "snap" {
		t.Fatalf("list: %+v, %v", list, err)
	}
	id, _ := ParseSnapshotID(s.ID)
	for range 2 {
		if err := p.Snapshots().Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if list, _ := p.Snapshots().List(); len(list) != 0 {
		t.Fatalf("after delete: %+v", list)
	}
}

// TestCopyImageReflink copies on filesystems that share extents: the copy must be a
// reflink (no data copied) with the same bytes, grown to the asked size.
func TestCopyImageReflink(t *testing.T) {
	tests := []struct {
		fsType string
		size   int64
		args   []string
	}{
		{"btrfs", 256 << 20, nil},
		{"xfs", 320 << 20, []string{"-m", "reflink=1"}},
	}
	for _, tt := range tests {
		t.Run(tt.fsType, func(t *testing.T) {
			mnt := testutil.LoopFS(t, t.TempDir(), tt.fsType, tt.size, tt.args...)
			src := filepath.Join(mnt, "src")
			data := make([]byte, 4<<20)
			rand.Read(data)
			if err := os.WriteFile(src, data, 0o600); err != nil {
				t.Fatal(err)
			}
			dst := filepath.Join(mnt, "dst")
			method, err := fsx.CopyImage(context.Background(), src, dst, 8<<20)
			if err != nil {
				t.Fatal(err)
			}
			if method != CopyReflink {
				t.Fatalf("method %q on %s, want %q", method, tt.fsType, CopyReflink)
			}
			got, _ := os.ReadFile(dst)
			if len(got) != 8<<20 || !bytes.Equal(got[:len(data)], data) {
				t.Fatalf("copy differs from its source (%d bytes)", len(got))
			}
		})
	}
}

// TestUsageCountsSnapshots: a snapshot's blocks are counted, and a reflinked one's
// are also a promise (writes to its source will unshare them).
func TestUsageCountsSnapshots(t *testing.T) {
	p, err := Open(Config{Name: "t", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	src := &Volume{ID: NewVolumeID("t", "v").String(), Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: 64 << 20}
	before, err := p.Ledger().Usage()
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, method string
		unbacked     int64
	}{{"copied", CopyFull, 0}, {"reflinked", CopyReflink, 5 << 20}} {
		s, err := p.Snapshots().Reserve(context.Background(), tt.name, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		s.CopyMethod, s.AllocatedBytes, s.ReadyToUse = tt.method, 5<<20, true
		if err := p.Snapshots().save(s); err != nil {
			t.Fatal(err)
		}
	}
	after, err := p.Ledger().Usage()
	if err != nil {
		t.Fatal(err)
	}
	if after.Snapshots != 2 || after.SnapshotBytes != 10<<20 {
		t.Errorf("usage counts %d snapshots, %d bytes; want 2, %d", after.Snapshots, after.SnapshotBytes, 10<<20)
	}
	if got := after.UnbackedBytes - before.UnbackedBytes; got != 5<<20 {
		t.Errorf("snapshots add %d unbacked bytes, want %d (the reflinked one's)", got, 5<<20)
	}
}
