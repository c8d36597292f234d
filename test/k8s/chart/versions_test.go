package chart

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"

	"sigs.k8s.io/yaml"
)

// semver is Semantic Versioning 2.0.0's version, without a leading v.
var semver = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$`)

// repoVersion is the VERSION file at the repository's root: the one place the version is
// written.
func repoVersion(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(render.RepoRoot(), "VERSION"))
	if err != nil {
		t.Fatalf("the version's one source: %v", err)
	}
	v := strings.TrimSpace(string(b))
	if !semver.MatchString(v) {
		t.Fatalf("VERSION holds %q, not a semantic version (MAJOR.MINOR.PATCH)", v)
	}
	return v
}

// TestVersionsAgree fails when anything that carries the version (the Makefile's VERSION,
// which goes into the binary's ldflags, and its IMAGE_TAG, the chart's version and
// appVersion, the Dockerfile's default, the generated YAML's image and labels, the
// kustomization's tag) has drifted from the VERSION file.
func TestVersionsAgree(t *testing.T) {
	want := repoVersion(t)

	b, err := os.ReadFile(filepath.Join(render.ChartDir(), "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var meta struct {
		Version    string `json:"version"`
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(b, &meta); err != nil {
		t.Fatalf("Chart.yaml: %v", err)
	}
	if meta.Version != want || meta.AppVersion != want {
		t.Errorf("deploy/helm/poolcsi/Chart.yaml has version %q and appVersion %q; VERSION says %q: set both to it",
			meta.Version, meta.AppVersion, want)
	}

	if _, err := exec.LookPath("make"); err != nil {
		t.Fatalf("make is needed to read the Makefile's VERSION and IMAGE_TAG: %v", err)
	}
	for _, v := range []string{"VERSION", "IMAGE_TAG"} {
		cmd := exec.Command("make", "-s", "--no-print-directory", "print-"+v)
		cmd.Dir = render.RepoRoot()
		// The variables as a plain `make` sees them, not as this environment may set them.
		cmd.Env = withoutEnv(os.Environ(), "VERSION", "IMAGE_TAG", "MAKEFLAGS")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("make print-%s: %v\n%s", v, err, out)
		}
		if got := strings.TrimSpace(string(out)); got != want {
			t.Errorf("the Makefile's %s is %q; VERSION says %q: the Makefile must read the VERSION file", v, got, want)
		}
	}

	dockerfile, err := os.ReadFile(filepath.Join(render.RepoRoot(), "deploy", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	if m := regexp.MustCompile(`(?m)^ARG VERSION=(\S+)$`).FindSubmatch(dockerfile); m == nil || string(m[1]) != want {
		t.Errorf("deploy/Dockerfile's ARG VERSION is not %q: set it to VERSION", want)
	}

	rendered, err := os.ReadFile(render.RenderedFile())
	if err != nil {
		t.Fatal(err)
	}
	images := regexp.MustCompile(`(?m)^\s+image: "?([^"\s]*poolcsi/poolcsi[^"\s]*)"?$`).FindAllSubmatch(rendered, -1)
	if len(images) == 0 {
		t.Errorf("deploy/kubernetes/poolcsi.yaml runs no poolcsi image")
	}
	for _, m := range images {
		if !strings.HasSuffix(string(m[1]), ":"+want) {
			t.Errorf("deploy/kubernetes/poolcsi.yaml runs %s, not version %s: regenerate it (cd test/k8s && go run ./cmd/render)", m[1], want)
		}
	}
	if !strings.Contains(string(rendered), "helm.sh/chart: poolcsi-"+want+"\n") {
		t.Errorf("deploy/kubernetes/poolcsi.yaml was not rendered from chart version %s: regenerate it (cd test/k8s && go run ./cmd/render)", want)
	}

	var repos []string
	for _, m := range images {
		repos = append(repos, strings.SplitN(string(m[1]), ":", 2)[0])
	}
	checkKustomization(t, want, repos)
}

func withoutEnv(env []string, names ...string) []string {
	var out []string
next:
	for _, e := range env {
		for _, n := range names {
			if strings.HasPrefix(e, n+"=") {
				continue next
			}
		}
		out = append(out, e)
	}
	return out
}

// checkKustomization checks deploy/kubernetes/kustomization.yaml, the one place the plain
// YAML's image is set: it must name the image poolcsi.yaml runs (else its override changes
// nothing) and give it the version's tag.
func checkKustomization(t *testing.T, want string, repos []string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(render.RepoRoot(), "deploy", "kubernetes", "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		APIVersion string   `json:"apiVersion"`
		Kind       string   `json:"kind"`
		Resources  []string `json:"resources"`
		Images     []struct {
			Name    string `json:"name"`
			NewName string `json:"newName"`
			NewTag  string `json:"newTag"`
		} `json:"images"`
	}
	if err := yaml.UnmarshalStrict(b, &k); err != nil {
		t.Fatalf("deploy/kubernetes/kustomization.yaml: %v", err)
	}
	if len(k.Resources) != 1 || k.Resources[0] != filepath.Base(render.RenderedFile()) {
		t.Errorf("deploy/kubernetes/kustomization.yaml has resources %q, want [%s]", k.Resources, filepath.Base(render.RenderedFile()))
	}
	if len(k.Images) != 1 {
		t.Fatalf("deploy/kubernetes/kustomization.yaml sets %d images, want poolcsi's alone", len(k.Images))
	}
	img := k.Images[0]
	for _, r := range repos {
		if r != img.Name {
			t.Errorf("deploy/kubernetes/kustomization.yaml overrides image %q, but poolcsi.yaml runs %q: the override would change nothing", img.Name, r)
		}
	}
	if img.NewTag != want {
		t.Errorf("deploy/kubernetes/kustomization.yaml sets the image's tag to %q; VERSION says %q", img.NewTag, want)
	}
}
