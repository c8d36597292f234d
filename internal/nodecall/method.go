package nodecall

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Caps on what a call holds (the CRD's maxLength says the same): an object stays well
// below etcd's request limit, and a hostile writer cannot make an agent decode megabytes.
const (
	// MaxRequest and MaxResponse bound spec.request and status.response, in bytes.
	MaxRequest  = 256 << 10
	MaxResponse = 256 << 10
	// ListPage is what a ListSnapshots answer is cut to (next_token), below MaxResponse.
	ListPage = 200 << 10
	// MaxMessage bounds status.message; a longer one is cut.
	MaxMessage = 4 << 10
	// MaxTarget bounds spec.target.
	MaxTarget = 1 << 10
	// MaxVersion and MaxPod bound a PoolNode's status.agent fields.
	MaxVersion = 64
	MaxPod     = 253
)

// Method is one Controller call the channel carries.
type Method struct {
	// Name is the CSI method's, as spec.method holds it.
	Name string
	// Abbrev starts the object's name.
	Abbrev string
	// FullMethod is the gRPC method the agent invokes on its own socket.
	FullMethod string
	// ChangesSpace: a call of this method may change a pool's free space, so the agent
	// reports capacity again after it.
	ChangesSpace bool

	newRequest, newResponse func() proto.Message
}

// NewRequest returns an empty request of the method.
func (m Method) NewRequest() proto.Message { return m.newRequest() }

// NewResponse returns an empty response of the method.
func (m Method) NewResponse() proto.Message { return m.newResponse() }

func method[Req, Resp any, PReq interface {
	*Req
	proto.Message
}, PResp interface {
	*Resp
	proto.Message
}](name, abbrev, full string, space bool) Method {
	return Method{Name: name, Abbrev: abbrev, FullMethod: full, ChangesSpace: space,
		newRequest: func() proto.Message { return PReq(new(Req)) }, newResponse: func() proto.Message { return PResp(new(Resp)) }}
}

// methods is the allow-list (the CRD's spec.method enum, checked again by the agent):
// node-local Controller work only, and the three calls of a group across nodes. Never a
// publish, never a Node call, never Identity.
var methods = map[string]Method{}

func init() {
	for _, m := range []Method{
		method[csi.CreateVolumeRequest, csi.CreateVolumeResponse]("CreateVolume", "cv", csi.Controller_CreateVolume_FullMethodName, true),
		method[csi.DeleteVolumeRequest, csi.DeleteVolumeResponse]("DeleteVolume", "dv", csi.Controller_DeleteVolume_FullMethodName, true),
		method[csi.ControllerExpandVolumeRequest, csi.ControllerExpandVolumeResponse]("ControllerExpandVolume", "ev", csi.Controller_ControllerExpandVolume_FullMethodName, true),
		method[csi.ControllerModifyVolumeRequest, csi.ControllerModifyVolumeResponse]("ControllerModifyVolume", "mv", csi.Controller_ControllerModifyVolume_FullMethodName, false),
		method[csi.ControllerGetVolumeRequest, csi.ControllerGetVolumeResponse]("ControllerGetVolume", "gv", csi.Controller_ControllerGetVolume_FullMethodName, false),
		method[csi.ValidateVolumeCapabilitiesRequest, csi.ValidateVolumeCapabilitiesResponse]("ValidateVolumeCapabilities", "vc", csi.Controller_ValidateVolumeCapabilities_FullMethodName, false),
		method[csi.CreateSnapshotRequest, csi.CreateSnapshotResponse]("CreateSnapshot", "cs", csi.Controller_CreateSnapshot_FullMethodName, true),
		method[csi.DeleteSnapshotRequest, csi.DeleteSnapshotResponse]("DeleteSnapshot", "ds", csi.Controller_DeleteSnapshot_FullMethodName, true),
		method[csi.ListSnapshotsRequest, csi.ListSnapshotsResponse]("ListSnapshots", "ls", csi.Controller_ListSnapshots_FullMethodName, false),
		method[csi.CreateVolumeGroupSnapshotRequest, csi.CreateVolumeGroupSnapshotResponse]("CreateVolumeGroupSnapshot", "cg", csi.GroupController_CreateVolumeGroupSnapshot_FullMethodName, true),
		method[csi.DeleteVolumeGroupSnapshotRequest, csi.DeleteVolumeGroupSnapshotResponse]("DeleteVolumeGroupSnapshot", "dg", csi.GroupController_DeleteVolumeGroupSnapshot_FullMethodName, true),
		method[csi.GetVolumeGroupSnapshotRequest, csi.GetVolumeGroupSnapshotResponse]("GetVolumeGroupSnapshot", "gg", csi.GroupController_GetVolumeGroupSnapshot_FullMethodName, false),
		// A group across nodes (grouphold.go).
		method[structpb.Struct, structpb.Struct](MethodFreezeGroupHold, "fh", GroupHoldFullMethod(MethodFreezeGroupHold), false),
		method[structpb.Struct, csi.CreateVolumeGroupSnapshotResponse](MethodSnapshotHeld, "sh", GroupHoldFullMethod(MethodSnapshotHeld), true),
		method[structpb.Struct, structpb.Struct](MethodThawGroup, "tg", GroupHoldFullMethod(MethodThawGroup), false),
	} {
		methods[m.Name] = m
	}
}

// Lookup returns the allowed method of that name.
func Lookup(name string) (Method, bool) {
	m, ok := methods[name]
	return m, ok
}

// Methods lists the allow-list, sorted.
func Methods() []string {
	out := make([]string, 0, len(methods))
	for n := range methods {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// ErrTooLarge is a request or response over its cap.
var ErrTooLarge = errors.New("too large for a PoolCall")

// Strip clears, in place and at any depth, every field the CSI spec marks csi_secret
// (the secrets maps of the requests).
func Strip(m proto.Message) {
	strip(m.ProtoReflect())
}

func strip(m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if secret, _ := proto.GetExtension(fd.Options(), csi.E_CsiSecret).(bool); secret {
			m.Clear(fd)
			return true
		}
		switch {
		case fd.IsList() && fd.Message() != nil:
			l := v.List()
			for i := range l.Len() {
				strip(l.Get(i).Message())
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, e protoreflect.Value) bool {
				strip(e.Message())
				return true
			})
		case fd.Message() != nil && !fd.IsMap():
			strip(v.Message())
		}
		return true
	})
}

