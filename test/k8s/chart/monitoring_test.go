package chart

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"

	"sigs.k8s.io/yaml"
)

// monitoringOn turns every piece of the monitoring kit on.
func monitoringOn() map[string]any {
	return map[string]any{
		"service":        map[string]any{"enabled": true},
		"serviceMonitor": map[string]any{"enabled": true, "labels": map[string]any{"release": "kube-prometheus-stack"}},
		"podMonitor":     map[string]any{"enabled": true},
		"prometheusRule": map[string]any{"enabled": true},
		"dashboard":      map[string]any{"enabled": true},
	}
}

// TestMonitoringKit: the monitoring pieces are off by default, each on by its value, and
// they scrape the ports the pods declare.
func TestMonitoringKit(t *testing.T) {
	kinds := []string{"Service/poolcsi-metrics", "ServiceMonitor/poolcsi", "PodMonitor/poolcsi", "PrometheusRule/poolcsi", "ConfigMap/poolcsi-dashboard"}
	docs, err := render.Render(render.ChartDir(), "", withSharedPool(nil))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		for _, k := range kinds {
			if d.Kind+"/"+d.Name == k {
				t.Errorf("%s rendered with the default values: the monitoring kit is opt-in", k)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		values map[string]any
		ports  []string
	}{
		{"local pool only", map[string]any{"monitoring": monitoringOn()}, []string{"local-metrics"}},
		{"with a shared pool", withSharedPool(map[string]any{"monitoring": monitoringOn()}), []string{"metrics", "local-metrics"}},
		// The local driver's central controller serves local-metrics too.
		{"central local controller", withCentral(map[string]any{"monitoring": monitoringOn()}), []string{"local-metrics"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			docs, err := render.Render(render.ChartDir(), "", tc.values)
			if err != nil {
				t.Fatal(err)
			}
			have := map[string]render.Doc{}
			var podYAML string
			for _, d := range docs {
				have[d.Kind+"/"+d.Name] = d
				if d.Kind == "DaemonSet" || d.Kind == "Deployment" {
					podYAML += d.YAML
				}
			}
			if d, ok := have["Deployment/poolcsi-local-controller"]; ok && !strings.Contains(d.YAML, "- name: local-metrics\n") {
				t.Errorf("the local controller does not declare the port local-metrics:\n%s", d.YAML)
			}
			for _, k := range kinds {
				if _, ok := have[k]; !ok {
					t.Errorf("missing %s", k)
				}
			}
			for _, p := range tc.ports {
				if !strings.Contains(podYAML, "- name: "+p+"\n") {
					t.Errorf("no pod declares the port %s the monitors scrape", p)
				}
				for _, k := range []string{"Service/poolcsi-metrics", "ServiceMonitor/poolcsi", "PodMonitor/poolcsi"} {
					if !strings.Contains(have[k].YAML, "port: "+p+"\n") && !strings.Contains(have[k].YAML, "name: "+p+"\n") {
						t.Errorf("%s does not scrape %s:\n%s", k, p, have[k].YAML)
					}
				}
			}
			if !strings.Contains(have["ServiceMonitor/poolcsi"].YAML, "release: kube-prometheus-stack") {
				t.Errorf("ServiceMonitor lacks its labels:\n%s", have["ServiceMonitor/poolcsi"].YAML)
			}
			var cm struct {
				Metadata struct{ Labels map[string]string }
				Data     map[string]string
			}
			if err := yaml.Unmarshal([]byte(have["ConfigMap/poolcsi-dashboard"].YAML), &cm); err != nil {
				t.Fatal(err)
			}
			if cm.Metadata.Labels["grafana_dashboard"] != "1" {
				t.Errorf("dashboard ConfigMap lacks the grafana_dashboard label: %v", cm.Metadata.Labels)
			}
			var dash map[string]any
			if err := json.Unmarshal([]byte(cm.Data["poolcsi.json"]), &dash); err != nil {
				t.Errorf("the dashboard is not JSON: %v", err)
			}
		})
	}
}

// TestAlertRules checks the PrometheusRule's rules with promtool (Debian's prometheus
// package; hack/install-deps.sh installs it): syntax, PromQL, templates of annotations.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool is needed to check the chart's alert rules: install Debian's prometheus package (apt-get install prometheus; hack/install-deps.sh does): %v", err)
	}
	// Every rule: a shared pool's, and the local driver's central controller's.
	docs, err := render.Render(render.ChartDir(), "", withSharedPool(withCentral(map[string]any{"monitoring": monitoringOn()})))
	if err != nil {
		t.Fatal(err)
	}
	var rule struct {
		Spec struct {
			Groups []any `json:"groups"`
		} `json:"spec"`
	}
	for _, d := range docs {
		if d.Kind == "PrometheusRule" {
			if err := yaml.UnmarshalStrict([]byte(d.YAML), &map[string]any{}); err != nil {
				t.Fatal(err)
			}
			if err := yaml.Unmarshal([]byte(d.YAML), &rule); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(rule.Spec.Groups) == 0 {
		t.Fatal("no PrometheusRule, or one without groups")
	}
	b, err := yaml.Marshal(map[string]any{"groups": rule.Spec.Groups})
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "poolcsi-rules.yaml")
	if err := os.WriteFile(file, b, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(promtool, "check", "rules", file).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool check rules: %v\n%s\nrules:\n%s", err, out, b)
	}
	t.Logf("promtool check rules: %s", strings.TrimSpace(string(out)))

	// And that they fire on the series an operator should hear about, and not on a healthy
	// node's (promtool test rules: input series, then the alerts expected at a time).
	// The annotations are left out of this copy: promtool compares them whole.
	var bare struct {
		Groups []struct {
			Name  string           `json:"name"`
			Rules []map[string]any `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(b, &bare); err != nil {
		t.Fatal(err)
	}
	for _, g := range bare.Groups {
		for _, r := range g.Rules {
			delete(r, "annotations")
		}
	}
	bb, err := yaml.Marshal(bare)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Dir(file)
	tests := filepath.Join(dir, "poolcsi-rules-test.yaml")
	if err := os.WriteFile(filepath.Join(dir, "poolcsi-rules-bare.yaml"), bb, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tests, []byte(alertTests), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "test", "rules", tests).CombinedOutput(); err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
	for _, want := range []string{"PoolcsiPoolDown", "PoolcsiVolumeAbnormal", "PoolcsiVolumeDataLoss", "PoolcsiNodeFenced",
		"PoolcsiLeaseNotRenewed", "PoolcsiPoolCapacityLow", "PoolcsiCSIErrors", "PoolcsiCentralNodeNotLive", "PoolcsiCentralNodeCallsFailing"} {
		if !strings.Contains(string(b), "alert: "+want+"\n") {
			t.Errorf("the rules lack the alert %s", want)
		}
	}
}

// alertTests are promtool's rule unit tests of the chart's alerts (default thresholds).
const alertTests = `rule_files: [poolcsi-rules-bare.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'poolcsi_pool_up{pool="shared", node="a"}'
        values: '0x10'
      - series: 'poolcsi_pool_up{pool="local", node="b"}'
        values: '1x10'
      - series: 'poolcsi_lease_fenced{pool="shared", node="a"}'
        values: '0 0 1x8'
      - series: 'poolcsi_lease_age_seconds{pool="shared", node="a"}'
        values: '5 45 65 70 75 80 85 90 95 100 105'
      - series: 'poolcsi_lease_fenced{pool="shared", node="b"}'
        values: '0x20'
      - series: 'poolcsi_lease_age_seconds{pool="shared", node="b"}'
        values: '-1x20'
      - series: 'poolcsi_pool_free_bytes{pool="local", node="b"}'
        values: '5x20'
      - series: 'poolcsi_pool_size_bytes{pool="local", node="b"}'
        values: '100x20'
      - series: 'poolcsi_central_node_live{namespace="poolcsi", pod="ctl-1", node="a"}'
        values: '1 1 0x10'
      - series: 'poolcsi_central_node_live{namespace="poolcsi", pod="ctl-1", node="b"}'
        values: '1x20'
      - series: 'poolcsi_central_node_calls_total{namespace="poolcsi", pod="ctl-1", node="a", method="CreateVolume", code="OK"}'
        values: '0+1x30'
      - series: 'poolcsi_central_node_calls_total{namespace="poolcsi", pod="ctl-1", node="a", method="CreateVolume", code="Unavailable"}'
        values: '0+1x30'
      - series: 'poolcsi_central_node_calls_total{namespace="poolcsi", pod="ctl-1", node="b", method="CreateVolume", code="OK"}'
        values: '0+10x30'
      - series: 'poolcsi_central_node_calls_total{namespace="poolcsi", pod="ctl-1", node="b", method="DeleteVolume", code="Aborted"}'
        values: '0+10x30'
    alert_rule_test:
      - eval_time: 6m
        alertname: PoolcsiPoolDown
        exp_alerts:
          - exp_labels: {severity: critical, pool: shared, node: a}
      - eval_time: 3m
        alertname: PoolcsiNodeFenced
        exp_alerts:
          - exp_labels: {severity: critical, pool: shared, node: a}
      - eval_time: 2m
        alertname: PoolcsiLeaseNotRenewed
        exp_alerts: []
      - eval_time: 16m
        alertname: PoolcsiPoolCapacityLow
        exp_alerts:
          - exp_labels: {severity: warning, pool: local, node: b}
      - eval_time: 11m
        alertname: PoolcsiLeaseNeverRenewed
        exp_alerts:
          - exp_labels: {severity: warning, pool: shared, node: b}
      - eval_time: 6m
        alertname: PoolcsiCentralNodeNotLive
        exp_alerts: []
      - eval_time: 8m
        alertname: PoolcsiCentralNodeNotLive
        exp_alerts:
          - exp_labels: {severity: warning, namespace: poolcsi, node: a}
      - eval_time: 26m
        alertname: PoolcsiCentralNodeCallsFailing
        exp_alerts:
          - exp_labels: {severity: warning, namespace: poolcsi, node: a}
`
