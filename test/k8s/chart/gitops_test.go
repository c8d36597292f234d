package chart

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"
)

// TestRenderIsRepeatable: `helm template` of the same values gives the same objects every
// time, as Argo CD and Flux need (they diff each render against the cluster). Before 0.2.0
// the share key Secret was random at every render without a cluster to look it up in.
func TestRenderIsRepeatable(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values map[string]any
	}{
		{"defaults", nil},
		{"a shared pool with shares", withSharedPool(nil)},
		{"everything on", withSharedPool(map[string]any{"snapshots": map[string]any{"local": true},
			"snapshotClass": map[string]any{"create": true}, "groupSnapshotClass": map[string]any{"create": true},
			"storageClasses": []any{map[string]any{"name": "a", "pool": "local"}}})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			first, err := render.Render(render.ChartDir(), "", tc.values)
			if err != nil {
				t.Fatal(err)
			}
			second, err := render.Render(render.ChartDir(), "", tc.values)
			if err != nil {
				t.Fatal(err)
			}
			a, b := render.Join(first), render.Join(second)
			if !bytes.Equal(a, b) {
				al, bl := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
				for i := 0; i < len(al) && i < len(bl); i++ {
					if al[i] != bl[i] {
						t.Fatalf("two renders of the same values differ at line %d:\n  %s\n  %s", i+1, al[i], bl[i])
					}
				}
				t.Fatalf("two renders of the same values differ in length: %d and %d lines", len(al), len(bl))
			}
		})
	}
}

// TestShareKeyNeeded: with a shared pool and shares on, the chart refuses to render without
// the Secret holding the share key, and says how to make one and how to name it.
func TestShareKeyNeeded(t *testing.T) {
	_, err := render.Render(render.ChartDir(), "", map[string]any{"pools": render.SharedPoolValues()["pools"]})
	if err == nil {
		t.Fatal("rendered a shared pool with shares on and no share key")
	}
	for _, w := range []string{"needs the cluster's share key", "kubectl -n poolcsi create secret generic poolcsi-share-key",
		"--set shareKey.existingSecret=poolcsi-share-key", "shares.enabled=false"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("the refusal lacks %q:\n%v", w, err)
		}
	}
	if strings.Contains(err.Error(), schemaRefusal) {
		t.Errorf("refused by the schema, not by the chart's own check:\n%v", err)
	}
}

// TestUmbrellaChart renders poolcsi as the dependency of a parent chart, as a platform team
// ships it: Helm gives the subchart the parent's `global` values (which a strict schema
// without `global` refused) and the values under the dependency's name.
func TestUmbrellaChart(t *testing.T) {
	dir := t.TempDir()
	umbrella := filepath.Join(dir, "platform")
	if err := os.MkdirAll(filepath.Join(umbrella, "charts"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.CopyFS(filepath.Join(umbrella, "charts", "poolcsi"), os.DirFS(render.ChartDir())); err != nil {
		t.Fatal(err)
	}
	version := repoVersion(t)
	files := map[string]string{
		"Chart.yaml": `apiVersion: v2
name: platform
version: 1.0.0
dependencies:
  - name: poolcsi
    version: "` + version + `"
    condition: poolcsi.enabled
`,
		"values.yaml": `global:
  imageRegistry: registry.example.com
  imagePullSecrets: []
poolcsi:
  enabled: true
  pools:
    shared:
      - {name: shared, path: /mnt/poolcsi-shared}
  shareKey:
    existingSecret: platform-share-key
`,
		"templates/configmap.yaml": `apiVersion: v1
kind: ConfigMap
metadata:
  name: platform
data:
  registry: {{ .Values.global.imageRegistry }}
`,
	}
	for name, text := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(umbrella, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(umbrella, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The parent's values.yaml holds `enabled`, which poolcsi's schema does not know: Helm
	// validates a subchart against its values after the condition is read, and the
	// condition key is where Helm documents it. Check that this, too, is accepted.
	docs, err := render.Render(umbrella, "", nil)
	if err != nil {
		t.Fatalf("the umbrella chart does not render: %v", err)
	}
	have := map[string]render.Doc{}
	for _, d := range docs {
		have[d.Kind+"/"+d.Name] = d
	}
	for _, w := range []string{"ConfigMap/platform", "DaemonSet/poolcsi-node", "Deployment/poolcsi-controller", "CSIDriver/poolcsi.io", "CSIDriver/local.poolcsi.io"} {
		if _, ok := have[w]; !ok {
			t.Errorf("the umbrella chart lacks %s", w)
		}
	}
	if d := have["Deployment/poolcsi-controller"]; !strings.Contains(d.YAML, "secretName: platform-share-key") {
		t.Errorf("the subchart did not take its values from the parent's poolcsi key:\n%s", d.YAML)
	}

	// And off through its condition.
	docs, err = render.Render(umbrella, "", map[string]any{"poolcsi": map[string]any{"enabled": false}})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		if d.Kind != "ConfigMap" || d.Name != "platform" {
			t.Errorf("poolcsi.enabled=false still renders %s/%s", d.Kind, d.Name)
		}
	}
}
