package metrics

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestPoolSeriesNameTheNode: every series of the pool collector carries the reporting
// process's node, so the controller's and each node plugin's series of one shared pool
// (and each node's local pool of one name) are told apart by the driver itself, not
// only by the scrape's target labels.
func TestPoolSeriesNameTheNode(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "shared")
	if _, err := pool.Initialise(pool.Config{Name: "shared", Path: dir, Shared: true}); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{} // series, labels included, over both processes
	for _, node := range []string{"node-a", "node-b"} {
		p, err := pool.Open(pool.Config{Name: "shared", Path: dir, Shared: true})
		if err != nil {
			t.Fatal(err)
		}
		m := New("poolcsi.io", node, []*pool.Pool{p}, health.DefaultOptions)
		families, err := m.Registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, f := range families {
			if !strings.HasPrefix(f.GetName(), "poolcsi_pool_") && f.GetName() != "poolcsi_volume_health_issues" {
				continue
			}
			for _, s := range f.GetMetric() {
				labels := map[string]string{}
				var key strings.Builder
				key.WriteString(f.GetName())
				for _, l := range s.GetLabel() {
					labels[l.GetName()] = l.GetValue()
					key.WriteString("," + l.GetName() + "=" + l.GetValue())
				}
				if labels["node"] != node || labels["pool"] != "shared" {
					t.Errorf("%s of %s: labels %v, want node %q and pool shared", f.GetName(), node, labels, node)
				}
				if seen[key.String()] {
					t.Errorf("two processes report the same series %s", key.String())
				}
				seen[key.String()] = true
				n++
			}
		}
		if n < 7 {
			t.Errorf("%s: %d pool series, want the 7 gauges at least", node, n)
		}
	}
}
