package pool

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func openTemp(t *testing.T) *Pool {
	t.Helper()
	p, err := Open(Config{Name: "test", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestOpenRefusesForeignPool(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	if _, err := Open(Config{Name: "one", Path: dir}); err != nil {
		t.Fatal(err)
	}
	// Another name over the directory: that pool is unavailable, with the
	// reason (not fatal: one pool never stops a driver), and never laid out
	// again under the new name.
	two, err := Open(Config{Name: "two", Path: dir})
	if err != nil {
		t.Fatalf("Open of a foreign pool's directory failed instead of making the pool unavailable: %v", err)
	}
	if err := two.Check(); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), `belongs to pool "one"`) {
		t.Fatalf("Check of pool two over pool one's directory: %v", err)
	}
	if _, err := Initialise(Config{Name: "two", Path: dir, Shared: true}); err == nil {
		t.Fatal("pool init laid out pool two over pool one")
	}
	for _, bad := range []Config{{Name: "x", Path: "relative"}, {Name: "x", Path: "/"}, {Name: "x", Path: "/a/../b"}, {Name: "../x", Path: "/tmp/x"}} {
		if _, err := Open(bad); err == nil {
			t.Errorf("Open(%+v) accepted", bad)
		}
	}
}

func TestSharedPoolIsNeverCreated(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "not-mounted")
	p, err := Open(Config{Name: "s", Path: dir, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("shared pool path was created: %v", err)
	}
	if err := p.Check(); err == nil {
		t.Fatal("Check passed on a missing shared pool")
	}
}

func TestReserveIsIdempotentAndAtomic(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	spec := Spec{Name: "pvc-a", Layout: LayoutImage, AccessType: AccessFilesystem, FSType: "ext4", CapacityBytes: 8 * MiB}
	v1, err := p.Reserve(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Images().Prepare(v1); err != nil {
		t.Fatal(err)
	}
	if err := p.MarkReady(v1); err != nil {
		t.Fatal(err)
	}
	v2, err := p.Reserve(ctx, spec)
	if err != nil || v2.ID != v1.ID || v2.State != StateReady {
		t.Fatalf("second Reserve = %+v, %v", v2, err)
	}
	if err := p.Images().Prepare(v2); err == nil {
		t.Fatal("Images().Prepare recreated the image of a ready volume")
	}
	fi, err := os.Stat(p.ImagePath(NewVolumeID("test", "pvc-a")))
	if err != nil || fi.Size() != 8*MiB {
		t.Fatalf("image: %v, %v", fi, err)
	}
	// No temp files are left beside volume.json.
	des, _ := os.ReadDir(p.Dir(NewVolumeID("test", "pvc-a")))
	for _, de := range des {
		if de.Name() != "volume.json" && de.Name() != "disk.img" && de.Name() != "lock" {
			t.Errorf("unexpected file %s", de.Name())
		}
	}
	raw, _ := os.ReadFile(filepath.Join(p.Dir(NewVolumeID("test", "pvc-a")), "volume.json"))
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil || m["schemaVersion"] != float64(SchemaVersion) {
		t.Fatalf("volume.json: %s (%v)", raw, err)
	}
}

// TestReserveAfterLostCreatingRecord is the crash Reserve no longer fsyncs
// against: the creating record's rename is lost (or only its temp file
// survives), leaving a volume directory with a half-made image and no
// volume.json. The retried create must make the volume as if new.
func TestReserveAfterLostCreatingRecord(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	spec := Spec{Name: "pvc-lost", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: 8 * MiB}
	v, err := p.Reserve(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Images().Prepare(v); err != nil {
		t.Fatal(err)
	}
	id := NewVolumeID("test", "pvc-lost")
	meta := filepath.Join(p.Dir(id), "volume.json")
	raw, err := os.ReadFile(meta)
	if err != nil {
		t.Fatal(err)
	}
	// What a crash can leave: the temp file, not renamed, and no volume.json.
	if err := os.WriteFile(filepath.Join(p.Dir(id), ".volume.json.tmp-1"), raw, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(meta); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p.ImagePath(id), 1); err != nil {
		t.Fatal(err)
	}
	v, err = p.Reserve(ctx, spec)
	if err != nil || v.State != StateCreating {
		t.Fatalf("retried Reserve = %+v, %v", v, err)
	}
	if err := p.Images().Prepare(v); err != nil {
		t.Fatal(err)
	}
	if err := p.Images().Sync(id); err != nil {
		t.Fatal(err)
	}
	if err := p.MarkReady(v); err != nil {
		t.Fatal(err)
	}
	got, err := p.Load(id)
	if err != nil || got.State != StateReady {
		t.Fatalf("Load = %+v, %v", got, err)
	}
	if fi, err := os.Stat(p.ImagePath(id)); err != nil || fi.Size() != 8*MiB {
		t.Fatalf("image after the retried create: %v, %v", fi, err)
	}
}

func TestReserveRefusesWhenFull(t *testing.T) {
	p := openTemp(t)
	u, err := p.Ledger().Usage()
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Reserve(context.Background(), Spec{Name: "huge", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: u.FreeBytes + GiB})
	if !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Reserve beyond free space = %v, want ErrNoSpace", err)
	}
	if entries, _ := p.List(); len(entries) != 0 {
		t.Fatalf("a refused volume left %d entries", len(entries))
	}
}

func TestDeleteRemovesOnlyTheVolume(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	for _, n := range []string{"a", "b"} {
		v, err := p.Reserve(ctx, Spec{Name: n, Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Images().Prepare(v); err != nil {
			t.Fatal(err)
		}
	}
	canary := filepath.Join(p.cfg.Path, "canary")
	os.WriteFile(canary, []byte("x"), 0o600)
	if err := p.Delete(ctx, NewVolumeID("test", "a")); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete(ctx, NewVolumeID("test", "a")); err != nil {
		t.Fatalf("second delete: %v", err)
	}
	entries, _ := p.List()
	if len(entries) != 1 || entries[0].Volume.Name != "b" {
		t.Fatalf("after delete: %+v", entries)
	}
	if _, err := os.Stat(canary); err != nil {
		t.Fatal("delete touched a file outside the volume")
	}
}

func TestLockVolumeExcludesAndSeesDeletion(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	id := NewVolumeID("test", "v")
	if _, err := p.Reserve(ctx, Spec{Name: "v", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB}); err != nil {
		t.Fatal(err)
	}
	unlock, err := p.LockVolume(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := p.LockVolume(short, id); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second lock while held = %v, want deadline exceeded", err)
	}
	var wg sync.WaitGroup
	var waitErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, waitErr = p.LockVolume(ctx, id)
	}()
	time.Sleep(20 * time.Millisecond)
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	unlock()
	wg.Wait()
	if !errors.Is(waitErr, ErrNotFound) {
		t.Fatalf("a waiter on a deleted volume got %v, want ErrNotFound", waitErr)
	}
}

// Only a volume or snapshot that is not there is ErrNotFound. A pool whose
// directory is gone is unavailable, although every cause in its chain is an
// ENOENT (wrapped, so the message and errors.Is keep it): it must never read
// as a missing volume, which DeleteVolume would answer with success.
func TestNotFoundIsOnlyAMissingVolume(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	if _, err := p.Reserve(ctx, Spec{Name: "v", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB}); err != nil {
		t.Fatal(err)
	}
	gone := NewVolumeID("test", "gone")
	if _, err := p.Load(gone); !errors.Is(err, ErrNotFound) {
		t.Errorf("Load of a missing volume: %v, want ErrNotFound", err)
	}
	if _, err := p.LockVolume(ctx, gone); !errors.Is(err, ErrNotFound) {
		t.Errorf("LockVolume of a missing volume: %v, want ErrNotFound", err)
	}
	if _, err := p.Snapshots().Load(p.Snapshots().NewID("s")); !errors.Is(err, ErrNotFound) {
		t.Errorf("Snapshots().Load of a missing snapshot: %v, want ErrNotFound", err)
	}
	if _, err := p.Images().Size(NewVolumeID("test", "v")); !errors.Is(err, ErrNotFound) {
		t.Errorf("Images().Size of a volume without its image: %v, want ErrNotFound", err)
	}
	if _, err := p.Snapshots().SourceAllocated(NewVolumeID("test", "v"), &Volume{Layout: LayoutImage}); !errors.Is(err, ErrNotFound) {
		t.Errorf("Snapshots().SourceAllocated of a volume without its image: %v, want ErrNotFound", err)
	}
	if _, err := p.Snapshots().SourceAllocated(NewVolumeID("test", "v"), &Volume{Layout: LayoutDir}); !errors.Is(err, ErrNotFound) {
		t.Errorf("Snapshots().SourceAllocated of a volume without its data directory: %v, want ErrNotFound", err)
	}
	if err := p.Images().Sync(NewVolumeID("test", "v")); !errors.Is(err, ErrNotFound) {
		t.Errorf("Images().Sync of a volume without its image: %v, want ErrNotFound", err)
	}
	if err := p.save(&Volume{ID: gone.String(), Name: "gone"}, true); !errors.Is(err, ErrNotFound) {
		t.Errorf("Save of a volume whose directory is gone: %v, want ErrNotFound", err)
	}

	if err := os.Rename(p.cfg.Path, p.cfg.Path+".away"); err != nil {
		t.Fatal(err)
	}
	id := NewVolumeID("test", "v")
	for name, err := range map[string]error{
		"Load":       func() error { _, err := p.Load(id); return err }(),
		"LockVolume": func() error { _, err := p.LockVolume(ctx, id); return err }(),
		"ImageSize":  func() error { _, err := p.Images().Size(id); return err }(),
		"SyncImage":  p.Images().Sync(id),
		"Save":       p.save(&Volume{ID: id.String(), Name: "v", CapacityBytes: MiB}, true),
		"List":       func() error { _, err := p.List(); return err }(),
		"Check":      p.Check(),
	} {
		if !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrNotFound) {
			t.Errorf("%s with the pool's directory gone: %v, want ErrUnavailable and not ErrNotFound", name, err)
		}
		if !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s with the pool's directory gone: the cause is no longer wrapped: %v", name, err)
		}
	}
}

func TestListReportsDamagedMetadata(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	if _, err := p.Reserve(ctx, Spec{Name: "v", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB}); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(p.Dir(NewVolumeID("test", "v")), "volume.json"), []byte("{garbage"), 0o600)
	entries, err := p.List()
	if err != nil || len(entries) != 1 || !errors.Is(entries[0].Err, ErrCorrupt) {
		t.Fatalf("List = %+v, %v", entries, err)
	}
}

