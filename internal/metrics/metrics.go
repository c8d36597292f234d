// Package metrics serves poolcsi's Prometheus metrics: a latency histogram of
// every CSI call (its _count is the call count) and, computed on each scrape,
// the size, free space, allocation, volume count and volume health of every pool.
//
// The call histogram has the name and labels of csi-lib-utils' plugin metric
// (csi_plugin_operations_seconds{driver_name,method_name,grpc_status_code}), so
// dashboards made for the kubernetes-csi sidecars and drivers work unchanged.
// It is built with client_golang directly rather than through csi-lib-utils/
// metrics because that manager fixes the buckets at 0.1 s and up: nearly every
// poolcsi call (Probe, stats, health, publish) takes well under 0.1 s, so they
// would all land in the first bucket; it would also pull k8s.io/component-base
// into the binary for one histogram.
package metrics

import (
	"context"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Buckets cover a statfs-sized call (100 µs) up to a slow mkfs of a large
// volume (minutes).
var Buckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// Metrics is one process's registry.
type Metrics struct {
	Registry *prometheus.Registry
	calls    *prometheus.HistogramVec
	driver   string
}

// New registers the call histogram, the pool collector and the Go/process
// collectors. Pools are measured on each scrape with the given health thresholds;
// their series carry node, this process's node ID.
func New(driverName, node string, pools []*pool.Pool, o health.Options) *Metrics {
	m := &Metrics{Registry: prometheus.NewRegistry(), driver: driverName}
	m.calls = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Subsystem: "csi_plugin",
		Name:      "operations_seconds",
		Help:      "Duration of CSI calls served, by method and gRPC status code.",
		Buckets:   Buckets,
	}, []string{"driver_name", "method_name", "grpc_status_code"})
	m.Registry.MustRegister(m.calls, newPoolCollector(node, pools, o),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Interceptor records every unary call's duration and status code.
func (m *Metrics) Interceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	m.calls.WithLabelValues(m.driver, info.FullMethod, status.Code(err).String()).Observe(time.Since(start).Seconds())
	return resp, err
}

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}
