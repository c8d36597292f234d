package nodecall

import (
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
)

// A group snapshot whose members sit on several nodes is taken in two phases
// (docs/design/central-controller.md §7.1): every node holding members freezes
// them and holds them (FreezeGroupHold), and only once every node answered
// frozen does each copy its members under that hold (SnapshotHeld); on any
// failure every node asked lets its hold go (ThawGroup). These calls are not
// CSI's: the node serves them on its own socket as the GroupHold service, whose
// messages are protobuf Structs (a PoolCall then reads as plain JSON). Each is
// about the group ID, the calls' target, so a node runs a group's calls in the
// order they were issued.

// GroupHoldService is the node's gRPC service of the three calls.
const GroupHoldService = "poolcsi.v1.GroupHold"

// The methods' names, as spec.method holds them.
const (
	MethodFreezeGroupHold = "FreezeGroupHold"
	MethodSnapshotHeld    = "SnapshotHeld"
	MethodThawGroup       = "ThawGroup"
)

// GroupHoldFullMethod is the gRPC method of one of the three calls.
func GroupHoldFullMethod(name string) string { return "/" + GroupHoldService + "/" + name }

// FreezeGroupHold asks a node to freeze and hold its members of a group.
type FreezeGroupHold struct {
	// Group is the group snapshot's ID, <pool>@g-<key of Name>.
	Group string `json:"group"`
	Name  string `json:"name"`
	// Members are the node's volumes of the group.
	Members []string `json:"members"`
	// BoundMillis is the longest the hold may last, as central asks it; the node
	// caps it.
	BoundMillis int64 `json:"boundMillis"`
}

// GroupHeld is a node's answer to FreezeGroupHold: the hold's nonce and how long
// it lasts from its start, by the node's clock.
//
// Its nonce is RecordedHold when the node has its part recorded already (a retry
// of a create that finished there): nothing is frozen, and SnapshotHeld answers
// the part.
type GroupHeld struct {
	Nonce      string `json:"nonce"`
	HoldMillis int64  `json:"holdMillis"`
}

// RecordedHold is the nonce of a hold a node answers for a part it recorded already.
const RecordedHold = "recorded"

// SnapshotHeld asks a node to copy its members under the hold of that nonce and
// to record its part of the group; its answer is a CreateVolumeGroupSnapshotResponse
// of the part.
type SnapshotHeld struct {
	Group   string   `json:"group"`
	Name    string   `json:"name"`
	Members []string `json:"members"`
	// All are every volume of the group, on every node.
	All   []string `json:"all"`
	Nonce string   `json:"nonce"`
}

// ThawGroup asks a node to let the group's hold go: the hold of that nonce, or
// with no nonce, any hold of the group. A hold already gone is success.
type ThawGroup struct {
	Group string `json:"group"`
	Nonce string `json:"nonce,omitempty"`
}

// ToStruct is v, a JSON-encodable value, as a Struct.
func ToStruct(v any) (*structpb.Struct, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	s := &structpb.Struct{}
	if err := protojson.Unmarshal(b, s); err != nil {
		return nil, err
	}
	return s, nil
}

// FromStruct decodes s into v, refusing a field of the wrong type.
func FromStruct(s *structpb.Struct, v any) error {
	b, err := protojson.Marshal(s)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%T: %w", v, err)
	}
	return nil
}
