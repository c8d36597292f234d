// Package nodecall is the channel between the local driver's central controller and the
// node agents (docs/design/central-controller.md §2): a PoolCall is one Controller call for
// one node, written by the controller and answered by that node's agent in its status; a
// PoolNode is a node agent's heartbeat and capacity.
//
// The Go types are written by hand and converted to and from unstructured objects, as
// internal/snapclaim reads snapshot contents: no generated client, no scheme. The field
// names are the CRDs' (poolcalls.poolcsi.io, poolnodes.poolcsi.io, v1alpha1), which the
// chart declares.
//
// A call never carries a secret: a request is stripped of every field the CSI spec marks
// csi_secret before it is named or written (local pools take none; a Secret never goes to
// etcd in clear).
package nodecall

import (
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Group and Version of the channel's CRDs.
const (
	Group   = "poolcsi.io"
	Version = "v1alpha1"
)

var (
	// CallsResource is the PoolCall API.
	CallsResource = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "poolcalls"}
	// NodesResource is the PoolNode API.
	NodesResource = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "poolnodes"}
	// KubeNodesResource is the Node API: a PoolNode and a node's calls are owned by their
	// Node, so that they go with it.
	KubeNodesResource = schema.GroupVersionResource{Version: "v1", Resource: "nodes"}
)

// Kinds, and the list kinds a fake dynamic client needs (ListKinds).
const (
	CallKind = "PoolCall"
	NodeKind = "PoolNode"
)

// ListKinds maps the channel's resources to their list kinds, for
// k8s.io/client-go/dynamic/fake.NewSimpleDynamicClientWithCustomListKinds.
func ListKinds() map[schema.GroupVersionResource]string {
	return map[schema.GroupVersionResource]string{
		CallsResource:     CallKind + "List",
		NodesResource:     NodeKind + "List",
		KubeNodesResource: "NodeList",
	}
}

// Labels a call carries, so that the controller finds the calls of one target and method
// without reading them all.
const (
	// TargetLabel is the 40 hex digits of SHA-256(spec.target): an ID may be longer than
	// a label value and hold characters a label may not.
	TargetLabel = "poolcsi.io/target"
	// MethodLabel is spec.method.
	MethodLabel = "poolcsi.io/method"
)

// Phase is how far an agent got with a call.
type Phase string

const (
	// Running: an agent passed the commit point and invoked, or is invoking, the call.
	Running Phase = "Running"
	// Done: status.code, message and response are the node's answer.
	Done Phase = "Done"
)

// Call is a PoolCall: one Controller call for one node.
type Call struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   CallSpec   `json:"spec"`
	Status CallStatus `json:"status,omitempty"`
}

// CallSpec is what the controller asks; immutable once created.
type CallSpec struct {
	// Node is the node whose agent runs the call (a selectable field).
	Node string `json:"node"`
	// Method is the CSI method, one of the allow-list (Methods).
	Method string `json:"method"`
	// Target is the ID the call is about; for a create, the ID its name maps to.
	Target string `json:"target"`
	// Request is the CSI request in protojson, secrets stripped.
	Request string `json:"request"`
	// Nonce is random per object (32 hex digits); the answer echoes it.
	Nonce string `json:"nonce"`
	// Issued is when the controller made the call, by its clock: it orders the calls of
	// one target, and nothing else.
	Issued metav1.MicroTime `json:"issued"`
	// NotAfter is when an agent stops *starting* the call (an orphan guard; the agent
	// allows a margin for the two clocks).
	NotAfter metav1.Time `json:"notAfter"`
}

// CallStatus is the agent's answer; only the agent writes it (status subresource).
type CallStatus struct {
	// Nonce echoes spec.nonce: a status with another nonce is no answer to this call.
	Nonce string `json:"nonce,omitempty"`
	Phase Phase  `json:"phase,omitempty"`
	// Code is the gRPC code of the node's answer, Message its message.
	Code    int32  `json:"code,omitempty"`
	Message string `json:"message,omitempty"`
	// Response is the CSI response in protojson (code 0 only).
	Response string `json:"response,omitempty"`
	// Attempts counts the times an agent passed the commit point.
	Attempts int32 `json:"attempts,omitempty"`
	// Started and Finished are for people (the agent's clock).
	Started  *metav1.Time `json:"started,omitempty"`
	Finished *metav1.Time `json:"finished,omitempty"`
}

