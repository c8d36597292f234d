// Package central is the local driver's central controller
// (docs/design/central-controller.md): one leader-elected process, beside the released
// provisioner, resizer and snapshotter in their normal central mode, that serves the
// local driver's Identity, Controller and GroupController services and carries every
// call about a node's local pool to that node's agent (internal/agent) through the
// Kubernetes API (internal/nodecall's PoolCall), never over a network listener on nodes.
//
// A local pool is readable only on its node and its records are the truth, so no view of
// volumes or snapshots is kept here: every call about one goes to its node, and only
// capacity, which is advisory, is answered from a view (the nodes' PoolNodes).
//
// The seams, so that each part is tested alone:
//   - Caller (call.go): one call on one node, the protocol of §2.3 (liveness, find or
//     create by deterministic name, supersede, wait on informer events, answer).
//   - Nodes (nodes.go): the PoolNodes as this process's informer saw them, liveness by
//     this process's clock; GetCapacity is answered from it (capacity.go).
//   - Hints (locate.go): the node an ID lives on, from PVs, snapshot contents and answers
//     learnt; the server confirms a hint and asks every node where there is none.
//   - Server (server.go, create.go): the CSI services; arguments are checked here before
//     any call exists, and again on the node.
//
// The package imports params, pool's ID parsers, csierr, rpc and nodecall; never
// internal/driver.
package central

import (
	"context"
	"time"

	"google.golang.org/protobuf/proto"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
)

// Defaults of the central flags (cmd/poolcsi: --node-stale-after, --node-call-pickup).
const (
	// DefaultStaleAfter: a node whose PoolNode this process has not seen change for this
	// long is down (four missed heartbeats of agent.DefaultHeartbeat).
	DefaultStaleAfter = 20 * time.Second
	// DefaultPickup: a call no agent has taken (written Running) within this long
	// answers UNAVAILABLE; the call stays for the sidecar's retry.
	DefaultPickup = 10 * time.Second
	// DefaultCallLifetime is how long after it was issued an agent may still start a
	// call (its notAfter), and how long the sweeper keeps one no agent took.
	DefaultCallLifetime = 15 * time.Minute
)

// Caller runs one Controller call on one node's agent (call.go).
type Caller interface {
	// Call asks node to run method (a nodecall allow-listed name, e.g. "CreateVolume")
	// with req, about target (the ID the call is about; a create: the ID its name maps
	// to), and waits for the answer within ctx's deadline less rpc.AnswerMargin.
	//
	// It returns the node's response, or a gRPC status error: the node's own code and
	// message; UNAVAILABLE when the node is not live (nothing created), when no agent
	// took the call within the pickup time, or when the call was deleted while waited on;
	// ABORTED when the call is still running at the deadline (the retry finds the same
	// call and its answer).
	Call(ctx context.Context, node, method, target string, req proto.Message) (proto.Message, error)
}

// PendingCalls is what a Caller that keeps the calls in view (the Channel) also
// answers: where a call about a target already is. A new leader knows nothing learnt by
// the old one, and a create still running or not yet taken on one node must fix that
// node for the retry: a volume not made yet answers NOT_FOUND to every probe, so only
// the call itself shows where it will be made.
type PendingCalls interface {
	// Pending is the node of a call of method about target that may still make or has
	// made what it asks: not being deleted and not answered with an error. Of several,
	// one an agent took wins, then the oldest.
	Pending(method, target string) (node string, ok bool)
	// Underway is the node of a call of method about target not answered yet and not
	// being deleted: one whose effect may still come. Of several, one an agent took
	// wins, then the oldest.
	Underway(method, target string) (node string, ok bool)
}

// Nodes is the controller's view of the nodes' PoolNodes (nodes.go).
type Nodes interface {
	// Live says whether node's PoolNode was seen changing by this process within the
	// stale limit, and how long ago it was last seen changing (by this process's clock;
	// the PoolNode's renewTime is never compared with it). A node never seen: false.
	Live(node string) (live bool, since time.Duration)
	// Known lists the nodes that have a PoolNode, live or not, sorted.
	Known() []string
	// Pools is node's pools as its agent last published them (nil when unknown).
	Pools(node string) []nodecall.PoolCapacity
	// Synced says whether the view has its first full list (Probe is not ready before).
	Synced() bool
	// AwaitVerdict waits, at most until ctx ends, until Live can tell whether node is
	// live (right after a start no node is: a first sighting is no change).
	AwaitVerdict(ctx context.Context, node string)
}

// Hints names the node an ID was last known on (locate.go). A hint is only a hint: the
// server confirms it with the node (a NOT_FOUND there makes it ask every node).
type Hints interface {
	// VolumeNode is the node of a volume ID: its PV's topology.poolcsi.io/node term.
	VolumeNode(volumeID string) (node string, ok bool)
	// SnapshotNode is the node of a snapshot ID: its content's source volume's node, else
	// its managed-by label.
	SnapshotNode(snapshotID string) (node string, ok bool)
	// GroupNode is the node of a group snapshot ID.
	GroupNode(groupID string) (node string, ok bool)
	// GroupNodes are the nodes of a group snapshot across nodes, sorted: the nodes of
	// its content's member PVs, else those learnt at its create (LearnGroup); none or
	// one when it is not known to span nodes.
	GroupNodes(groupID string) []string
	// LearnGroup records the nodes a group across nodes was made on.
	LearnGroup(groupID string, nodes []string)
	// Learn records that id answered on node (after a Done call).
	Learn(id, node string)
	// Synced says whether the hints' informers have their first full list.
	Synced() bool
}

// Rollout tells whether a node still runs the per-node layout's provisioner, which
// takes Immediate claims too (docs/design/central-controller.md §8 item 3; rollout.go).
type Rollout interface {
	// PerNodeProvisioner names a pod on node that runs the per-node layout's
	// csi-provisioner and whose containers may still run (terminating counts), "" when
	// there is none.
	PerNodeProvisioner(ctx context.Context, node string) (pod string, err error)
}

// Deps is what the server acts through.
type Deps struct {
	// Name and Version are the local driver's, as its node plugins register them.
	Name, Version string
	// TopologyKey is the node topology key the nodes register (topology.poolcsi.io/node).
	TopologyKey string
	// Params is what the parsers know of the local driver: its pool names (from the same
	// local.yaml the nodes read), no shares.
	Params params.Config
	Calls  Caller
	Nodes  Nodes
	Hints  Hints
	// Rollout tells the nodes of an Immediate claim's topology that have no PoolNode
	// apart: one that still runs the per-node provisioner holds the claim back, one that
	// does not (its agent not started) is only no candidate. Nil: every node without a
	// PoolNode is taken to run one.
	Rollout Rollout
	// PlaceWithoutTopology lets a CreateVolume whose topology names no node go to any
	// node with room (a clone or restore: its source's), as the CSI spec reads a missing
	// requirement. Off, as --local-central runs, it is FAILED_PRECONDITION:
	// csi-provisioner (--strict-topology) sends no topology only for a claim with no
	// selected node of an Immediate class while --immediate-topology is false, i.e.
	// node.localImmediateBinding false, which leaves such claims Pending for the user's
	// own controller to place (docs/deploy.md), as the per-node provisioners did.
	PlaceWithoutTopology bool
	// Clock is the controller's clock (nil: the real one).
	Clock clock.Clock
	// GroupHold is the bound asked for a group across nodes' holds (0:
	// DefaultGroupHold); each node caps it.
	GroupHold time.Duration
}
