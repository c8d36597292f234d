package fence

import (
	"slices"
	"testing"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount"
)

// TestAttachedWriters: which records a renewal checks the pool's path
// against: those whose device the kernel shows attached and not fenced (or
// cannot identify while a record names it), never a stale record.
func TestAttachedWriters(t *testing.T) {
	rec := layout.StageRecord{Volume: "shared.a", FileDev: 40, FileIno: 7, Device: "/dev/loop1"}
	stale := layout.StageRecord{Volume: "shared.b", FileDev: 40, FileIno: 8, Device: "/dev/loop2"}
	for _, tc := range []struct {
		name string
		devs []mount.LoopDevice
		want []string
	}{
		{"attached", []mount.LoopDevice{{Device: "/dev/loop1", Dev: 40, Ino: 7}}, []string{"shared.a"}},
		{"fenced: writes nothing", []mount.LoopDevice{{Device: "/dev/loop1", Dev: 40, Ino: 7, Fenced: true}}, nil},
		{"unidentified, named by the record", []mount.LoopDevice{{Device: "/dev/loop1", Err: mount.ErrNotIdentified}}, []string{"shared.a"}},
		{"the record's device bound to another file", []mount.LoopDevice{{Device: "/dev/loop1", Dev: 40, Ino: 9}}, nil},
		{"nothing attached", nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, r := range attached([]layout.StageRecord{rec, stale}, tc.devs) {
				got = append(got, r.Volume)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("attached = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestSameImage: the path's identity matches a record's, or that of the
// other record of the same volume and device (the file's stat and the
// kernel's identity differ on btrfs subvolumes; NoteDevice keeps both).
func TestSameImage(t *testing.T) {
	kernel := layout.StageRecord{Volume: "shared.a", FileDev: 40, FileIno: 7, Device: "/dev/loop1"}
	stat := layout.StageRecord{Volume: "shared.a", FileDev: 52, FileIno: 7, Device: "/dev/loop1"}
	otherDev := layout.StageRecord{Volume: "shared.a", FileDev: 60, FileIno: 7, Device: "/dev/loop9"}
	recs := []layout.StageRecord{kernel, stat, otherDev}
	for _, tc := range []struct {
		name     string
		dev, ino uint64
		want     bool
	}{
		{"the record's own", 40, 7, true},
		{"the stat's, recorded beside it", 52, 7, true},
		{"another device's record", 60, 7, false},
		{"another file", 40, 8, false},
	} {
		if got := sameImage(recs, kernel, tc.dev, tc.ino); got != tc.want {
			t.Errorf("%s: sameImage = %v, want %v", tc.name, got, tc.want)
		}
	}
}
