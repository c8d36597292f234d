package params

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

func TestPodUID(t *testing.T) {
	for _, tt := range []struct {
		name    string
		vc      map[string]string
		want    string
		wantErr bool
	}{
		{"none", nil, "", false},
		{"empty", map[string]string{PodUIDKey: ""}, "", false},
		{"uuid", map[string]string{PodUIDKey: "0b6d6f4e-8f3c-4f7a-9d2e-1c2b3a4d5e6f"}, "0b6d6f4e-8f3c-4f7a-9d2e-1c2b3a4d5e6f", false},
		{"a path", map[string]string{PodUIDKey: "../../x"}, "", true},
		{"a static pod's hash", map[string]string{PodUIDKey: "6e1f0a5c8b2d4e7f9a3b5c7d9e1f3a5b"}, "", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := PodUID(tt.vc)
			if got != tt.want || (err != nil) != tt.wantErr {
				t.Fatalf("PodUID = %q, %v; want %q, error %t", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestCapsReadOnly(t *testing.T) {
	rox, rwo := csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	for _, tt := range []struct {
		modes []csi.VolumeCapability_AccessMode_Mode
		want  bool
	}{
		{nil, false},
		{[]csi.VolumeCapability_AccessMode_Mode{rox}, true},
		{[]csi.VolumeCapability_AccessMode_Mode{csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY, rox}, true},
		{[]csi.VolumeCapability_AccessMode_Mode{rox, rwo}, false},
	} {
		if got := (Caps{Modes: tt.modes}).ReadOnly(); got != tt.want {
			t.Errorf("Caps{Modes: %v}.ReadOnly() = %t, want %t", tt.modes, got, tt.want)
		}
	}
}
