package pool

import (
	"errors"
	"strings"
	"testing"
)

func TestParseVolumeID(t *testing.T) {
	key := KeyForName("pvc-1")
	tests := []struct {
		name string
		in   string
		ok   bool
	}{
		{"valid", "local." + key, true},
		{"valid dashed pool", "my-pool." + key, true},
		{"empty", "", false},
		{"no dot", "local" + key, false},
		{"dotdot key", "local/../../etc." + key, false},
		{"slash in pool", "lo/cal." + key, false},
		{"parent as key", "local..", false},
		{"traversal key", "local.../../../../etc/passwd", false},
		{"NUL", "local." + key[:31] + "\x00", false},
		{"uppercase key", "local." + strings.ToUpper(key), false},
		{"short key", "local." + key[:31], false},
		{"long key", "local." + key + "0", false},
		{"two dots", "a.b." + key, false},
		{"uppercase pool", "Local." + key, false},
		{"300 chars", strings.Repeat("a", 300), false},
		{"pool too long", strings.Repeat("a", 33) + "." + key, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := ParseVolumeID(tt.in)
			if tt.ok {
				if err != nil {
					t.Fatalf("ParseVolumeID(%q): %v", tt.in, err)
				}
				if id.String() != tt.in {
					t.Fatalf("round trip: %q != %q", id.String(), tt.in)
				}
				return
			}
			if !errors.Is(err, ErrInvalidID) {
				t.Fatalf("ParseVolumeID(%q) = %v, %v; want ErrInvalidID", tt.in, id, err)
			}
		})
	}
}

func TestKeyForNameIsDeterministic(t *testing.T) {
	first, again := KeyForName("a"), KeyForName("a")
	if first != again || first == KeyForName("b") {
		t.Fatal("keys must be a function of the name only")
	}
	if got := NewVolumeID("p", "../../x").String(); !strings.HasPrefix(got, "p.") || strings.Contains(got, "/") {
		t.Fatalf("a hostile name leaked into the ID: %q", got)
	}
}

func TestValidateVolumeName(t *testing.T) {
	for _, bad := range []string{"", strings.Repeat("x", MaxNameLength+1), "a\x00b"} {
		if err := ValidateVolumeName(bad); !errors.Is(err, ErrInvalidID) {
			t.Errorf("ValidateVolumeName(%q) = %v, want ErrInvalidID", bad, err)
		}
	}
	for _, good := range []string{"pvc-0c4e1d0e-1f7b-4a2b-9a8c-3d1e2f3a4b5c", "../../etc", strings.Repeat("x", MaxNameLength)} {
		if err := ValidateVolumeName(good); err != nil {
			t.Errorf("ValidateVolumeName(%q) = %v", good, err)
		}
	}
}
