package pool

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParseGroupSnapshotID(t *testing.T) {
	key := KeyForName("g")
	for _, tc := range []struct {
		name string
		in   string
		ok   bool
	}{
		{"valid", "local@g-" + key, true},
		{"a snapshot ID", "local@" + key, false},
		{"a volume ID", "local." + key, false},
		{"no key", "local@g-", false},
		{"traversal", "local@g-../../etc", false},
		{"traversal in pool", "../x@g-" + key, false},
		{"NUL", "local@g-" + key[:31] + "\x00", false},
		{"uppercase", "local@g-" + strings.ToUpper(key), false},
		{"empty", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := ParseGroupSnapshotID(tc.in)
			if (err == nil) != tc.ok {
				t.Fatalf("ParseGroupSnapshotID(%q) = %v, %v", tc.in, id, err)
			}
			if tc.ok && id.String() != tc.in {
				t.Errorf("String() = %q, want %q", id.String(), tc.in)
			}
			if _, err := ParseSnapshotID(tc.in); tc.ok && err == nil {
				t.Errorf("%q parses as a snapshot ID too", tc.in)
			}
		})
	}
}

// A group record is read through the bounded reader and trusted only when
// each member is the snapshot derived from the group and its volume: a
// planted record cannot make a group delete remove another snapshot.
func TestLoadGroupSnapshotRefusesForeignMembers(t *testing.T) {
	p, err := Initialise(Config{Name: "local", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	vids := []VolumeID{p.NewID("b"), p.NewID("a")}
	g, err := p.Groups().Reserve(ctx, "db", vids)
	if err != nil {
		t.Fatal(err)
	}
	gid := p.Groups().NewID("db")
	if got, err := p.Groups().Load(gid); err != nil || len(got.Members) != 2 || got.Members[0].SourceVolumeID >= got.Members[1].SourceVolumeID {
		t.Fatalf("load: %v, %v", got, err)
	}
	if _, err := p.Groups().Reserve(ctx, "db", vids[:1]); !errors.Is(err, ErrExists) {
		t.Errorf("same name, other volumes: %v, want ErrExists", err)
	}
	if _, err := p.Groups().Reserve(ctx, "x", []VolumeID{vids[0], vids[0]}); !errors.Is(err, ErrInvalidID) {
		t.Errorf("a volume twice: %v, want ErrInvalidID", err)
	}
	path := filepath.Join(p.cfg.Path, groupsDir, gid.Key, groupMetaFile)
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	foreign := strings.Replace(string(raw), g.Members[0].SnapshotID, "local@"+KeyForName("someone-elses"), 1)
	for name, content := range map[string]string{
		"foreign member": foreign,
		"huge":           strings.Repeat(" ", maxGroupMeta+1),
		"not json":       "{",
	} {
		t.Run(name, func(t *testing.T) {
			if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Groups().Load(gid); !errors.Is(err, ErrCorrupt) {
				t.Errorf("load: %v, want ErrCorrupt", err)
			}
		})
	}
	if err := p.Groups().Delete(ctx, gid); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Groups().Load(gid); !errors.Is(err, ErrNotFound) {
		t.Errorf("after delete: %v, want ErrNotFound", err)
	}
	if err := p.Groups().Delete(ctx, gid); err != nil {
		t.Errorf("second delete: %v", err)
	}
}

// A part of a group across nodes records every volume of the group; what it
// records is checked when it is made and when it is read, and the member IDs of
// the whole group are the ones each node derives.
func TestGroupPart(t *testing.T) {
	p, err := Initialise(Config{Name: "local", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	mine := []VolumeID{p.NewID("a")}
	remote := p.NewID("b").String()
	all := []string{mine[0].String(), remote}
	slices.Sort(all)
	for name, bad := range map[string][]string{
		"without its members": {remote},
		"unsorted":            {all[1], all[0]},
		"a path":              {mine[0].String(), "../x"},
		"another pool":        {mine[0].String(), "other." + KeyForName("b")},
		"a volume twice":      {mine[0].String(), mine[0].String()},
	} {
		if _, err := p.Groups().ReservePart(ctx, "db", mine, bad); !errors.Is(err, ErrInvalidID) {
			t.Errorf("%s: %v, want ErrInvalidID", name, err)
		}
	}
	g, err := p.Groups().ReservePart(ctx, "db", mine, all)
	if err != nil {
		t.Fatal(err)
	}
	gid := p.Groups().NewID("db")
	want := []string{GroupMemberID(gid, all[0]).String(), GroupMemberID(gid, all[1]).String()}
	slices.Sort(want)
	if got := p.Groups().MemberIDs(gid, g); !slices.Equal(got, want) || want[0] == want[1] {
		t.Errorf("member IDs %v, want %v", got, want)
	}
	if GroupMemberID(gid, mine[0].String()) != p.Groups().MemberID(gid, mine[0].String()) {
		t.Error("GroupMemberID is not the pool's MemberID")
	}
	if _, err := p.Groups().ReservePart(ctx, "db", mine, nil); !errors.Is(err, ErrExists) {
		t.Errorf("the whole group of the same name: %v, want ErrExists", err)
	}
	if got, err := p.Groups().Load(gid); err != nil || !slices.Equal(got.GroupSources, all) {
		t.Fatalf("load: %v %v", got, err)
	}
	path := filepath.Join(p.cfg.Path, groupsDir, gid.Key, groupMetaFile)
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	planted := strings.Replace(string(raw), `"`+remote+`"`, `"../../etc"`, 1)
	if err := os.WriteFile(path, []byte(planted), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Groups().Load(gid); !errors.Is(err, ErrCorrupt) {
		t.Errorf("a planted groupSources: %v, want ErrCorrupt", err)
	}
}
