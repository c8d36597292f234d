package main

import (
	"archive/tar"
	"bufio"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"

	"github.com/poolcsi/poolcsi/hack/release/chart"
)

// TestMakeRelease runs `make release` (make image, then this command) into a temporary
// folder and checks every artefact: the checksums, the image archive (one OCI index with
// both platforms), the chart package, the YAML (the release's image, pinned by the index's
// digest) and the SBOM (Go modules and Debian packages of each architecture). It builds
// poolcsi for both architectures; it reads the Debian packages from .cache/image-debs
// (make image-debs) and never downloads.
func TestMakeRelease(t *testing.T) {
	root := chart.RepoRoot()
	if entries, err := os.ReadDir(filepath.Join(root, ".cache", "image-debs")); err != nil || len(entries) == 0 {
		msg := "no Debian packages in .cache/image-debs: run make image-debs (downloads the pinned packages once)"
		if os.Getenv("CI") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	if _, err := exec.LookPath("make"); err != nil {
		t.Fatalf("make is needed: %v", err)
	}
	versionBytes, err := os.ReadFile(filepath.Join(root, "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	version := strings.TrimSpace(string(versionBytes))
	out := filepath.Join(t.TempDir(), "release")
	const repo = "registry.example.com/storage/poolcsi"
	cmd := exec.Command("make", "--no-print-directory", "release", "RELEASE_OUT="+out, "RELEASE_REPOSITORY="+repo)
	cmd.Dir = root
	cmd.Env = withoutEnv(os.Environ(), "VERSION", "IMAGE_TAG", "IMAGE_ARCHES", "MAKEFLAGS")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make release: %v\n%s", err, b)
	}

	// SHA256SUMS names every artefact, and each sum is right.
	want := []string{"poolcsi-" + version + ".oci.tar", "poolcsi-" + version + ".tgz", "poolcsi-" + version + ".yaml", "poolcsi-" + version + ".spdx.json"}
	sums, err := os.Open(filepath.Join(out, "SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	defer sums.Close()
	listed := map[string]bool{}
	sc := bufio.NewScanner(sums)
	for sc.Scan() {
		sum, name, ok := strings.Cut(sc.Text(), "  ")
		if !ok {
			t.Fatalf("SHA256SUMS: line %q is not sha256sum's format", sc.Text())
		}
		got, err := fileSHA256(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		if got != sum {
			t.Errorf("SHA256SUMS says %s for %s, the file's is %s", sum, name, got)
		}
		listed[name] = true
	}
	for _, w := range want {
		if !listed[w] {
			t.Errorf("SHA256SUMS does not list %s", w)
		}
	}

	// The image archive: an OCI layout whose one entry is an index of both platforms.
	files := tarFiles(t, filepath.Join(out, want[0]))
	if !strings.Contains(files["oci-layout"], "imageLayoutVersion") {
		t.Errorf("%s has no oci-layout file", want[0])
	}
	var layoutIndex struct {
		Manifests []struct {
			Digest      string            `json:"digest"`
			Annotations map[string]string `json:"annotations"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal([]byte(files["index.json"]), &layoutIndex); err != nil || len(layoutIndex.Manifests) != 1 {
		t.Fatalf("%s: index.json with one entry wanted (%v): %s", want[0], err, files["index.json"])
	}
	entry := layoutIndex.Manifests[0]
	if entry.Annotations["org.opencontainers.image.ref.name"] != version {
		t.Errorf("the image index is named %q, want %q", entry.Annotations["org.opencontainers.image.ref.name"], version)
	}
	var platforms struct {
		Manifests []struct {
			Platform struct{ Architecture, OS string } `json:"platform"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal([]byte(files["blobs/sha256/"+strings.TrimPrefix(entry.Digest, "sha256:")]), &platforms); err != nil {
		t.Fatalf("the image index blob: %v", err)
	}
	var archs []string
	for _, m := range platforms.Manifests {
		archs = append(archs, m.Platform.OS+"/"+m.Platform.Architecture)
	}
	if strings.Join(archs, ",") != "linux/amd64,linux/arm64" {
		t.Errorf("the image index holds %v, want linux/amd64 and linux/arm64", archs)
	}

	// The chart package.
	ch, err := loader.LoadFile(filepath.Join(out, want[1]))
	if err != nil {
		t.Fatalf("the chart package: %v", err)
	}
	dashboard := false
	for _, f := range ch.Files {
		dashboard = dashboard || f.Name == "dashboards/poolcsi.json"
	}
	if !dashboard {
		t.Errorf("the chart package lacks dashboards/poolcsi.json, which the dashboard ConfigMap reads")
	}
	if ch.Metadata.Version != version || ch.Metadata.AppVersion != version || ch.Schema == nil {
		t.Errorf("the chart package is %s %s (appVersion %s, schema %t)", ch.Name(), ch.Metadata.Version, ch.Metadata.AppVersion, ch.Schema != nil)
	}

	// The YAML runs the release's image, pinned by the index's digest.
	y, err := os.ReadFile(filepath.Join(out, want[2]))
	if err != nil {
		t.Fatal(err)
	}
	poolcsiImages := 0
	for _, m := range regexp.MustCompile(`(?m)^\s+image: "?([^"\s]+)"?$`).FindAllStringSubmatch(string(y), -1) {
		if strings.HasPrefix(m[1], "registry.k8s.io/sig-storage/") {
			continue // the CSI sidecars
		}
		poolcsiImages++
		if m[1] != repo+":"+version+"@"+entry.Digest {
			t.Errorf("%s runs %s, want %s:%s@%s", want[2], m[1], repo, version, entry.Digest)
		}
	}
	if poolcsiImages == 0 {
		t.Errorf("%s runs no poolcsi image", want[2])
	}

	// The SBOM: the image, Go modules and Debian packages of both architectures.
	b, err := os.ReadFile(filepath.Join(out, want[3]))
	if err != nil {
		t.Fatal(err)
	}
	var sbom spdxDoc
	if err := json.Unmarshal(b, &sbom); err != nil {
		t.Fatalf("the SBOM: %v", err)
	}
	purls := map[string]bool{}
	for _, p := range sbom.Packages {
		for _, r := range p.ExternalRefs {
			purls[r.Locator] = true
		}
	}
	if sbom.SPDXVersion != "SPDX-2.3" || len(sbom.Packages) < 40 {
		t.Errorf("the SBOM is %s with %d packages", sbom.SPDXVersion, len(sbom.Packages))
	}
	for _, prefix := range []string{"pkg:golang/google.golang.org/grpc@", "pkg:golang/github.com/container-storage-interface/spec@",
		"pkg:golang/stdlib@", "pkg:deb/debian/e2fsprogs@", "pkg:oci/poolcsi@"} {
		found := false
		for p := range purls {
			found = found || strings.HasPrefix(p, prefix)
		}
		if !found {
			t.Errorf("the SBOM lists no %s…", prefix)
		}
	}
	for _, arch := range []string{"amd64", "arm64"} {
		found := false
		for p := range purls {
			found = found || strings.HasPrefix(p, "pkg:deb/debian/libc6@") && strings.Contains(p, "arch="+arch)
		}
		if !found {
			t.Errorf("the SBOM lists no Debian package of %s", arch)
		}
	}
}

// tarFiles is a tar's regular files by name.
func tarFiles(t *testing.T, file string) map[string]string {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]string{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if h.Typeflag == tar.TypeReg && h.Size < 1<<20 {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			out[h.Name] = string(b)
		}
	}
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
