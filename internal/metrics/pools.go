package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// poolCollector measures pools when scraped, so the numbers are never stale and
// nothing runs between scrapes.
type poolCollector struct {
	pools []*pool.Pool
	opts  health.Options

	up, size, free, allocated, provisioned, volumes, byCondition, issues *prometheus.Desc
}

// newPoolCollector labels every series with node, the reporting process's node: a
// shared pool is reported by the controller and by every node plugin, a local pool of
// one name by every node, and without it their series would differ by the scrape's
// target labels only (docs/metrics.md).
func newPoolCollector(node string, pools []*pool.Pool, o health.Options) *poolCollector {
	l := []string{"pool"}
	c := prometheus.Labels{"node": node}
	return &poolCollector{
		pools:       pools,
		opts:        o,
		up:          prometheus.NewDesc("poolcsi_pool_up", "1 when the pool is present, writable and not out of space, else 0 (Probe runs this check but answers ready either way).", l, c),
		size:        prometheus.NewDesc("poolcsi_pool_size_bytes", "Size of the pool's filesystem.", l, c),
		free:        prometheus.NewDesc("poolcsi_pool_free_bytes", "Bytes of the pool's filesystem still free for the driver.", l, c),
		allocated:   prometheus.NewDesc("poolcsi_pool_allocated_bytes", "Bytes the pool's volume images hold on its filesystem (sparse images hold less than their capacity).", l, c),
		provisioned: prometheus.NewDesc("poolcsi_pool_provisioned_bytes", "Sum of the capacities of the pool's volumes.", l, c),
		volumes:     prometheus.NewDesc("poolcsi_pool_volumes", "Volumes in the pool, damaged ones included.", l, c),
		byCondition: prometheus.NewDesc("poolcsi_pool_volumes_by_condition", "Volumes in the pool by controller-side condition (normal or abnormal).", []string{"pool", "condition"}, c),
		issues:      prometheus.NewDesc("poolcsi_volume_health_issues", "Controller-side health issues of the pool's volumes, by status and reason.", []string{"pool", "status", "reason"}, c),
	}
}

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.size, c.free, c.allocated, c.provisioned, c.volumes, c.byCondition, c.issues} {
		ch <- d
	}
}

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range c.pools {
		up := 1.0
		if _, err := health.CheckPoolReady(p); err != nil {
			up = 0
		}
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, up, p.Name())
		scan, err := health.ScanPool(p, c.opts)
		if scan.Space.Err == nil {
			ch <- prometheus.MustNewConstMetric(c.size, prometheus.GaugeValue, float64(scan.Space.Total), p.Name())
			ch <- prometheus.MustNewConstMetric(c.free, prometheus.GaugeValue, float64(scan.Space.Free), p.Name())
		}
		if err != nil {
			klog.V(2).InfoS("Metrics: cannot list pool", "pool", p.Name(), "err", err)
			continue
		}
		var allocated, provisioned float64
		conditions := map[string]float64{"normal": 0, "abnormal": 0}
		type key struct{ status, reason string }
		issues := map[key]float64{}
		for _, v := range scan.Volumes {
			allocated += float64(v.AllocatedBytes)
			if v.Volume != nil {
				provisioned += float64(v.Volume.CapacityBytes)
			}
			if len(v.Issues) == 0 {
				conditions["normal"]++
			} else {
				conditions["abnormal"]++
			}
			for _, i := range v.Issues {
				issues[key{i.Status.String(), i.Reason}]++
			}
		}
		ch <- prometheus.MustNewConstMetric(c.allocated, prometheus.GaugeValue, allocated, p.Name())
		ch <- prometheus.MustNewConstMetric(c.provisioned, prometheus.GaugeValue, provisioned, p.Name())
		ch <- prometheus.MustNewConstMetric(c.volumes, prometheus.GaugeValue, float64(len(scan.Volumes)), p.Name())
		for cond, n := range conditions {
			ch <- prometheus.MustNewConstMetric(c.byCondition, prometheus.GaugeValue, n, p.Name(), cond)
		}
		for k, n := range issues {
			ch <- prometheus.MustNewConstMetric(c.issues, prometheus.GaugeValue, n, p.Name(), k.status, k.reason)
		}
	}
}
