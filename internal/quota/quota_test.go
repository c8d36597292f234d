package quota

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"unsafe"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

func TestBtrfsCommandLines(t *testing.T) {
	tests := []struct {
		got, want []string
	}{
		{btrfsCreateArgs("/p/volumes/k/data"), []string{"subvolume", "create", "/p/volumes/k/data"}},
		{btrfsLimitArgs("/p/volumes/k/data", 50<<20), []string{"qgroup", "limit", "52428800", "/p/volumes/k/data"}},
		{btrfsDeleteArgs("/p/volumes/.deleting-k/data"), []string{"subvolume", "delete", "/p/volumes/.deleting-k/data"}},
		{btrfsDestroyArgs(261, "/p/volumes/.deleting-k"), []string{"qgroup", "destroy", "0/261", "/p/volumes/.deleting-k"}},
	}
	for _, tt := range tests {
		if !reflect.DeepEqual(tt.got, tt.want) {
			t.Errorf("got %q, want %q", tt.got, tt.want)
		}
	}
}

// TestProjectQuotaRequests checks the quotactl and ioctl requests the project
// backend sends, since this kernel cannot run them against a quota-enabled
// filesystem.
func TestProjectQuotaRequests(t *testing.T) {
	if got := qcmd(qSetQuota); got != 0x80000802 {
		t.Errorf("QCMD(Q_SETQUOTA, PRJQUOTA) = %#x, want 0x80000802", got)
	}
	if got := qcmd(qGetInfo); got != 0x80000502 {
		t.Errorf("QCMD(Q_GETINFO, PRJQUOTA) = %#x", got)
	}
	for _, tt := range []struct {
		limit  int64
		blocks uint64
	}{{50 << 20, 51200}, {1, 1}, {1025, 2}, {0, 0}} {
		if q := limitBlock(tt.limit); q.BHardLimit != tt.blocks || q.Valid != qifBLimit || q.BSoftLimit != 0 {
			t.Errorf("limitBlock(%d) = %+v, want %d hard 1 KiB blocks", tt.limit, q, tt.blocks)
		}
	}
	// struct sizes the kernel expects (sizeof in linux/quota.h and linux/fs.h).
	if s := sizeOf(ifDqblk{}); s != 72 {
		t.Errorf("sizeof(if_dqblk) = %d, want 72", s)
	}
	if s := sizeOf(fsxattr{}); s != 28 {
		t.Errorf("sizeof(fsxattr) = %d, want 28", s)
	}
	seen := map[uint32]string{}
	for _, key := range []string{"0123456789abcdef0123456789abcdef", "ffffffffffffffffffffffffffffffff", "00000000000000000000000000000000"} {
		id := ProjectID(key)
		if id < 1<<16 || id >= 1<<31 {
			t.Errorf("ProjectID(%s) = %d, outside [2^16, 2^31)", key, id)
		}
		if id != ProjectID(key) {
			t.Errorf("ProjectID is not stable")
		}
		if other, dup := seen[id]; dup {
			t.Errorf("keys %s and %s share project %d", key, other, id)
		}
		seen[id] = key
	}
}

func TestDetectXFSWithoutProjectQuota(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.xfs")
	mnt := testutil.LoopFS(t, t.TempDir(), "xfs", 320<<20, "-q")
	b := Detect(context.Background(), mnt)
	if b.Enforced() {
		// A kernel with project quota and a prjquota mount: nothing to show here.
		t.Skipf("project quota works here (%s)", b.Kind())
	}
	if b.Kind() != KindNone || !strings.Contains(b.Reason(), "prjquota") {
		t.Fatalf("Detect = %s %q, want none with how to enable project quota", b.Kind(), b.Reason())
	}
	// The project ID half works on XFS without quota: the inode keeps it.
	dir := filepath.Join(mnt, "vol")
	os.Mkdir(dir, 0o755)
	if err := SetProject(dir, 123456); err != nil {
		t.Fatal(err)
	}
	id, inherit, err := GetProject(dir)
	if err != nil || id != 123456 || !inherit {
		t.Fatalf("GetProject = %d %t %v", id, inherit, err)
	}
	os.Mkdir(filepath.Join(dir, "child"), 0o755)
	if id, _, _ := GetProject(filepath.Join(dir, "child")); id != 123456 {
		t.Fatalf("a new subdirectory got project %d, not the inherited 123456", id)
	}
}

func TestBtrfsQgroup(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.btrfs", "btrfs")
	ctx := context.Background()
	mnt := testutil.LoopFS(t, t.TempDir(), "btrfs", 256<<20)
	if b := Detect(ctx, mnt); b.Enforced() || !strings.Contains(b.Reason(), "btrfs quota enable") {
		t.Fatalf("quota off: Detect = %s %q, want none telling how to enable it", b.Kind(), b.Reason())
	}
	if out, err := exec.Command("btrfs", "quota", "enable", mnt).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	b := Detect(ctx, mnt)
	if b.Kind() != KindBtrfs {
		t.Fatalf("quota on: Detect = %s %q", b.Kind(), b.Reason())
	}
	dir := filepath.Join(mnt, "data")
	id, err := b.Create(ctx, dir, 8<<20, nil)
	if err != nil {
		t.Fatal(err)
	}
	if id < 256 {
		t.Fatalf("subvolume ID %d", id)
	}
	if err := b.SetLimit(ctx, dir, id, 16<<20); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "f"), make([]byte, 1<<20), 0o644)
	exec.Command("sync").Run()
	u, err := b.Usage(ctx, dir, id)
	if err != nil || u.LimitBytes != 16<<20 || u.UsedBytes < 1<<20 {
		t.Fatalf("Usage = %+v, %v", u, err)
	}
	if err := b.Remove(ctx, dir, id); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("subvolume still there: %v", err)
	}
}

func sizeOf[T any](v T) uintptr { return unsafe.Sizeof(v) }

// BenchmarkBtrfsUsage compares the sysfs read NodeGetVolumeStats uses with
// running `btrfs qgroup show` for the same numbers.
func BenchmarkBtrfsUsage(b *testing.B) {
	testutil.RequireRoot(b)
	testutil.RequireCommands(b, "mkfs.btrfs", "btrfs")
	ctx := context.Background()
	mnt := testutil.LoopFS(b, b.TempDir(), "btrfs", 256<<20)
	if out, err := exec.Command("btrfs", "quota", "enable", mnt).CombinedOutput(); err != nil {
		b.Fatalf("%v: %s", err, out)
	}
	be := Detect(ctx, mnt)
	dir := filepath.Join(mnt, "data")
	id, err := be.Create(ctx, dir, 8<<20, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("sysfs", func(b *testing.B) {
		for b.Loop() {
			if _, err := be.Usage(ctx, dir, id); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("command", func(b *testing.B) {
		for b.Loop() {
			if err := exec.Command("btrfs", "qgroup", "show", "--raw", "-re", "-f", dir).Run(); err != nil {
				b.Fatal(err)
			}
		}
	})
}
