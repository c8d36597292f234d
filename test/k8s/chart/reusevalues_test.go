package chart

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
)

// firstRelease is the commit of chart 0.1.0, the one release so far, which has the
// per-node layout only and no localController value (test/k8s/harness TestUpgrade's
// previousRelease).
const firstRelease = "0fb0c1f"

// TestUpgradeValues renders the upgrade from a release in the per-node layout to this
// tree's chart, whose default is the central layout, with each way of giving values that
// docs/upgrade.md names, under Helm's rules for an upgrade's values (helmUpgrade), and
// checks which layout comes out. Helm's rules: --reuse-values renders with the
// *installed chart's* values (its defaults and what was set) under the new templates,
// the command line's values over them; --reset-then-reuse-values with the new chart's
// defaults, what was set at install over them, then the command line's; a plain upgrade
// with no values given reuses what was set at install over the new defaults, and one
// with any -f or --set takes those alone.
func TestUpgradeValues(t *testing.T) {
	current, err := loader.Load(render.ChartDir())
	if err != nil {
		t.Fatal(err)
	}
	// The chart as it was before the central layout became the default: the same, with
	// localController.central false among its defaults.
	earlier, err := loader.Load(render.ChartDir())
	if err != nil {
		t.Fatal(err)
	}
	earlier.Values["localController"].(map[string]any)["central"] = false
	first := firstReleaseChart(t)

	central := map[string]any{"localController": map[string]any{"central": true}}
	// 0.1.0's default shared pool needs the Secret it made named (docs/upgrade.md, "From
	// 0.1.0 to 0.2.0").
	shareKey := map[string]any{"shareKey": map[string]any{"existingSecret": "poolcsi-share-key"}}
	merge := func(ms ...map[string]any) map[string]any {
		out := map[string]any{}
		for _, m := range ms {
			for k, v := range m {
				out[k] = v
			}
		}
		return out
	}
	type mode int
	const (
		plain mode = iota
		reuse
		resetThenReuse
	)
	for _, tc := range []struct {
		name      string
		installed *chart.Chart
		installV  map[string]any
		mode      mode
		set       map[string]any
		// want: "central", "per-node", or the start of the error
		want string
	}{
		{"explicit false, --reuse-values", current, perNodeValues(), reuse, nil, "per-node"},
		{"explicit false, --reset-then-reuse-values", current, perNodeValues(), resetThenReuse, nil, "per-node"},
		{"explicit false, no values given", current, perNodeValues(), plain, nil, "per-node"},
		{"explicit false, --reuse-values --set central=true", current, perNodeValues(), reuse, central, "central"},
		{"explicit false, -f values without it", current, perNodeValues(), plain, map[string]any{"logLevel": 2}, "central"},
		{"earlier default, --reuse-values", earlier, nil, reuse, nil, "per-node"},
		{"earlier default, --reuse-values --set central=true", earlier, nil, reuse, central, "central"},
		{"earlier default, --reset-then-reuse-values", earlier, nil, resetThenReuse, nil, "central"},
		{"earlier default, no values given", earlier, nil, plain, nil, "central"},
		{"0.1.0, --reuse-values", first, nil, reuse, shareKey, "template: "},
		{"0.1.0, --reuse-values --set central=true", first, nil, reuse, merge(shareKey, central), "template: "},
		{"0.1.0, --reset-then-reuse-values", first, nil, resetThenReuse, shareKey, "central"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Upgrade.Run may change the chart's values (--reuse-values puts the old ones in).
			next, err := loader.Load(render.ChartDir())
			if err != nil {
				t.Fatal(err)
			}
			manifest, err := helmUpgrade(tc.installed, tc.installV, next, tc.set, tc.mode == reuse, tc.mode == resetThenReuse)
			got := ""
			switch {
			case err != nil:
				got = err.Error()
			case strings.Contains(manifest, "\n  name: poolcsi-local-controller\n") && !strings.Contains(manifest, "name: csi-provisioner-local"):
				got = "central"
			case !strings.Contains(manifest, "\n  name: poolcsi-local-controller\n") && strings.Contains(manifest, "name: csi-provisioner-local"):
				got = "per-node"
			default:
				got = "neither layout"
			}
			if !strings.HasPrefix(got, tc.want) {
				t.Fatalf("upgrade renders %q, want %q", got, tc.want)
			}
			t.Logf("%s", got)
		})
	}
}

// firstReleaseChart is chart 0.1.0, from this clone's history.
func firstReleaseChart(t testing.TB) *chart.Chart {
	t.Helper()
	dir := t.TempDir()
	root := render.RepoRoot()
	out, err := exec.Command("sh", "-c", `git -C "$1" archive --format=tar "$2" deploy/helm/poolcsi | tar -x -C "$3"`,
		"sh", root, firstRelease, dir).CombinedOutput()
	if err != nil {
		t.Fatalf("chart 0.1.0 from commit %s (a shallow clone? git fetch --unshallow): %v\n%s", firstRelease, err, out)
	}
	ch, err := loader.Load(filepath.Join(dir, "deploy", "helm", "poolcsi"))
	if err != nil {
		t.Fatal(err)
	}
	if ch.Metadata.Version != "0.1.0" {
		t.Fatalf("chart at %s is %s, want 0.1.0", firstRelease, ch.Metadata.Version)
	}
	return ch
}

// helmUpgrade renders next as `helm upgrade` does for a release installed from installed
// with the values installV (what was set at install, Helm's release Config), given the
// values set (-f, --set): the values as helm.sh/helm/v3/pkg/action Upgrade.reuseValues
// (v3.22) makes them, then validated against next's schema and rendered as Helm's
// engine does. It returns every rendered template, joined. (Helm's action package itself
// would bring kubectl and a SQL driver into this module's dependencies.)
func helmUpgrade(installed *chart.Chart, installV map[string]any, next *chart.Chart, set map[string]any, reuseValues, resetThenReuse bool) (string, error) {
	config := installV
	if config == nil {
		config = map[string]any{}
	}
	vals := chartutil.CoalesceTables(map[string]any{}, set)
	switch {
	case reuseValues:
		old, err := chartutil.CoalesceValues(installed, config)
		if err != nil {
			return "", err
		}
		vals = chartutil.CoalesceTables(vals, config)
		next.Values = old
	case resetThenReuse:
		vals = chartutil.CoalesceTables(vals, config)
	case len(vals) == 0 && len(config) > 0:
		vals = config
	}
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = chartutil.KubeVersion{Version: "v1.33.0", Major: "1", Minor: "33"}
	top, err := chartutil.ToRenderValues(next, vals, chartutil.ReleaseOptions{
		Name: render.ReleaseName, Namespace: render.Namespace, Revision: 2, IsUpgrade: true,
	}, caps)
	if err != nil {
		return "", err
	}
	out, err := engine.Render(next, top)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for name, text := range out {
		if strings.HasSuffix(name, ".yaml") {
			b.WriteString("\n---\n" + text)
		}
	}
	return b.String(), nil
}