func TestDeleteFinishesAnInterruptedDelete(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	v, err := p.Reserve(ctx, Spec{Name: "a", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Images().Prepare(v); err != nil {
		t.Fatal(err)
	}
	id := NewVolumeID("test", "a")
	// The state a crash between the rename and the removal leaves.
	trash := filepath.Join(p.cfg.Path, "volumes", ".deleting-"+id.Key)
	if err := os.Rename(p.Dir(id), trash); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(trash); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the retried delete left %s: %v", trash, err)
	}
}

func TestSharedPoolIsLaidOutOnlyOnRequest(t *testing.T) {
	dir := t.TempDir() // exists, empty: what an unmounted share looks like
	p, err := Open(Config{Name: "s", Path: dir, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Check(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Check of an uninitialised shared pool = %v, want ErrUnavailable", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("the driver wrote into what may be an unmounted share: %v", entries)
	}
	if _, err := Initialise(Config{Name: "s", Path: dir, Shared: true}); err != nil {
		t.Fatal(err)
	}
	if err := p.Check(); err != nil {
		t.Fatalf("Check after Initialise: %v", err)
	}
	if _, err := Initialise(Config{Name: "other", Path: dir, Shared: true}); err == nil {
		t.Fatal("Initialise gave a pool's directory a second name")
	}
	if _, err := Initialise(Config{Name: "s", Path: filepath.Join(dir, "unmounted", "pool"), Shared: true}); err == nil {
		t.Fatal("Initialise created a directory whose parent (the share) is missing")
	}
}

func TestInitialiseCreatesTheDirectory(t *testing.T) {
	root := t.TempDir()
	if _, err := Initialise(Config{Name: "share", Path: filepath.Join(root, "pool"), Shared: true}); err != nil {
		t.Fatalf("parent exists: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "pool", "pool.json")); err != nil {
		t.Fatal(err)
	}
	_, err := Initialise(Config{Name: "share", Path: filepath.Join(root, "not-mounted", "pool"), Shared: true})
	if err == nil || !strings.Contains(err.Error(), "mount the share") {
		t.Fatalf("missing parent: %v", err)
	}
}
