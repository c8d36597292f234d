package metrics

import (
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/internal/health"
)

// TestPeerLeaseMetrics: the controller's watch of a node's lease is exported
// per pool and node.
func TestPeerLeaseMetrics(t *testing.T) {
	m := New("poolcsi.test", "node-1", nil, health.DefaultOptions)
	m.WatchPeerLeases(func() []PeerLeaseState {
		return []PeerLeaseState{{Pool: "shared", Node: "node-a", Unchanged: 42 * time.Second, Stages: 2}}
	})
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"poolcsi_peer_lease_unchanged_seconds": 42, "poolcsi_peer_lease_rw_stages": 2}
	for _, mf := range mfs {
		v, ok := want[mf.GetName()]
		if !ok {
			continue
		}
		delete(want, mf.GetName())
		ms := mf.GetMetric()
		if len(ms) != 1 || ms[0].GetGauge().GetValue() != v {
			t.Fatalf("%s: %v, want one series of %v", mf.GetName(), ms, v)
		}
		labels := map[string]string{}
		for _, l := range ms[0].GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		if labels["pool"] != "shared" || labels["node"] != "node-a" {
			t.Fatalf("%s labels: %v", mf.GetName(), labels)
		}
	}
	if len(want) > 0 {
		t.Fatalf("not exported: %v", want)
	}
}
