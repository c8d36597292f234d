package csilegacy

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/poolcsi/poolcsi/internal/health"
)

// Condition reads the v1.12 volume_condition from a message's unknown
// fields, past others, and refuses a cut one.
func TestVolumeCondition(t *testing.T) {
	cond := func(abnormal bool, msg string) []byte {
		var b []byte
		b = protowire.AppendTag(b, 1, protowire.VarintType)
		b = protowire.AppendVarint(b, protowire.EncodeBool(abnormal))
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		return protowire.AppendString(b, msg)
	}
	field := func(inner []byte) []byte {
		b := protowire.AppendTag(nil, 2, protowire.BytesType)
		return protowire.AppendBytes(b, inner)
	}
	other := protowire.AppendVarint(protowire.AppendTag(nil, 9, protowire.VarintType), 7)
	tests := []struct {
		name         string
		unknown      []byte
		abnormal, ok bool
		message      string
	}{
		{"none", nil, false, false, ""},
		{"healthy", field(cond(false, "volume is healthy")), false, true, "volume is healthy"},
		{"abnormal, after another unknown field", append(other, field(cond(true, "ImageMissing: gone"))...), true, true, "ImageMissing: gone"},
		{"cut short", field(cond(true, "x"))[:3], false, false, ""},
	}
	// What SetCondition writes reads back.
	written := &csi.ListVolumesResponse_VolumeStatus{}
	SetCondition(written, []health.Issue{{Reason: "ImageMissing", Message: "gone"}})
	tests = append(tests, struct {
		name         string
		unknown      []byte
		abnormal, ok bool
		message      string
	}{"written by SetCondition", written.ProtoReflect().GetUnknown(), true, true, "ImageMissing: gone"})
	for _, tt := range tests {
		st := &csi.ListVolumesResponse_VolumeStatus{}
		st.ProtoReflect().SetUnknown(tt.unknown)
		abnormal, msg, ok := Condition(st)
		if abnormal != tt.abnormal || msg != tt.message || ok != tt.ok {
			t.Errorf("%s: %v %q %v, want %v %q %v", tt.name, abnormal, msg, ok, tt.abnormal, tt.message, tt.ok)
		}
	}
}