// encode writes m, stripped of its secrets (a copy: the caller's message is left as it
// is), in protojson, refusing more than limit bytes.
func encode(m proto.Message, limit int) (string, error) {
	c := proto.Clone(m)
	Strip(c)
	b, err := protojson.Marshal(c)
	if err != nil {
		return "", err
	}
	if len(b) > limit {
		return "", fmt.Errorf("%d bytes of %s: %w (at most %d)", len(b), m.ProtoReflect().Descriptor().Name(), ErrTooLarge, limit)
	}
	return string(b), nil
}

// decode reads s, written by whoever may write calls: over the cap or a field of the
// wrong type are errors, and secrets, which no call may hold, are dropped.
//
// A field this build does not know is dropped, as a gRPC server built on an older CSI
// spec drops a newer sidecar's field: during an upgrade the controller (a Deployment) and
// the agents (a DaemonSet that rolls node by node) run different versions, and refusing
// the field would fail every call of the window with INVALID_ARGUMENT. Only the
// controller may create calls (RBAC) and an agent may answer only its own node's
// (the admission policy), so this widens nothing a hostile writer can reach.
func decode(s string, m proto.Message, limit int) error {
	if len(s) > limit {
		return fmt.Errorf("%d bytes: %w (at most %d)", len(s), ErrTooLarge, limit)
	}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal([]byte(s), m); err != nil {
		return err
	}
	Strip(m)
	return nil
}

// EncodeRequest is spec.request for req, secrets stripped.
func (m Method) EncodeRequest(req proto.Message) (string, error) {
	if err := m.check(req, m.newRequest()); err != nil {
		return "", err
	}
	return encode(req, MaxRequest)
}

// DecodeRequest reads spec.request.
func (m Method) DecodeRequest(s string) (proto.Message, error) {
	req := m.newRequest()
	if err := decode(s, req, MaxRequest); err != nil {
		return nil, fmt.Errorf("%s request: %w", m.Name, err)
	}
	return req, nil
}

