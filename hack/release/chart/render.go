// Package chart renders the poolcsi Helm chart in-process (with Helm's own template engine),
// so that the plain YAML kept in deploy/kubernetes can be regenerated and checked for drift
// without a helm binary.
package chart

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"sigs.k8s.io/yaml"
)

// Release names the release the plain YAML is rendered as.
const (
	ReleaseName = "poolcsi"
	Namespace   = "poolcsi"
)

// RepoRoot returns the root of the poolcsi checkout (three levels above this file).
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", ".."))
}

// ChartDir, RenderedFile and RenderedValues are the files the drift test ties together.
func ChartDir() string       { return filepath.Join(RepoRoot(), "deploy", "helm", "poolcsi") }
func RenderedFile() string   { return filepath.Join(RepoRoot(), "deploy", "kubernetes", "poolcsi.yaml") }
func RenderedValues() string { return filepath.Join(RepoRoot(), "deploy", "kubernetes", "values.yaml") }

// installOrder is the order `helm install` creates kinds in (a subset of Helm's list).
var installOrder = []string{
	"Namespace", "ServiceAccount", "Secret", "ConfigMap", "StorageClass", "CustomResourceDefinition",
	"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service",
	"DaemonSet", "Deployment", "CSIDriver",
}

func kindRank(kind string) int {
	for i, k := range installOrder {
		if k == kind {
			return i
		}
	}
	return len(installOrder)
}

// Doc is one rendered object.
type Doc struct {
	Source string // template file it came from
	Kind   string
	Name   string
	YAML   string
}

// renderFiles renders every template of chartDir with the values file (may be "") plus
// overrides, as `helm install` does: the user's values coalesced with the chart's, then
// validated against the chart's values.schema.json (chartutil.ToRenderValues is
// ToRenderValuesWithSchemaValidation without skipping, the call `helm install` and
// `helm upgrade` make unless --skip-schema-validation), then rendered.
func renderFiles(chartDir, valuesFile string, overrides map[string]any) (*chart.Chart, map[string]string, error) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		return nil, nil, fmt.Errorf("load chart: %w", err)
	}
	vals := map[string]any{}
	if valuesFile != "" {
		v, err := chartutil.ReadValuesFile(valuesFile)
		if err != nil {
			return nil, nil, err
		}
		vals = v.AsMap()
	}
	vals = chartutil.CoalesceTables(overrides, vals)
	// Subcharts' conditions and import-values, as `helm install` processes them (an
	// umbrella chart with poolcsi as its dependency; nothing for poolcsi itself).
	if err := chartutil.ProcessDependenciesWithMerge(ch, vals); err != nil {
		return nil, nil, fmt.Errorf("dependencies: %w", err)
	}
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = chartutil.KubeVersion{Version: "v1.36.3", Major: "1", Minor: "36"}
	top, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{
		Name: ReleaseName, Namespace: Namespace, Revision: 1, IsInstall: true,
	}, caps)
	if err != nil {
		return nil, nil, fmt.Errorf("values: %w", err)
	}
	out, err := engine.Render(ch, top)
	if err != nil {
		return nil, nil, fmt.Errorf("render: %w", err)
	}
	return ch, out, nil
}

// RenderNotes renders the chart's NOTES.txt, what `helm install` prints.
func RenderNotes(chartDir, valuesFile string, overrides map[string]any) (string, error) {
	ch, out, err := renderFiles(chartDir, valuesFile, overrides)
	if err != nil {
		return "", err
	}
	notes, ok := out[ch.Name()+"/templates/NOTES.txt"]
	if !ok {
		return "", fmt.Errorf("chart %s has no templates/NOTES.txt", chartDir)
	}
	return notes, nil
}

// Render renders chartDir with the values file (may be "") plus overrides and returns the
// objects in install order. Values the chart's schema refuses are an error, as with
// `helm install`.
func Render(chartDir, valuesFile string, overrides map[string]any) ([]Doc, error) {
	ch, out, err := renderFiles(chartDir, valuesFile, overrides)
	if err != nil {
		return nil, err
	}
	var docs []Doc
	for src, text := range out {
		if !strings.HasSuffix(src, ".yaml") {
			continue // NOTES.txt, helpers
		}
		for _, part := range strings.Split(text, "\n---") {
			part = strings.TrimSpace(strings.TrimPrefix(part, "---"))
			if part == "" || isOnlyComments(part) {
				continue
			}
			var meta struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(part), &meta); err != nil {
				return nil, fmt.Errorf("%s: not YAML: %w\n%s", src, err, part)
			}
			if meta.Kind == "" || meta.Metadata.Name == "" {
				return nil, fmt.Errorf("%s: object without kind or name:\n%s", src, part)
			}
			docs = append(docs, Doc{Source: strings.TrimPrefix(src, ch.Name()+"/"), Kind: meta.Kind, Name: meta.Metadata.Name, YAML: part})
		}
	}
	sort.SliceStable(docs, func(i, j int) bool {
		a, b := docs[i], docs[j]
		if ra, rb := kindRank(a.Kind), kindRank(b.Kind); ra != rb {
			return ra < rb
		}
		if a.Kind != b.Kind {
			return a.Kind < b.Kind
		}
		return a.Name < b.Name
	})
	return docs, nil
}

func isOnlyComments(s string) bool {
	for _, l := range strings.Split(s, "\n") {
		if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, "#") {
			return false
		}
	}
	return true
}

// Join writes the documents as one multi-document YAML file, as `helm template` would.
func Join(docs []Doc) []byte {
	var b bytes.Buffer
	b.WriteString("# Generated from deploy/helm/poolcsi with deploy/kubernetes/values.yaml\n")
	b.WriteString("# (release \"" + ReleaseName + "\", namespace \"" + Namespace + "\"). Do not edit by hand:\n")
	b.WriteString("#   cd test/k8s && go run ./cmd/render\n")
	for _, d := range docs {
		b.WriteString("---\n# Source: poolcsi/" + d.Source + "\n")
		b.WriteString(d.YAML)
		b.WriteString("\n")
	}
	return b.Bytes()
}

// RenderRepo renders the chart exactly as deploy/kubernetes/poolcsi.yaml is produced.
func RenderRepo() ([]byte, error) {
	docs, err := Render(ChartDir(), RenderedValues(), nil)
	if err != nil {
		return nil, err
	}
	return Join(docs), nil
}

// WriteRepo regenerates deploy/kubernetes/poolcsi.yaml.
func WriteRepo() error {
	b, err := RenderRepo()
	if err != nil {
		return err
	}
	return os.WriteFile(RenderedFile(), b, 0o644)
}

// SharedPoolPath and ShareKeySecret are the shared pool the test clusters mount (the
// chart's default before 0.2.0, which installs the local pool only) and the Secret that
// holds its share key.
const (
	SharedPoolPath = "/mnt/poolcsi-shared"
	ShareKeySecret = "poolcsi-share-key" //nolint:gosec // the Secret's name, not a credential
)

// SharedPoolValues are chart values that add the shared pool "shared" at SharedPoolPath,
// its share key read from the Secret ShareKeySecret (which whoever installs makes first),
// to the chart's default local pool. A fresh map each call: callers add to it.
func SharedPoolValues() map[string]any {
	return map[string]any{
		"pools":    map[string]any{"shared": []any{map[string]any{"name": "shared", "path": SharedPoolPath}}},
		"shareKey": map[string]any{"existingSecret": ShareKeySecret},
	}
}
