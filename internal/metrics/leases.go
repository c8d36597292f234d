package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// LeaseState is this node's lease in one shared pool (docs/fencing.md).
type LeaseState struct {
	Pool string
	// Age is how long ago its last successful renewal started; negative:
	// never renewed by this process.
	Age    time.Duration
	Fenced bool
	// FailedClosed: the fence did not find a device its node's records
	// hold, and fenced all it could not rule out (docs/fencing.md).
	FailedClosed bool
}

// leaseCollector reports the node's leases on each scrape.
type leaseCollector struct {
	states func() []LeaseState
	age    *prometheus.Desc
	fenced *prometheus.Desc
	closed *prometheus.Desc
}

// WatchLeases adds poolcsi_lease_age_seconds and poolcsi_lease_fenced, per
// pool, from states (the node plugin's leases).
func (m *Metrics) WatchLeases(states func() []LeaseState) {
	m.Registry.MustRegister(&leaseCollector{
		states: states,
		age: prometheus.NewDesc("poolcsi_lease_age_seconds",
			"Seconds since the start of this node's last successful renewal of its lease in a shared pool (-1: never renewed by this process). At the lease duration the node fences itself off the pool.",
			[]string{"pool"}, nil),
		fenced: prometheus.NewDesc("poolcsi_lease_fenced",
			"1 when this node could not renew its lease in a shared pool for the lease duration and fenced itself off: its loop devices there take no I/O any more.",
			[]string{"pool"}, nil),
		closed: prometheus.NewDesc("poolcsi_lease_fence_failed_closed",
			"1 when this node's fence of a shared pool did not find the loop device of a read-write stage its own records hold (or could not read them) and fenced every device it could not rule out: an alarm, the node needs looking at.",
			[]string{"pool"}, nil),
	})
}

func (c *leaseCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.age
	ch <- c.fenced
	ch <- c.closed
}

func (c *leaseCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.states() {
		age := s.Age.Seconds()
		if s.Age < 0 {
			age = -1
		}
		fenced := 0.0
		if s.Fenced {
			fenced = 1
		}
		ch <- prometheus.MustNewConstMetric(c.age, prometheus.GaugeValue, age, s.Pool)
		ch <- prometheus.MustNewConstMetric(c.fenced, prometheus.GaugeValue, fenced, s.Pool)
		closed := 0.0
		if s.FailedClosed {
			closed = 1
		}
		ch <- prometheus.MustNewConstMetric(c.closed, prometheus.GaugeValue, closed, s.Pool)
	}
}

// PeerLeaseState is a node's lease in one shared pool as a controller sees it
// (docs/fencing.md, "What the leases do not cover").
type PeerLeaseState struct {
	Pool, Node string
	// Unchanged is how long the controller has seen the record unchanged.
	Unchanged time.Duration
	// Stages is how many image volumes the node holds staged read-write.
	Stages int
}

// peerCollector reports the other nodes' leases on each scrape.
type peerCollector struct {
	states    func() []PeerLeaseState
	unchanged *prometheus.Desc
	stages    *prometheus.Desc
}

// WatchPeerLeases adds poolcsi_peer_lease_unchanged_seconds and
// poolcsi_peer_lease_rw_stages, per pool and node, from states (the
// controller's watch of every node's lease). A lease that stops changing
// while the node holds read-write stages is a node plugin that is down or cut
// off: if its node still runs, nothing fences its pods' writes.
func (m *Metrics) WatchPeerLeases(states func() []PeerLeaseState) {
	m.Registry.MustRegister(&peerCollector{
		states: states,
		unchanged: prometheus.NewDesc("poolcsi_peer_lease_unchanged_seconds",
			"Seconds this controller has seen a node's lease record in a shared pool unchanged, by its own clock. A node plugin renews every --lease-renew-interval; one that stops while its node runs fences nothing.",
			[]string{"pool", "node"}, nil),
		stages: prometheus.NewDesc("poolcsi_peer_lease_rw_stages",
			"Image volumes of a shared pool that a node holds staged read-write, by the pool's records (counted every 30 s at most).",
			[]string{"pool", "node"}, nil),
	})
}

func (c *peerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.unchanged
	ch <- c.stages
}

func (c *peerCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.states() {
		ch <- prometheus.MustNewConstMetric(c.unchanged, prometheus.GaugeValue, s.Unchanged.Seconds(), s.Pool, s.Node)
		ch <- prometheus.MustNewConstMetric(c.stages, prometheus.GaugeValue, float64(s.Stages), s.Pool, s.Node)
	}
}
