// Command release writes a release's artefacts into one folder (make release): the OCI
// image index that make image built, as an OCI archive; the packaged chart; the plain YAML
// rendered for the release's image; an SBOM of the image (its Go modules, read from each
// binary's build information as `go version -m` prints them, and its Debian packages, from
// deploy/image-packages.lock); and SHA256SUMS of them all. It reads only what make image
// wrote and the repository: no network.
package main

import (
	"archive/tar"
	"crypto/sha256"
	"debug/buildinfo"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/hack/release/debian"
)

func main() {
	root := chart.RepoRoot()
	var (
		version    = flag.String("version", "", "the release's version (the VERSION file)")
		commit     = flag.String("commit", "", "the commit released")
		repository = flag.String("repository", "ghcr.io/poolcsi/poolcsi", "where the release's image is pushed (the rendered YAML names it)")
		arches     = flag.String("arches", "amd64,arm64", "the image's architectures")
		imageDir   = flag.String("image", filepath.Join(root, "_output", "image"), "the OCI image layout make image wrote")
		binDir     = flag.String("bin-dir", filepath.Join(root, "_output", "bin"), "holds linux-<arch>/poolcsi, the binaries in the image")
		out        = flag.String("out", filepath.Join(root, "_output", "release"), "the release folder (replaced)")
	)
	flag.Parse()
	if *version == "" {
		log.Fatal("-version is needed")
	}
	if err := write(options{version: *version, commit: *commit, repository: *repository,
		arches: strings.Split(*arches, ","), imageDir: *imageDir, binDir: *binDir, out: *out, root: root}); err != nil {
		log.Fatal(err)
	}
}

type options struct {
	version, commit, repository string
	arches                      []string
	imageDir, binDir, out, root string
}

func write(o options) error {
	// The folder is replaced whole, so no artefact of an earlier release lingers; a folder
	// that is not one (a mistyped -out) is never removed.
	if entries, err := os.ReadDir(o.out); err == nil && len(entries) > 0 {
		if _, err := os.Stat(filepath.Join(o.out, "SHA256SUMS")); err != nil {
			return fmt.Errorf("%s is not empty and holds no SHA256SUMS: not replacing it", o.out)
		}
	}
	if err := os.RemoveAll(o.out); err != nil {
		return err
	}
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}

	// The image: make image's layout, as an OCI archive (skopeo's oci-archive: transport).
	idx, err := layout.ImageIndexFromPath(o.imageDir)
	if err != nil {
		return fmt.Errorf("the image make image wrote: %w", err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	if len(m.Manifests) != 1 {
		return fmt.Errorf("%s holds %d entries, want the one index make image writes", o.imageDir, len(m.Manifests))
	}
	if got := m.Manifests[0].Annotations["org.opencontainers.image.ref.name"]; got != o.version {
		return fmt.Errorf("%s's index is named %q, not the release's version %q: make image with IMAGE_TAG unset", o.imageDir, got, o.version)
	}
	digest := m.Manifests[0].Digest.String()
	archive := fmt.Sprintf("poolcsi-%s.oci.tar", o.version)
	if err := tarDir(o.imageDir, filepath.Join(o.out, archive)); err != nil {
		return err
	}

	// The chart, packaged as `helm package` does.
	ch, err := loader.Load(chart.ChartDir())
	if err != nil {
		return err
	}
	if ch.Metadata.Version != o.version || ch.Metadata.AppVersion != o.version {
		return fmt.Errorf("the chart is version %s, appVersion %s; the release is %s", ch.Metadata.Version, ch.Metadata.AppVersion, o.version)
	}
	pkg, err := chartutil.Save(ch, o.out)
	if err != nil {
		return fmt.Errorf("package the chart: %w", err)
	}

	// The plain YAML, for the release's image, pinned by its index's digest.
	docs, err := chart.Render(chart.ChartDir(), chart.RenderedValues(), map[string]any{
		"image": map[string]any{"repository": o.repository, "tag": o.version + "@" + digest}})
	if err != nil {
		return err
	}
	yamlName := fmt.Sprintf("poolcsi-%s.yaml", o.version)
	var y strings.Builder
	fmt.Fprintf(&y, "# poolcsi %s: the chart rendered with deploy/kubernetes/values.yaml (the local pool only),\n", o.version)
	fmt.Fprintf(&y, "# for the image %s:%s (%s). kubectl apply -f %s\n", o.repository, o.version, digest, yamlName)
	for _, d := range docs {
		y.WriteString("---\n# Source: poolcsi/" + d.Source + "\n" + d.YAML + "\n")
	}
	if err := os.WriteFile(filepath.Join(o.out, yamlName), []byte(y.String()), 0o644); err != nil {
		return err
	}

	// The SBOM.
	sbomName := fmt.Sprintf("poolcsi-%s.spdx.json", o.version)
	sbom, err := makeSBOM(o, digest)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(o.out, sbomName), sbom, 0o644); err != nil {
		return err
	}

	// The checksums, in sha256sum's format.
	var sums strings.Builder
	for _, name := range []string{archive, filepath.Base(pkg), yamlName, sbomName} {
		sum, err := fileSHA256(filepath.Join(o.out, name))
		if err != nil {
			return err
		}
		fmt.Fprintf(&sums, "%s  %s\n", sum, name)
	}
	if err := os.WriteFile(filepath.Join(o.out, "SHA256SUMS"), []byte(sums.String()), 0o644); err != nil {
		return err
	}
	fmt.Printf("release %s in %s: image index %s\n%s", o.version, o.out, digest, sums.String())
	return nil
}

