package pool

import (
	"encoding/base64"
	"errors"
	"strings"
	"testing"
)

func TestShareRefValidate(t *testing.T) {
	tests := []struct {
		name string
		ref  ShareRef
		ok   bool
	}{
		{"nfs", ShareRef{"nfs", "nfs.example.com:/export/poolcsi"}, true},
		{"nfs4 ip", ShareRef{"nfs4", "10.0.0.1:/"}, true},
		{"ceph monitors", ShareRef{"ceph", "10.0.0.1,10.0.0.2:/volumes/csi"}, true},
		{"ceph-fuse compat source", ShareRef{"fuse.ceph", "id=admin,client_mountpoint=/x"}, true},
		{"bind", ShareRef{"bind", "/srv/export"}, true},
		{"longest", ShareRef{"nfs", strings.Repeat("a", MaxShareLength-4)}, true},
		{"too long", ShareRef{"nfs", strings.Repeat("a", MaxShareLength-3)}, false},
		{"empty type", ShareRef{"", "x:/y"}, false},
		{"uppercase type", ShareRef{"NFS", "x:/y"}, false},
		{"type with space", ShareRef{"n fs", "x:/y"}, false},
		{"empty source", ShareRef{"nfs", ""}, false},
		{"source is an option", ShareRef{"nfs", "-oremount"}, false},
		{"space", ShareRef{"nfs", "x:/a b"}, false},
		{"newline", ShareRef{"nfs", "x:/a\nb"}, false},
		{"NUL", ShareRef{"nfs", "x:/a\x00"}, false},
		{"shell", ShareRef{"fuse.ceph", "id=a;reboot"}, false},
		{"dollar", ShareRef{"fuse.ceph", "id=$(reboot)"}, false},
		{"quote", ShareRef{"nfs", `x:/"a"`}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.ref.Validate()
			if tt.ok != (err == nil) {
				t.Fatalf("Validate(%+v) = %v, want ok=%t", tt.ref, err, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalidID) {
				t.Fatalf("Validate(%+v) = %v, want ErrInvalidID", tt.ref, err)
			}
			if !tt.ok {
				return
			}
			id := NewShareVolumeID(tt.ref, "pvc-1")
			if len(id.String()) > MaxVolumeIDLength {
				t.Fatalf("ID %q is %d bytes", id, len(id.String()))
			}
			back, err := ParseVolumeID(id.String())
			if err != nil || back != id {
				t.Fatalf("ParseVolumeID(%q) = %+v, %v", id, back, err)
			}
			if r, ok := back.ShareRef(); !ok || r != tt.ref {
				t.Fatalf("ShareRef of %q = %+v, %t", id, r, ok)
			}
			// The share part is decoded once, by the parse: the ID keeps it.
			if back.ref != tt.ref {
				t.Fatalf("ParseVolumeID(%q) kept share %+v, want %+v", id, back.ref, tt.ref)
			}
			if !IsSharePoolName(tt.ref.PoolName()) || ValidatePoolName(tt.ref.PoolName()) != nil {
				t.Fatalf("pool name %q", tt.ref.PoolName())
			}
		})
	}
}

