package central

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/tools/cache"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// The central controller's metrics (docs/metrics.md, "Central controller"): what an
// operator needs to see of the channel to the nodes. Every series is per node at most,
// never per volume or call: a node label is bounded by the cluster, an ID is not.

// CallBuckets cover a call answered from a warm agent (tens of ms: a create, two watch
// events and a delete) up to the sidecars' 60 s budget and beyond.
var CallBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120}

// MetricsDeps is what the metrics read and where they are registered.
type MetricsDeps struct {
	// Registry is where the metrics are registered (the process's, for /metrics; a
	// fresh one in a test).
	Registry prometheus.Registerer
	// Nodes, when set, is reported on each scrape: each known node live or not, and how
	// long since its PoolNode was seen changing.
	Nodes Nodes
	// Calls, when set, is the informer of every node's PoolCalls, counted on each scrape
	// by node and state.
	Calls cache.SharedIndexInformer
}

// Metrics records the calls the Channel carries and the Sweeper deletes. A nil *Metrics
// records nothing.
type Metrics struct {
	calls    *prometheus.CounterVec
	duration *prometheus.HistogramVec
	inFlight *prometheus.GaugeVec
	swept    *prometheus.CounterVec
}

// NewMetrics makes the metrics and registers them, with the collectors of d.Nodes and
// d.Calls, on d.Registry.
func NewMetrics(d MetricsDeps) (*Metrics, error) {
	m := &Metrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "poolcsi_central_node_calls_total",
			Help: "Calls the central controller made to a node's agent (PoolCalls), by node, method and gRPC code of the answer (UNAVAILABLE also when the node was not live and no call was made).",
		}, []string{"node", "method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "poolcsi_central_node_call_duration_seconds",
			Help:    "Duration of the central controller's calls to nodes' agents, from the call to its answer, by method and gRPC code.",
			Buckets: CallBuckets,
		}, []string{"method", "code"}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "poolcsi_central_node_calls_in_flight",
			Help: "Calls the central controller is waiting on, by node.",
		}, []string{"node"}),
		swept: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "poolcsi_central_swept_calls_total",
			Help: "PoolCalls the sweeper deleted, by reason: answered (no retry came for the answer) or untaken (no agent took the call).",
		}, []string{"reason"}),
	}
	cs := []prometheus.Collector{m.calls, m.duration, m.inFlight, m.swept}
	if d.Nodes != nil {
		cs = append(cs, nodesCollector{d.Nodes})
	}
	if d.Calls != nil {
		cs = append(cs, callsCollector{d.Calls})
	}
	var errs []error
	for _, c := range cs {
		errs = append(errs, d.Registry.Register(c))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return m, nil
}

// start records a call of method to node as in flight; the func it returns records its
// end with the call's error, took after the start by the caller's clock.
func (m *Metrics) start(node, method string) func(err error, took time.Duration) {
	if m == nil {
		return func(error, time.Duration) {}
	}
	m.inFlight.WithLabelValues(node).Inc()
	return func(err error, took time.Duration) {
		m.inFlight.WithLabelValues(node).Dec()
		code := status.Code(err).String()
		m.calls.WithLabelValues(node, method, code).Inc()
		m.duration.WithLabelValues(method, code).Observe(took.Seconds())
	}
}

// Swept reasons.
const (
	sweptAnswered = "answered"
	sweptUntaken  = "untaken"
)

func (m *Metrics) sweptOne(reason string) {
	if m != nil {
		m.swept.WithLabelValues(reason).Inc()
	}
}

// nodesCollector reports the node view on each scrape.
type nodesCollector struct{ nodes Nodes }

var (
	nodeLiveDesc = prometheus.NewDesc("poolcsi_central_node_live",
		"1 while the central controller has seen the node's PoolNode change within --node-stale-after (its agent renews it), else 0: calls for the node answer UNAVAILABLE.",
		[]string{"node"}, nil)
	nodeUnchangedDesc = prometheus.NewDesc("poolcsi_central_node_unchanged_seconds",
		"Seconds since the central controller saw the node's PoolNode change, by its own clock; -1 while it has not seen it change since it started.",
		[]string{"node"}, nil)
	poolCallsDesc = prometheus.NewDesc("poolcsi_central_pool_calls",
		"PoolCalls in the central controller's view, by node and state: untaken (no agent took it yet), running, done (answered, not yet deleted).",
		[]string{"node", "state"}, nil)
)

func (c nodesCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- nodeLiveDesc
	ch <- nodeUnchangedDesc
}

func (c nodesCollector) Collect(ch chan<- prometheus.Metric) {
	for _, n := range c.nodes.Known() {
		live, since := c.nodes.Live(n)
		up, unchanged := 0.0, -1.0
		if live {
			up = 1
		}
		if live || since > 0 {
			unchanged = since.Seconds()
		}
		ch <- prometheus.MustNewConstMetric(nodeLiveDesc, prometheus.GaugeValue, up, n)
		ch <- prometheus.MustNewConstMetric(nodeUnchangedDesc, prometheus.GaugeValue, unchanged, n)
	}
}

// callsCollector counts the PoolCalls the informer holds on each scrape.
type callsCollector struct{ calls cache.SharedIndexInformer }

func (c callsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- poolCallsDesc }

func (c callsCollector) Collect(ch chan<- prometheus.Metric) {
	type key struct{ node, state string }
	counts := map[key]int{}
	for _, obj := range c.calls.GetStore().List() {
		call := nodecall.FromCache(obj)
		if call == nil {
			continue
		}
		state := "untaken"
		switch stateOf(call) {
		case nodecall.Running:
			state = "running"
		case nodecall.Done:
			state = "done"
		}
		counts[key{call.Spec.Node, state}]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(poolCallsDesc, prometheus.GaugeValue, float64(n), k.node, k.state)
	}
}
