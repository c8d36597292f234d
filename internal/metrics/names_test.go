package metrics

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/cache"

	"github.com/poolcsi/poolcsi/internal/central"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// registeredNames is every metric family a poolcsi process registers: the call histogram,
// the pool gauges, the lease gauges, the Go and process collectors, and the central
// controller's.
func registeredNames(t *testing.T) map[string]bool {
	t.Helper()
	m := New("poolcsi.io", "node-1", nil, health.Options{})
	m.WatchLeases(func() []LeaseState { return []LeaseState{{Pool: "shared"}} })
	m.WatchPeerLeases(func() []PeerLeaseState { return []PeerLeaseState{{Pool: "shared", Node: "n"}} })
	m.calls.WithLabelValues("poolcsi.io", "/csi.v1.Identity/Probe", "OK").Observe(0)
	names := map[string]bool{}
	families, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		names[f.GetName()] = true
	}
	// The pool gauges are only gathered with a pool: their descriptions name them all.
	ch := make(chan *prometheus.Desc, 64)
	newPoolCollector("node-1", nil, health.Options{}).Describe(ch)
	close(ch)
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	for d := range ch {
		match := fq.FindStringSubmatch(d.String())
		if match == nil {
			t.Fatalf("cannot read the name of %s", d)
		}
		names[match[1]] = true
	}
	// The central controller's (--local-central): every collector it registers,
	// described (its vectors gather nothing before a call).
	capture := &capturing{}
	calls := cache.NewSharedIndexInformer(&cache.ListWatch{}, &unstructured.Unstructured{}, 0, nil)
	if _, err := central.NewMetrics(central.MetricsDeps{Registry: capture, Nodes: noNodes{}, Calls: calls}); err != nil {
		t.Fatal(err)
	}
	for _, c := range capture.cs {
		ch := make(chan *prometheus.Desc, 64)
		c.Describe(ch)
		close(ch)
		for d := range ch {
			match := fq.FindStringSubmatch(d.String())
			if match == nil {
				t.Fatalf("cannot read the name of %s", d)
			}
			names[match[1]] = true
		}
	}
	return names
}

// capturing is a prometheus.Registerer that keeps what is registered.
type capturing struct{ cs []prometheus.Collector }

func (c *capturing) Register(col prometheus.Collector) error {
	c.cs = append(c.cs, col)
	return nil
}

func (c *capturing) MustRegister(cols ...prometheus.Collector) { c.cs = append(c.cs, cols...) }
func (c *capturing) Unregister(prometheus.Collector) bool      { return false }

// noNodes is a central.Nodes without nodes.
type noNodes struct{}

func (noNodes) Live(string) (bool, time.Duration)    { return false, 0 }
func (noNodes) AwaitVerdict(context.Context, string) {}
func (noNodes) Known() []string                      { return nil }
func (noNodes) Pools(string) []nodecall.PoolCapacity { return nil }
func (noNodes) Synced() bool                         { return true }

// metricRef matches a poolcsi metric name where the chart's rules, its dashboard and
// docs/metrics.md write one.
var metricRef = regexp.MustCompile(`\b(?:poolcsi|csi_plugin)_[a-z0-9_]*[a-z0-9]\b`)

// family is the metric family a series name belongs to (a histogram's _bucket, _count and
// _sum are its own).
func family(name string, registered map[string]bool) string {
	for _, s := range []string{"_bucket", "_count", "_sum"} {
		if base, ok := strings.CutSuffix(name, s); ok && registered[base] {
			return base
		}
	}
	return name
}

// TestMetricNamesExist: every metric the chart's alert rules, its Grafana dashboard and
// docs/metrics.md name is one poolcsi registers (a renamed metric would leave an alert that
// never fires), and docs/metrics.md documents every poolcsi metric registered.
func TestMetricNamesExist(t *testing.T) {
	registered := registeredNames(t)
	root := filepath.Join("..", "..")
	files := []string{
		"deploy/helm/poolcsi/templates/prometheusrule.yaml",
		"deploy/helm/poolcsi/dashboards/poolcsi.json",
		"docs/metrics.md",
	}
	named := map[string]map[string]bool{}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		named[f] = map[string]bool{}
		for _, n := range metricRef.FindAllString(string(b), -1) {
			named[f][family(n, registered)] = true
		}
		if len(named[f]) == 0 {
			t.Errorf("%s names no poolcsi metric", f)
		}
		for n := range named[f] {
			if !registered[n] {
				t.Errorf("%s names %s, which poolcsi does not register", f, n)
			}
		}
	}
	var missing []string
	for n := range registered {
		if metricRef.MatchString(n) && !named["docs/metrics.md"][n] {
			missing = append(missing, n)
		}
	}
	sort.Strings(missing)
	for _, n := range missing {
		t.Errorf("docs/metrics.md does not document %s", n)
	}
}