// tarDir writes dir as a tar, in name order with fixed owners and times, so the same
// layout gives the same archive.
func tarDir(dir, file string) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	var paths []string
	if err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			paths = append(paths, p)
		}
		return nil
	}); err != nil {
		return err
	}
	sort.Strings(paths)
	for _, p := range paths {
		st, err := os.Lstat(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		h := &tar.Header{Name: filepath.ToSlash(rel), ModTime: time.Unix(0, 0), Format: tar.FormatPAX}
		switch {
		case st.IsDir():
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
		case st.Mode().IsRegular():
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, 0o644, st.Size()
		default:
			return fmt.Errorf("%s: neither a file nor a directory", p)
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if h.Typeflag == tar.TypeReg {
			src, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, src)
			src.Close()
			if err != nil {
				return err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Close()
}

func fileSHA256(file string) (string, error) {
	f, err := os.Open(file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// SPDX 2.3 JSON, the parts this SBOM uses.
type spdxDoc struct {
	SPDXVersion       string         `json:"spdxVersion"`
	DataLicense       string         `json:"dataLicense"`
	SPDXID            string         `json:"SPDXID"`
	Name              string         `json:"name"`
	DocumentNamespace string         `json:"documentNamespace"`
	CreationInfo      spdxCreation   `json:"creationInfo"`
	Packages          []spdxPackage  `json:"packages"`
	Relationships     []spdxRelation `json:"relationships"`
}

type spdxCreation struct {
	Created  string   `json:"created"`
	Creators []string `json:"creators"`
}

type spdxPackage struct {
	Name             string         `json:"name"`
	SPDXID           string         `json:"SPDXID"`
	VersionInfo      string         `json:"versionInfo,omitempty"`
	DownloadLocation string         `json:"downloadLocation"`
	FilesAnalyzed    bool           `json:"filesAnalyzed"`
	LicenseConcluded string         `json:"licenseConcluded,omitempty"`
	Checksums        []spdxChecksum `json:"checksums,omitempty"`
	ExternalRefs     []spdxRef      `json:"externalRefs,omitempty"`
	Comment          string         `json:"comment,omitempty"`
}

type spdxChecksum struct {
	Algorithm string `json:"algorithm"`
	Value     string `json:"checksumValue"`
}

type spdxRef struct {
	Category string `json:"referenceCategory"`
	Type     string `json:"referenceType"`
	Locator  string `json:"referenceLocator"`
}

type spdxRelation struct {
	Element string `json:"spdxElementId"`
	Type    string `json:"relationshipType"`
	Related string `json:"relatedSpdxElement"`
}

// makeSBOM lists the image (by its index digest), and for each architecture its poolcsi
// binary's Go modules and the Debian packages its files come from.
func makeSBOM(o options, digest string) ([]byte, error) {
	doc := spdxDoc{
		SPDXVersion: "SPDX-2.3", DataLicense: "CC0-1.0", SPDXID: "SPDXRef-DOCUMENT",
		Name:              "poolcsi-" + o.version,
		DocumentNamespace: "https://github.com/poolcsi/poolcsi/releases/" + o.version + "/" + strings.TrimPrefix(digest, "sha256:"),
		// The commit's time would do as well; a fixed time keeps the SBOM the same on every run.
		CreationInfo: spdxCreation{Created: "1970-01-01T00:00:00Z", Creators: []string{"Tool: poolcsi make release"}},
	}
	image := spdxPackage{Name: "poolcsi", SPDXID: "SPDXRef-image", VersionInfo: o.version,
		DownloadLocation: "https://github.com/poolcsi/poolcsi", LicenseConcluded: "Apache-2.0",
		Checksums: []spdxChecksum{{"SHA256", strings.TrimPrefix(digest, "sha256:")}},
		ExternalRefs: []spdxRef{{"PACKAGE-MANAGER", "purl", "pkg:oci/poolcsi@" + strings.ReplaceAll(digest, ":", "%3A") +
			"?repository_url=" + o.repository}},
		Comment: "OCI image index; commit " + o.commit}
	doc.Packages = append(doc.Packages, image)
	doc.Relationships = append(doc.Relationships, spdxRelation{"SPDXRef-DOCUMENT", "DESCRIBES", "SPDXRef-image"})

	lock, err := debian.ReadLock(filepath.Join(o.root, "deploy", "image-packages.lock"))
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	add := func(p spdxPackage) {
		if seen[p.SPDXID] {
			return
		}
		seen[p.SPDXID] = true
		doc.Packages = append(doc.Packages, p)
		doc.Relationships = append(doc.Relationships, spdxRelation{"SPDXRef-image", "CONTAINS", p.SPDXID})
	}
	for _, arch := range o.arches {
		bin := filepath.Join(o.binDir, "linux-"+arch, "poolcsi")
		bi, err := buildinfo.ReadFile(bin)
		if err != nil {
			return nil, fmt.Errorf("the Go modules of %s: %w", bin, err)
		}
		add(spdxPackage{Name: "poolcsi-binary-linux-" + arch, SPDXID: "SPDXRef-go-main-" + arch, VersionInfo: o.version,
			DownloadLocation: "https://github.com/poolcsi/poolcsi", LicenseConcluded: "Apache-2.0",
			Comment: bi.Main.Path + ", built with " + bi.GoVersion + " for linux/" + arch + " (/usr/local/bin/poolcsi)"})
		add(spdxPackage{Name: "stdlib", SPDXID: "SPDXRef-go-stdlib-" + spdxID(bi.GoVersion), VersionInfo: bi.GoVersion,
			DownloadLocation: "https://go.dev/dl/", ExternalRefs: []spdxRef{{"PACKAGE-MANAGER", "purl", "pkg:golang/stdlib@" + bi.GoVersion}}})
		for _, d := range bi.Deps {
			dep := d
			if d.Replace != nil {
				dep = d.Replace
			}
			p := spdxPackage{Name: dep.Path, SPDXID: "SPDXRef-go-" + spdxID(dep.Path+"@"+dep.Version), VersionInfo: dep.Version,
				DownloadLocation: "https://proxy.golang.org/" + dep.Path + "/@v/" + dep.Version + ".zip",
				ExternalRefs:     []spdxRef{{"PACKAGE-MANAGER", "purl", "pkg:golang/" + dep.Path + "@" + dep.Version}}}
			if dep.Sum != "" {
				p.Comment = "go.sum " + dep.Sum
			}
			add(p)
		}
		n := 0
		for _, p := range lock {
			if p.Arch != arch {
				continue
			}
			n++
			add(spdxPackage{Name: p.Name, SPDXID: "SPDXRef-deb-" + spdxID(p.Name+"-"+p.Version+"-"+p.Arch), VersionInfo: p.Version,
				DownloadLocation: p.URL, Checksums: []spdxChecksum{{"SHA256", p.SHA256}},
				ExternalRefs: []spdxRef{{"PACKAGE-MANAGER", "purl", "pkg:deb/debian/" + p.Name + "@" + p.Version + "?arch=" + p.Arch + "&distro=debian-12"}}})
		}
		if n == 0 {
			return nil, fmt.Errorf("deploy/image-packages.lock pins no package for %s", arch)
		}
	}
	return json.MarshalIndent(doc, "", "  ")
}

// spdxID makes s fit an SPDX identifier (letters, digits, '.' and '-').
func spdxID(s string) string {
	return strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '-' {
			return r
		}
		return '-'
	}, s)
}