// TestParseShareVolumeID: a share's ID is strict too, and cannot be forged
// into pairing one share's pool with another source.
func TestParseShareVolumeID(t *testing.T) {
	ref := ShareRef{"nfs", "nfs.example.com:/export"}
	other := ShareRef{"nfs", "evil.example.com:/"}
	key := KeyForName("pvc-1")
	enc := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	good := NewShareVolumeID(ref, "pvc-1").String()
	tests := []struct {
		name string
		in   string
		ok   bool
	}{
		{"valid", good, true},
		{"old form still parses", "local." + key, true},
		{"share pool without its share", ref.PoolName() + "." + key, false},
		{"configured pool with a share", "local." + key + "." + enc("nfs x:/"), false},
		{"other share's source", ref.PoolName() + "." + key + "." + enc(other.String()), false},
		{"padded base64", good + "=", false},
		{"standard base64 alphabet", ref.PoolName() + "." + key + "." + strings.ReplaceAll(enc("nfs a:/?>?"), "_", "/"), false},
		{"no source", ref.PoolName() + "." + key + "." + enc("nfs"), false},
		{"forbidden character", ShareRef{"nfs", "x:/a b"}.PoolName() + "." + key + "." + enc("nfs x:/a b"), false},
		{"four parts", good + ".x", false},
		{"too long", ShareRef{"nfs", "x"}.PoolName() + "." + key + "." + enc("nfs "+strings.Repeat("a", 60)), false},
		{"empty share part", ref.PoolName() + "." + key + ".", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := ParseVolumeID(tt.in)
			if tt.ok {
				if err != nil || id.String() != tt.in {
					t.Fatalf("ParseVolumeID(%q) = %+v, %v", tt.in, id, err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidID) {
				t.Fatalf("ParseVolumeID(%q) = %+v, %v; want ErrInvalidID", tt.in, id, err)
			}
		})
	}
}

// TestSharePoolLayout: a share's pool is never laid out by itself (an ID
// named the share, the driver mounted it to look), only by LayOut; its
// pool.json records the share, so an operator tool opening the directory
// knows its volume IDs.
func TestSharePoolLayout(t *testing.T) {
	ref := ShareRef{Type: "nfs", Source: "nfs.example.com:/export"}
	dir := t.TempDir()
	cfg := Config{Name: ref.PoolName(), Path: dir, Shared: true, RequireMount: true, Share: &ref, NoLayout: true}
	cfg.RequireMount = false // a plain directory stands for the mounted share
	p, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Check(); !errors.Is(err, ErrUnavailable) || p.LaidOut() {
		t.Fatalf("Check of a share without a pool: %v (laid out: %t)", err, p.LaidOut())
	}
	if err := p.LayOut(); err != nil {
		t.Fatal(err)
	}
	v, err := p.Reserve(t.Context(), Spec{Name: "pvc-1", Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: MiB})
	if err != nil {
		t.Fatal(err)
	}
	if v.ID != NewShareVolumeID(ref, "pvc-1").String() {
		t.Fatalf("volume ID %s", v.ID)
	}
	again, err := OpenExisting(dir)
	if err != nil {
		t.Fatal(err)
	}
	if again.cfg.Share == nil || *again.cfg.Share != ref {
		t.Fatalf("pool.json gave share %+v", again.cfg.Share)
	}
	if _, err := again.Load(again.NewID("pvc-1")); err != nil {
		t.Fatalf("an operator tool reads the share's volume: %v", err)
	}
	if _, err := Open(Config{Name: "s-0000000000000000", Path: dir, Shared: true, Share: &ref}); err == nil {
		t.Fatal("a share opened under another pool name")
	}
}

// TestParseShareSnapshotID: a share's snapshot ID follows its volume IDs'
// rules.
func TestParseShareSnapshotID(t *testing.T) {
	ref := ShareRef{"nfs", "nfs.example.com:/export"}
	dir := t.TempDir()
	p, err := Open(Config{Name: ref.PoolName(), Path: dir, Shared: true, Share: &ref, NoLayout: true})
	if err != nil {
		t.Fatal(err)
	}
	good := p.Snapshots().NewID("snap").String()
	key := KeyForName("snap")
	enc := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	for _, tt := range []struct {
		in string
		ok bool
	}{
		{good, true},
		{"local@" + key, true},
		{ref.PoolName() + "@" + key, false},
		{"local@" + key + "." + enc("nfs x:/"), false},
		{ref.PoolName() + "@" + key + "." + enc("nfs evil:/"), false},
		{good + ".x", false},
		{good + "=", false},
	} {
		id, err := ParseSnapshotID(tt.in)
		if tt.ok != (err == nil) || (err == nil && id.String() != tt.in) {
			t.Errorf("ParseSnapshotID(%q) = %+v, %v; want ok=%t", tt.in, id, err, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalidID) {
			t.Errorf("ParseSnapshotID(%q) = %v, want ErrInvalidID", tt.in, err)
		}
	}
	if _, err := ParseVolumeID(good); err == nil {
		t.Fatal("a snapshot ID parsed as a volume ID")
	}
}
