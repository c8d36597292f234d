// Package csilegacy writes and reads the CSI v1.12 volume health fields on
// the v1.13 messages poolcsi is built on: the driver sets them, and
// `poolcsi status` reads them. It depends on the spec and protobuf alone (and
// the health issues it folds), so a client need not import the driver.
package csilegacy

import (
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/health"
)

// The consumers that exist read volume health the CSI v1.12 way: kubelet v1.36
// (spec v1.9) reads NodeGetVolumeStatsResponse.volume_condition when the node
// capability VOLUME_CONDITION is advertised, and csi-external-health-monitor
// v0.15 reads volume_condition from ListVolumes and ControllerGetVolume when
// the controller capability VOLUME_CONDITION is advertised (and exits when it
// is not). Spec v1.13, which poolcsi is built on, reserved those fields and
// values in favour of the VolumeHealth RPCs, which nothing released calls yet.
//
// poolcsi serves both from one health computation: the v1.13 RPCs as generated,
// and the v1.12 fields written onto the same v1.13 messages as protobuf fields
// the v1.13 code does not know (field 2, VolumeCondition{bool abnormal = 1;
// string message = 2}), and the capabilities by their v1.12 numbers. On the wire
// that is exactly what a v1.12 message with the field set encodes to; a v1.13
// client skips it, a v1.12 client decodes it (test/legacy proves both).
const (
	ControllerVolumeCondition = csi.ControllerServiceCapability_RPC_Type(11) // VOLUME_CONDITION, spec ≤ v1.12
	NodeVolumeCondition       = csi.NodeServiceCapability_RPC_Type(4)        // VOLUME_CONDITION, spec ≤ v1.12
	VolumeConditionField      = protowire.Number(2)                          // volume_condition in the three messages
)

// fold folds health issues into the v1.12 condition: abnormal when
// there is any, with every issue's reason and message.
func fold(issues []health.Issue) (abnormal bool, message string) {
	if len(issues) == 0 {
		return false, "volume is healthy"
	}
	parts := make([]string, 0, len(issues))
	for _, i := range issues {
		parts = append(parts, i.Reason+": "+i.Message)
	}
	return true, strings.Join(parts, "; ")
}

// SetCondition writes volume_condition onto m (a v1.13
// NodeGetVolumeStatsResponse, ListVolumesResponse_VolumeStatus or
// ControllerGetVolumeResponse_VolumeStatus) as spec v1.12 encodes it.
func SetCondition(m proto.Message, issues []health.Issue) {
	abnormal, message := fold(issues)
	var cond []byte
	cond = protowire.AppendTag(cond, 1, protowire.VarintType)
	cond = protowire.AppendVarint(cond, protowire.EncodeBool(abnormal))
	cond = protowire.AppendTag(cond, 2, protowire.BytesType)
	cond = protowire.AppendString(cond, message)
	r := m.ProtoReflect()
	raw := r.GetUnknown()
	raw = protowire.AppendTag(raw, VolumeConditionField, protowire.BytesType)
	raw = protowire.AppendBytes(raw, cond)
	r.SetUnknown(raw)
}

// Condition reads the volume_condition SetCondition writes (or a
// v1.12 driver sends) from a v1.13 status message, where it is a field the
// generated code does not know. ok is false when m has none or it is
// malformed.
func Condition(m proto.Message) (abnormal bool, message string, ok bool) {
	wellFormed := eachField(m.ProtoReflect().GetUnknown(), func(num protowire.Number, typ protowire.Type, v []byte) {
		if num != VolumeConditionField || typ != protowire.BytesType {
			return
		}
		cond, _ := protowire.ConsumeBytes(v)
		abnormal, message = false, ""
		ok = eachField(cond, func(num protowire.Number, typ protowire.Type, v []byte) {
			switch {
			case num == 1 && typ == protowire.VarintType:
				x, _ := protowire.ConsumeVarint(v)
				abnormal = protowire.DecodeBool(x)
			case num == 2 && typ == protowire.BytesType:
				message, _ = protowire.ConsumeString(v)
			}
		})
	})
	if !wellFormed || !ok {
		return false, "", false
	}
	return abnormal, message, true
}

// eachField calls f with each field of the encoded message b: its number, its
// wire type and its whole encoded value. It reports false if b is malformed.
func eachField(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte)) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return false
		}
		f(num, typ, b[:m])
		b = b[m:]
	}
	return true
}
