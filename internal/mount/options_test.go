package mount

import (
	"errors"
	"strings"
	"testing"
)

func TestCheckOptions(t *testing.T) {
	for _, tc := range []struct {
		fs   string
		opts []string
		ok   bool
	}{
		{"ext4", nil, true},
		{"ext4", []string{"noatime", "discard", "data=ordered", "commit=30", "errors=remount-ro"}, true},
		{"xfs", []string{"nouuid", "logbsize=256k", "inode64"}, true},
		{"btrfs", []string{"compress=zstd:3", "space_cache=v2", "ssd"}, true},
		{"", []string{"ro", "nosuid", "nodev"}, true},
		{"ext4", []string{"loop"}, false},
		{"ext4", []string{"offset=4096"}, false},
		{"ext4", []string{"sizelimit=1"}, false},
		{"ext4", []string{"errors=panic"}, false},
		{"btrfs", []string{"subvol=/other"}, false},
		{"btrfs", []string{"device=/dev/sda"}, false},
		{"xfs", []string{"data=ordered"}, false}, // an ext4 option
		{"", []string{"discard"}, false},
		{"ext4", []string{"noatime,loop"}, false},
		{"ext4", []string{"commit=1x"}, false},
		{"ext4", []string{""}, false},
	} {
		err := CheckOptions(tc.fs, tc.opts)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrOptionRefused)) {
			t.Errorf("CheckOptions(%q, %q) = %v, want ok=%t", tc.fs, tc.opts, err, tc.ok)
		}
	}
}

// FuzzCheckOptions: nothing is accepted that could carry a second option or a
// way out of the volume, and nothing panics.
func FuzzCheckOptions(f *testing.F) {
	for _, s := range []string{"noatime", "loop", "offset=0", "data=journal", "compress=zstd:3", "subvol=/", "a,b", "errors=panic"} {
		f.Add("ext4", s)
		f.Add("btrfs", s)
	}
	f.Fuzz(func(t *testing.T, fs, o string) {
		if CheckOptions(fs, []string{o}) != nil {
			return
		}
		for _, bad := range []string{",", "\x00", "loop", "offset", "sizelimit", "subvol", "device", "panic"} {
			if strings.Contains(o, bad) {
				t.Fatalf("accepted %q for %q", o, fs)
			}
		}
	})
}