// Answered reports whether the status is the answer to this very call: Done, with the
// spec's nonce.
func (c *Call) Answered() bool {
	return c.Status.Phase == Done && c.Status.Nonce == c.Spec.Nonce && c.Spec.Nonce != ""
}

// PoolNode is a node agent's heartbeat and the capacity of its local pools; its name is
// the node's.
type PoolNode struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   PoolNodeSpec   `json:"spec"`
	Status PoolNodeStatus `json:"status,omitempty"`
}

// PoolNodeSpec is empty: everything of a PoolNode is the agent's report.
type PoolNodeSpec struct{}

// PoolNodeStatus is written by the node's agent only.
type PoolNodeStatus struct {
	// RenewTime is rewritten every heartbeat. Its value is for people only: readers time
	// a node by when they saw the object change, with their own clock.
	RenewTime *metav1.MicroTime `json:"renewTime,omitempty"`
	Agent     AgentInfo         `json:"agent,omitempty"`
	Pools     []PoolCapacity    `json:"pools,omitempty"`
}

// AgentInfo names the agent that writes the PoolNode.
type AgentInfo struct {
	Version string `json:"version,omitempty"`
	Pod     string `json:"pod,omitempty"`
}

// PoolCapacity is a pool's answer to the node's own GetCapacity.
type PoolCapacity struct {
	Name              string        `json:"name"`
	AvailableBytes    int64         `json:"availableBytes"`
	MaximumVolumeSize int64         `json:"maximumVolumeSize,omitempty"`
	MinimumVolumeSize int64         `json:"minimumVolumeSize,omitempty"`
	Condition         PoolCondition `json:"condition"`
}

// PoolCondition says whether the pool answers.
type PoolCondition string

const (
	// PoolOk: the figures are the pool's.
	PoolOk PoolCondition = "Ok"
	// PoolUnavailable: the pool faults; the controller's GetCapacity answers 0.
	PoolUnavailable PoolCondition = "Unavailable"
)

// ToUnstructured converts a Call, setting its apiVersion and kind.
func (c *Call) ToUnstructured() (*unstructured.Unstructured, error) {
	c.APIVersion, c.Kind = CallsResource.GroupVersion().String(), CallKind
	return toUnstructured(c)
}

// ToUnstructured converts a PoolNode, setting its apiVersion and kind.
func (n *PoolNode) ToUnstructured() (*unstructured.Unstructured, error) {
	n.APIVersion, n.Kind = NodesResource.GroupVersion().String(), NodeKind
	return toUnstructured(n)
}

func toUnstructured(obj any) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, err
	}
	return &unstructured.Unstructured{Object: m}, nil
}

// CallFrom converts an object read from the API server. Anyone who may write calls wrote
// it: a field of the wrong type is an error, and what it says is checked where it is used
// (the method against the allow-list, the request by the codec).
func CallFrom(u *unstructured.Unstructured) (*Call, error) {
	c := &Call{}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, c); err != nil {
		return nil, fmt.Errorf("PoolCall %s: %w", u.GetName(), err)
	}
	return c, nil
}

// NodeFrom converts a PoolNode read from the API server.
func NodeFrom(u *unstructured.Unstructured) (*PoolNode, error) {
	n := &PoolNode{}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, n); err != nil {
		return nil, fmt.Errorf("PoolNode %s: %w", u.GetName(), err)
	}
	return n, nil
}

// DeepCopy copies c, sharing nothing.
func (c *Call) DeepCopy() *Call {
	out := *c
	c.DeepCopyInto(&out.ObjectMeta)
	if c.Status.Started != nil {
		out.Status.Started = c.Status.Started.DeepCopy()
	}
	if c.Status.Finished != nil {
		out.Status.Finished = c.Status.Finished.DeepCopy()
	}
	return &out
}

// DeepCopy copies n, sharing nothing.
func (n *PoolNode) DeepCopy() *PoolNode {
	out := *n
	n.DeepCopyInto(&out.ObjectMeta)
	if n.Status.RenewTime != nil {
		out.Status.RenewTime = n.Status.RenewTime.DeepCopy()
	}
	out.Status.Pools = append([]PoolCapacity(nil), n.Status.Pools...)
	return &out
}
