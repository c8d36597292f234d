// Package agent is the node side of the channel between the local driver's central
// controller and the nodes (docs/design/central-controller.md §2.3): it carries out, on
// this node's own CSI socket, the PoolCalls addressed to this node (worker.go), and keeps
// this node's PoolNode, its heartbeat and the capacity of its local pools (publish.go).
//
// The node's handlers are today's: a call is replayed as the CSI request it carries, so
// the pool's own records stay the truth and every check a handler makes is made again.
// The package never reaches into internal/driver; it speaks CSI over Deps.Conn.
package agent

import (
	"time"

	"google.golang.org/grpc"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// Defaults of the agent's flags (cmd/poolcsi: --agent-workers, --agent-call-timeout,
// --agent-heartbeat).
const (
	DefaultWorkers     = 4
	DefaultCallTimeout = 10 * time.Minute
	DefaultHeartbeat   = 5 * time.Second
)

// Deps is what the agent acts through.
type Deps struct {
	// Calls reads and answers this node's calls and writes its PoolNode.
	Calls nodecall.Store
	// Node is this node's name: the only spec.node whose calls it runs.
	Node string
	// Conn is this node's own CSI socket.
	Conn grpc.ClientConnInterface
	// Pools are the local pools whose capacity the PoolNode reports.
	Pools []string
	// Kick makes the node re-apply its volumes' I/O limits now (after a
	// ControllerModifyVolume); nil: nothing.
	Kick func()

	// Clock is the agent's clock (nil: the real one): notAfter is judged by it.
	Clock clock.Clock
	// Workers is how many targets' calls run at once (0: DefaultWorkers).
	Workers int
	// CallTimeout bounds one invoke (0: DefaultCallTimeout). Longer than a sidecar's
	// timeout on purpose: a long copy completes, and the retry finds it Done.
	CallTimeout time.Duration
	// Heartbeat is how often the PoolNode is rewritten (0: DefaultHeartbeat).
	Heartbeat time.Duration
	// Version and Pod name the agent in the PoolNode, for people.
	Version, Pod string
}

func (d Deps) withDefaults() Deps {
	if d.Clock == nil {
		d.Clock = clock.RealClock{}
	}
	if d.Workers <= 0 {
		d.Workers = DefaultWorkers
	}
	if d.CallTimeout <= 0 {
		d.CallTimeout = DefaultCallTimeout
	}
	if d.Heartbeat <= 0 {
		d.Heartbeat = DefaultHeartbeat
	}
	return d
}

// New returns the agent's two runners: the call worker and the PoolNode publisher, which
// the worker prompts after each call that may have changed a pool's free space.
func New(deps Deps) (*Worker, *Publisher) {
	deps = deps.withDefaults()
	p := newPublisher(deps)
	return newWorker(deps, p.Poke), p
}
