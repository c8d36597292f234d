package pool

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzParseVolumeID: whatever parses is exactly "<pool>.<32 hex>" (or a share's
// "s-<16 hex>.<32 hex>.<share>" whose share is valid and names that pool),
// round-trips, and can never name a path outside the pool.
func FuzzParseVolumeID(f *testing.F) {
	for _, s := range []string{"local.0123456789abcdef0123456789abcdef", "../etc", "a./b", "local.", ".x", "a.b.c", "a\x00.b", strings.Repeat("a", 300),
		NewShareVolumeID(ShareRef{Type: "nfs", Source: "nfs.example.com:/export"}, "pvc-1").String()} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, err := ParseVolumeID(s)
		if err == nil {
			if id.String() != s || strings.ContainsAny(s, "/\x00") || strings.Contains(s, "..") || len(id.Key) != 32 {
				t.Fatalf("accepted %q as %+v", s, id)
			}
			if r, ok := id.ShareRef(); ok != (id.Share != "") || (ok && (r.Validate() != nil || r.PoolName() != id.Pool)) {
				t.Fatalf("accepted %q with share %+v", s, r)
			}
		}
		sid, err := ParseSnapshotID(s)
		if err == nil && (sid.String() != s || strings.ContainsAny(s, "/\x00") || strings.Contains(s, "..")) {
			t.Fatalf("accepted snapshot %q as %+v", s, sid)
		}
	})
}

// FuzzLoad: volume.json is input. Whatever Load accepts passes validation (a
// size in range, known layout and state), and nothing panics.
func FuzzLoad(f *testing.F) {
	f.Add([]byte(`{"schemaVersion":1,"id":"t.4c94485e0c21ae6c41ce1dfe7b6bface","name":"v","pool":"t","layout":"image","accessType":"block","capacityBytes":1048576,"state":"ready"}`))
	f.Add([]byte(`{"schemaVersion":99}`))
	f.Add([]byte(`{"capacityBytes":-1}`))
	f.Add([]byte(`{`))
	dir := f.TempDir()
	p, err := Open(Config{Name: "t", Path: filepath.Join(dir, "pool")})
	if err != nil {
		f.Fatal(err)
	}
	v, err := p.Reserve(context.Background(), Spec{Name: "v", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
	if err != nil {
		f.Fatal(err)
	}
	id, _ := ParseVolumeID(v.ID)
	meta := p.MetadataPath(id)
	f.Fuzz(func(t *testing.T, raw []byte) {
		if err := os.WriteFile(meta, raw, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := p.Load(id)
		if err != nil {
			return
		}
		if got.CapacityBytes <= 0 || got.CapacityBytes > MaxCapacity || (got.Layout != LayoutImage && got.Layout != LayoutDir) ||
			(got.State != StateReady && got.State != StateCreating) || got.ID != id.String() {
			t.Fatalf("accepted %q as %+v", raw, got)
		}
	})
}
