package cluster

import (
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/hack/release/debian"
	"github.com/poolcsi/poolcsi/hack/release/ociimage"
)

// Image is a single-layer image built here from files of this machine: no registry is
// reachable and no Docker engine runs, so every image a test runs is built by the test
// (package ociimage, which `make image` packs the published images with too).
type Image = ociimage.Image

// ImageFile is one entry of an image's layer: a copy of Src, a symlink to Link, or a
// directory.
type ImageFile = ociimage.File

// mergedUsr are the links of Debian's merged /usr, so that library paths ldd prints
// (/lib/x86_64-linux-gnu/...) resolve inside the image as on the host.
var mergedUsr = ociimage.MergedUsr

// BinaryImage is one static binary at /<base> and nothing else.
func BinaryImage(ref, bin string, args ...string) Image {
	p := "/" + filepath.Base(bin)
	return Image{Ref: ref, Files: []ImageFile{{Path: p, Src: bin}, {Path: "/tmp", Dir: true, Mode: 0o1777}},
		Entrypoint: append([]string{p}, args...)}
}

// BusyboxImage is Debian's busybox-static with a link for each applet: the shell, dd,
// df, stat... the test pods run.
func BusyboxImage(t testing.TB, ref string) Image {
	t.Helper()
	const bb = "/bin/busybox"
	if !FileExists(bb) {
		Missing(t, "needs /bin/busybox (Debian package busybox-static; hack/install-deps.sh installs it)")
	}
	if f, err := elf.Open(bb); err == nil {
		dynamic := f.Section(".interp") != nil
		f.Close()
		if dynamic {
			t.Fatalf("%s is dynamically linked: install busybox-static, not busybox", bb)
		}
	}
	out, err := exec.Command(bb, "--list-full").Output()
	if err != nil {
		t.Fatalf("busybox --list-full: %v", err)
	}
	img := Image{Ref: ref, Files: append([]ImageFile{{Path: "/usr/bin/busybox", Src: bb}}, mergedUsr...), Cmd: []string{"sh"}}
	for _, applet := range strings.Fields(string(out)) {
		p := "/" + strings.TrimPrefix(applet, "/")
		// Under merged /usr every applet lives in /usr/bin or /usr/sbin.
		p = strings.Replace(strings.Replace(p, "/sbin/", "/usr/sbin/", 1), "/bin/", "/usr/bin/", 1)
		p = strings.Replace(p, "/usr/usr/", "/usr/", 1)
		if p == "/usr/bin/busybox" {
			continue
		}
		img.Files = append(img.Files, ImageFile{Path: p, Link: "/usr/bin/busybox"})
	}
	return img
}

// WithHostBinaries is img with the files at paths replaced by (or added as) this machine's
// binaries, each with the shared libraries it loads: the poolcsi image's tools, and the
// busybox applets that lack what a test image has (GNU dd's oflag=nocache).
func WithHostBinaries(t testing.TB, img Image, paths ...string) Image {
	t.Helper()
	out := img
	out.Files = nil
	replace := map[string]bool{}
	for _, p := range paths {
		replace[usrPath(p)] = true
	}
	for _, f := range img.Files {
		if !replace[f.Path] {
			out.Files = append(out.Files, f)
		}
	}
	seen := map[string]bool{}
	for _, f := range out.Files {
		seen[f.Path] = true
	}
	for _, p := range paths {
		if !FileExists(p) {
			Missing(t, "needs "+p+" for a test image")
		}
		libs, err := sharedLibraries(p)
		if err != nil {
			t.Fatalf("libraries of %s: %v", p, err)
		}
		for _, src := range append([]string{p}, libs...) {
			if dst := usrPath(src); !seen[dst] {
				seen[dst] = true
				out.Files = append(out.Files, ImageFile{Path: dst, Src: src})
			}
		}
	}
	return out
}

// ImageTool is one line of deploy/image-tools.txt: a command poolcsi runs in its container
// and the Debian package it comes from.
type ImageTool = debian.Tool

// ImageTools reads deploy/image-tools.txt, the list deploy/Dockerfile, make image and the
// test image builder follow.
func ImageTools() ([]ImageTool, error) {
	return debian.ReadTools(filepath.Join(chart.RepoRoot(), "deploy", "image-tools.txt"))
}

// PoolcsiImage is the poolcsi binary plus every tool of deploy/image-tools.txt with the
// shared libraries it loads, copied from this machine's Debian packages.
func PoolcsiImage(t testing.TB, ref, bin string) Image {
	t.Helper()
	tools, err := ImageTools()
	if err != nil {
		t.Fatal(err)
	}
	img := Image{Ref: ref, Entrypoint: []string{"/usr/local/bin/poolcsi"}, Cmd: []string{"serve", "--help"},
		Files: append([]ImageFile{{Path: "/usr/local/bin/poolcsi", Src: bin}}, mergedUsr...)}
	var paths []string
	for _, tl := range tools {
		if !FileExists(tl.Path) {
			Missing(t, fmt.Sprintf("needs %s (Debian package %s) for the poolcsi image", tl.Path, tl.Package))
		}
		paths = append(paths, tl.Path)
	}
	return WithHostBinaries(t, img, paths...)
}

// usrPath maps /lib/x/y to /usr/lib/x/y: in the image /lib is a link, as on the host.
func usrPath(p string) string { return ociimage.UsrPath(p) }

var lddPath = regexp.MustCompile(`(/[^ \t]+) \(0x`)

// sharedLibraries lists what ldd says p loads, the dynamic loader included; nothing for a
// static binary or a script.
func sharedLibraries(p string) ([]string, error) {
	f, err := elf.Open(p)
	if err != nil {
		return nil, nil // a script: the tool list names its interpreter separately
	}
	dynamic := f.Section(".interp") != nil
	f.Close()
	if !dynamic {
		return nil, nil
	}
	out, err := exec.Command("ldd", p).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", p, err)
	}
	var libs []string
	for _, m := range lddPath.FindAllStringSubmatch(string(out), -1) {
		libs = append(libs, m[1])
	}
	return libs, nil
}

// Import builds images into one docker archive and imports it into the node's containerd
// (namespace k8s.io, where kubelet looks).
func (n *Node) Import(t testing.TB, images []Image) {
	t.Helper()
	if len(images) == 0 {
		return
	}
	start := time.Now()
	refs := map[name.Reference]v1.Image{}
	for _, img := range images {
		ref, err := name.NewTag(img.Ref)
		if err != nil {
			t.Fatal(err)
		}
		v, err := img.Build(runtime.GOARCH)
		if err != nil {
			t.Fatalf("image %s: %v", img.Ref, err)
		}
		refs[ref] = v
	}
	archive := filepath.Join(n.Dir, "images.tar")
	if err := tarball.MultiRefWriteToFile(archive, refs); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(archive)
	if out, err := n.ctr("images", "import", archive); err != nil {
		t.Fatalf("ctr images import: %v\n%s", err, out)
	}
	t.Logf("built and imported %d images in %s", len(images), time.Since(start).Round(time.Millisecond))
}