// EncodeResponse is status.response for resp.
func (m Method) EncodeResponse(resp proto.Message) (string, error) {
	if err := m.check(resp, m.newResponse()); err != nil {
		return "", err
	}
	return encode(resp, MaxResponse)
}

// DecodeResponse reads status.response.
func (m Method) DecodeResponse(s string) (proto.Message, error) {
	resp := m.newResponse()
	if err := decode(s, resp, MaxResponse); err != nil {
		return nil, fmt.Errorf("%s response: %w", m.Name, err)
	}
	return resp, nil
}

func (m Method) check(got, want proto.Message) error {
	if g, w := got.ProtoReflect().Descriptor().FullName(), want.ProtoReflect().Descriptor().FullName(); g != w {
		return fmt.Errorf("%s takes %s, not %s", m.Name, w, g)
	}
	return nil
}

// ObjectName is the object name of the call of method on node for req: the method's
// abbreviation and 40 hex digits of SHA-256 over the method, the node and the request's
// deterministic encoding, secrets stripped. A retried CSI call, a restarted or a new
// leader all derive the same name; the secrets and the order of a map do not change it.
func (m Method) ObjectName(node string, req proto.Message) (string, error) {
	if err := m.check(req, m.newRequest()); err != nil {
		return "", err
	}
	c := proto.Clone(req)
	Strip(c)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(c)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	for _, part := range [][]byte{[]byte(m.Name), []byte(node), b} {
		// Length-prefixed, so no two (method, node, request) triples hash the same bytes.
		_, _ = fmt.Fprintf(h, "%d:", len(part))
		_, _ = h.Write(part)
	}
	return m.Abbrev + "-" + hex.EncodeToString(h.Sum(nil))[:40], nil
}

// TargetHash is the value of TargetLabel for target.
func TargetHash(target string) string {
	s := sha256.Sum256([]byte(target))
	return hex.EncodeToString(s[:])[:40]
}

// NewNonce returns 32 random hex digits.
func NewNonce() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24)
	return hex.EncodeToString(b[:])
}

// Ask is what the controller asks of a node.
type Ask struct {
	Node string
	// NodeUID is the Node's UID, for the ownerReference that deletes the call with its
	// node; empty: no owner.
	NodeUID string
	Method  string
	Target  string
	Request proto.Message
	// Issued and NotAfter are by the controller's clock.
	Issued, NotAfter time.Time
}

// NewCall builds the PoolCall for a: its deterministic name, labels, owner, a new nonce
// and the request, secrets stripped.
func NewCall(a Ask) (*Call, error) {
	m, ok := Lookup(a.Method)
	if !ok {
		return nil, fmt.Errorf("method %q is not one a PoolCall carries", a.Method)
	}
	if a.Node == "" || a.Target == "" || len(a.Target) > MaxTarget {
		return nil, fmt.Errorf("%s: a call needs a node and a target of at most %d bytes", a.Method, MaxTarget)
	}
	name, err := m.ObjectName(a.Node, a.Request)
	if err != nil {
		return nil, err
	}
	req, err := m.EncodeRequest(a.Request)
	if err != nil {
		return nil, err
	}
	c := &Call{
		ObjectMeta: metav1.ObjectMeta{
			Name:   name,
			Labels: map[string]string{TargetLabel: TargetHash(a.Target), MethodLabel: m.Name},
		},
		Spec: CallSpec{
			Node: a.Node, Method: m.Name, Target: a.Target, Request: req, Nonce: NewNonce(),
			// As precise as they are stored (MicroTime, Time), so the object made is the
			// object read back.
			Issued: metav1.NewMicroTime(a.Issued.Truncate(time.Microsecond)), NotAfter: metav1.NewTime(a.NotAfter.Truncate(time.Second)),
		},
	}
	if a.NodeUID != "" {
		c.OwnerReferences = []metav1.OwnerReference{NodeOwner(a.Node, a.NodeUID)}
	}
	return c, nil
}

// NodeOwner is the ownerReference to a Node.
func NodeOwner(node, uid string) metav1.OwnerReference {
	return metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: node, UID: types.UID(uid)}
}
