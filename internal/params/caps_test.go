package params

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func mountCap(fs string, m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
	}
}

func blockCap(m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
	}
}

func TestParseCaps(t *testing.T) {
	rwo := csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	rox := csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	tests := []struct {
		name      string
		caps      []*csi.VolumeCapability
		defaultFS string
		want      Caps
		ok        bool
	}{
		{"none", nil, "", Caps{}, false},
		{"nil entry", []*csi.VolumeCapability{nil}, "", Caps{}, false},
		{"mount, default fs", []*csi.VolumeCapability{mountCap("", rwo)}, DefaultFSType, Caps{Access: pool.AccessFilesystem, FSType: "ext4", Modes: []csi.VolumeCapability_AccessMode_Mode{rwo}}, true},
		{"mount, named fs", []*csi.VolumeCapability{mountCap("XFS", rwo)}, DefaultFSType, Caps{Access: pool.AccessFilesystem, FSType: "xfs", Modes: []csi.VolumeCapability_AccessMode_Mode{rwo}}, true},
		{"unsupported fs", []*csi.VolumeCapability{mountCap("zfs", rwo)}, "", Caps{}, false},
		{"two filesystems", []*csi.VolumeCapability{mountCap("xfs", rwo), mountCap("ext4", rox)}, "", Caps{}, false},
		{"block", []*csi.VolumeCapability{blockCap(rwo), blockCap(rox)}, DefaultFSType, Caps{Access: pool.AccessBlock, Modes: []csi.VolumeCapability_AccessMode_Mode{rwo, rox}}, true},
		{"block and mount", []*csi.VolumeCapability{blockCap(rwo), mountCap("", rwo)}, "", Caps{}, false},
		{"no access type", []*csi.VolumeCapability{{AccessMode: &csi.VolumeCapability_AccessMode{Mode: rwo}}}, "", Caps{}, false},
		{"no access mode", []*csi.VolumeCapability{mountCap("", csi.VolumeCapability_AccessMode_UNKNOWN)}, "", Caps{}, false},
		{"unknown access mode", []*csi.VolumeCapability{mountCap("", 99)}, "", Caps{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseCaps(tt.caps, tt.defaultFS)
			if tt.ok != (err == nil) {
				t.Fatalf("ParseCaps = %+v, %v; want ok=%t", got, err, tt.ok)
			}
			if err != nil {
				if status.Code(err) != codes.InvalidArgument {
					t.Fatalf("ParseCaps = %v, want INVALID_ARGUMENT", err)
				}
				return
			}
			if got.Access != tt.want.Access || got.FSType != tt.want.FSType || len(got.Modes) != len(tt.want.Modes) {
				t.Fatalf("ParseCaps = %+v, want %+v", got, tt.want)
			}
			for i := range got.Modes {
				if got.Modes[i] != tt.want.Modes[i] {
					t.Fatalf("ParseCaps = %+v, want %+v", got, tt.want)
				}
			}
		})
	}
}

func TestCheckRequestName(t *testing.T) {
	tests := []struct {
		name, kind, in string
		ok             bool
		says           string
	}{
		{"empty", "volume", "", false, "name is required"},
		{"plain", "volume", "pvc-1", true, ""},
		{"NUL", "snapshot", "a\x00b", false, "snapshot name"},
		{"long", "volume", strings.Repeat("a", pool.MaxNameLength+1), false, "volume name"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckRequestName(tt.kind, tt.in)
			if tt.ok != (err == nil) {
				t.Fatalf("CheckRequestName = %v, want ok=%t", err, tt.ok)
			}
			if err != nil && (status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.says)) {
				t.Fatalf("CheckRequestName = %v, want INVALID_ARGUMENT saying %q", err, tt.says)
			}
		})
	}
}
