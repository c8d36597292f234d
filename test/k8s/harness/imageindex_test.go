package harness

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/hack/release/debian"
	"github.com/poolcsi/poolcsi/hack/release/imagebuild"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// The tests of make image's index build it as make image does, from the pinned packages
// of deploy/image-packages.lock, but never download: they read .cache/image-debs, which
// make image, make image-debs and .ci/run fill (from deb.debian.org, once). A static
// program of each architecture (cmd/pause) stands in for poolcsi, so no test
// cross-compiles the driver.
var pinned struct {
	once      sync.Once
	platforms []imagebuild.Platform
	err       error
}

func pinnedPlatforms(t *testing.T) []imagebuild.Platform {
	t.Helper()
	pinned.once.Do(func() { pinned.platforms, pinned.err = buildPinned() })
	if errors.Is(pinned.err, debian.ErrNotCached) {
		cluster.Missing(t, "needs the pinned Debian packages once, from the network: "+pinned.err.Error())
	}
	if pinned.err != nil {
		t.Fatal(pinned.err)
	}
	return pinned.platforms
}

func buildPinned() ([]imagebuild.Platform, error) {
	root := chart.RepoRoot()
	tools, err := debian.ReadTools(filepath.Join(root, "deploy", "image-tools.txt"))
	if err != nil {
		return nil, err
	}
	lock, err := debian.ReadLock(filepath.Join(root, "deploy", "image-packages.lock"))
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "poolcsi-image-test")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	arches := []string{"amd64", "arm64"}
	for _, a := range arches {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, a), "./cmd/pause")
		cmd.Dir = filepath.Join(root, "test", "k8s")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+a)
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, errors.New("go build ./cmd/pause for " + a + ": " + err.Error() + "\n" + string(out))
		}
	}
	cache := debian.Cache{Dir: filepath.Join(root, ".cache", "image-debs"), Offline: true}
	platforms, err := imagebuild.Build(imagebuild.Options{
		Tools: tools, Arches: arches,
		Binary: func(a string) string { return filepath.Join(dir, a) },
		Source: func(a debian.Arch) (debian.Source, error) {
			return debian.NewLockSource(context.Background(), lock, a.Name, cache), nil
		},
	})
	if err != nil {
		return nil, err
	}
	// The binaries are read when the layer is made: make it before they are removed.
	for _, p := range platforms {
		if _, err := p.Image.Digest(); err != nil {
			return nil, err
		}
	}
	return platforms, nil
}

// layerFiles is each entry of an image's layer by path: regular files' content, links'
// targets as "-> target".
func layerFiles(t *testing.T, img v1.Image) map[string][]byte {
	t.Helper()
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers: %v (%d)", err, len(layers))
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	out := map[string][]byte{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		switch h.Typeflag {
		case tar.TypeReg:
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			out["/"+h.Name] = b
		case tar.TypeSymlink:
			out["/"+h.Name] = []byte("-> " + h.Linkname)
		}
	}
}

// Each platform's image holds ELF files of that architecture only: the stand-in binary,
// every tool, library and the loader.
func TestImagePlatformArchitectures(t *testing.T) {
	for _, p := range pinnedPlatforms(t) {
		t.Run(p.Arch, func(t *testing.T) {
			cfg, err := p.Image.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			if cfg.OS != "linux" || cfg.Architecture != p.Arch {
				t.Errorf("config says %s/%s", cfg.OS, cfg.Architecture)
			}
			want := debian.Arches[p.Arch].Machine
			elves := 0
			for path, data := range layerFiles(t, p.Image) {
				f, err := elf.NewFile(bytes.NewReader(data))
				if err != nil {
					continue // a link, a script, a configuration or copyright file
				}
				elves++
				if f.Machine != want {
					t.Errorf("%s is %s, want %s", path, f.Machine, want)
				}
				f.Close()
			}
			// poolcsi, 20 tools, the loader and 20-odd libraries.
			if elves < 40 {
				t.Errorf("only %d ELF files in the %s image", elves, p.Arch)
			}
		})
	}
}

// The index has the files deploy/Dockerfile's image has at the paths deploy/image-tools.txt
// names: the same list as the harness's image of this machine's Debian packages (which
// TestImageToolsMatchDockerfile ties to the Dockerfile's apt-get install, and whose
// libraries ldd names, as the loader of the Dockerfile's image would find them), for this
// machine's architecture, and the same list under the other architecture's names for
// the other. The index adds each package's copyright file, which the Dockerfile's image
// has too.
func TestImageFilesMatchDockerfileRoute(t *testing.T) {
	platforms := pinnedPlatforms(t)
	host := cluster.PoolcsiImage(t, "x", "/bin/true")
	var want []string
	for _, f := range host.Files {
		want = append(want, f.Path)
	}
	sort.Strings(want)
	lists := map[string][]string{}
	for _, p := range platforms {
		var got []string
		docs := map[string]bool{}
		for _, f := range p.Files {
			if pkg, ok := strings.CutPrefix(f.Path, "/usr/share/doc/"); ok && strings.HasSuffix(pkg, "/copyright") {
				docs[strings.TrimSuffix(pkg, "/copyright")] = true
				continue
			}
			got = append(got, f.Path)
		}
		sort.Strings(got)
		lists[p.Arch] = got
		for _, pkg := range p.Packages {
			if !docs[pkg.Name] {
				t.Errorf("%s: no copyright file of %s", p.Arch, pkg.Name)
			}
		}
	}
	if got := lists[runtime.GOARCH]; !slices.Equal(got, want) {
		t.Errorf("linux/%s files differ from the image of this machine's packages:\n%s", runtime.GOARCH, listDiff(got, want))
	}
	// amd64 and arm64 differ only in the multiarch directory and the loader's name.
	toArm := strings.NewReplacer("/usr/lib/x86_64-linux-gnu/", "/usr/lib/aarch64-linux-gnu/",
		"/usr/lib64/ld-linux-x86-64.so.2", "/usr/lib/ld-linux-aarch64.so.1")
	var mapped []string
	for _, p := range lists["amd64"] {
		mapped = append(mapped, toArm.Replace(p))
	}
	sort.Strings(mapped)
	if !slices.Equal(lists["arm64"], mapped) {
		t.Errorf("linux/arm64 files differ from linux/amd64's:\n%s", listDiff(lists["arm64"], mapped))
	}
}

// listDiff names what only got and only want have.
func listDiff(got, want []string) string {
	var b strings.Builder
	for _, p := range got {
		if !slices.Contains(want, p) {
			b.WriteString("  only in the index: " + p + "\n")
		}
	}
	for _, p := range want {
		if !slices.Contains(got, p) {
			b.WriteString("  missing from the index: " + p + "\n")
		}
	}
	return b.String()
}

// The route docs/install.md gives, to a registry: the OCI layout make image writes is pushed
// with skopeo copy --all (with go-containerregistry's remote.WriteIndex where skopeo is not
// installed; CI installs it) to a registry on localhost, and pulled back: one index, both
// platforms, the same image digests.
func TestImagePushPull(t *testing.T) {
	platforms := pinnedPlatforms(t)
	idx := imagebuild.Index(platforms, map[string]string{"org.opencontainers.image.version": "test"})
	dir := filepath.Join(t.TempDir(), "image")
	if err := imagebuild.WriteLayout(dir, idx, "test"); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	ref, err := name.ParseReference(strings.TrimPrefix(srv.URL, "http://")+"/poolcsi:test", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if skopeo, err := exec.LookPath("skopeo"); err == nil {
		out, err := exec.Command(skopeo, "copy", "--all", "--dest-tls-verify=false", "oci:"+dir, "docker://"+ref.String()).CombinedOutput()
		if err != nil {
			t.Fatalf("skopeo copy: %v\n%s", err, out)
		}
	} else {
		if cluster.InCI() {
			t.Fatal("CI: skopeo, the push route docs/install.md documents, is not installed (hack/install-deps.sh installs it)")
		}
		t.Log("skopeo not installed: pushing with go-containerregistry instead")
		if err := remote.WriteIndex(ref, idx); err != nil {
			t.Fatal(err)
		}
	}
	pulled, err := remote.Index(ref)
	if err != nil {
		t.Fatalf("pull %s: %v", ref, err)
	}
	m, err := pulled.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]v1.Hash{}
	for _, d := range m.Manifests {
		if d.Platform != nil {
			got[d.Platform.OS+"/"+d.Platform.Architecture] = d.Digest
		}
	}
	for _, p := range platforms {
		want, err := p.Image.Digest()
		if err != nil {
			t.Fatal(err)
		}
		if got["linux/"+p.Arch] != want {
			t.Errorf("pulled index: linux/%s is %v, pushed %v", p.Arch, got["linux/"+p.Arch], want)
		}
		img, err := pulled.Image(want)
		if err != nil {
			t.Fatalf("pull linux/%s: %v", p.Arch, err)
		}
		if cfg, err := img.ConfigFile(); err != nil || cfg.Architecture != p.Arch {
			t.Errorf("pulled linux/%s config: %v, %+v", p.Arch, err, cfg)
		}
	}
	if len(got) != len(platforms) {
		t.Errorf("pulled index has platforms %v, want %d", got, len(platforms))
	}
}

// The tools of this machine's architecture run in the image, each loading its libraries
// from the image alone (chroot into the unpacked layer): a library the resolver missed
// fails here rather than in a pod.
func TestImageToolsRunInImage(t *testing.T) {
	if os.Geteuid() != 0 {
		cluster.Missing(t, "needs root (chroot)")
	}
	var img v1.Image
	for _, p := range pinnedPlatforms(t) {
		if p.Arch == runtime.GOARCH {
			img = p.Image
		}
	}
	if img == nil {
		t.Skipf("no image for this machine's architecture (%s)", runtime.GOARCH)
	}
	root := t.TempDir()
	for p, data := range layerFiles(t, img) {
		dst := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if target, ok := bytes.CutPrefix(data, []byte("-> ")); ok {
			if err := os.Symlink(string(target), dst); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.WriteFile(dst, data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// How to run each command of deploy/image-tools.txt so that it only says its version.
	versionArg := map[string]string{
		"mount": "--version", "umount": "--version", "blkid": "-V", "blockdev": "--version", "fsck": "--version",
		"mkfs.ext4": "-V", "mke2fs": "-V", "e2fsck": "-V", "fsck.ext4": "-V", "resize2fs": "-h", "dumpe2fs": "-V",
		"mkfs.xfs": "-V", "xfs_growfs": "-V", "xfs_io": "-V", "xfs_repair": "-V",
		"mkfs.btrfs": "--version", "btrfs": "--version", "cp": "--version",
		"mount.nfs": "-V", "mount.nfs4": "-V",
	}
	tools, err := cluster.ImageTools()
	if err != nil {
		t.Fatal(err)
	}
	var cmds [][]string
	for _, tl := range tools {
		if strings.HasPrefix(tl.Path, "/etc/") {
			continue
		}
		name := filepath.Base(tl.Path)
		arg, ok := versionArg[name]
		if !ok {
			t.Errorf("deploy/image-tools.txt lists %s, which this test does not know how to run: add it to versionArg", tl.Path)
			continue
		}
		cmds = append(cmds, []string{name, arg})
	}
	for _, c := range cmds {
		out, err := exec.Command("chroot", append([]string{root}, c...)...).CombinedOutput()
		// resize2fs -h prints its usage and exits 1; what matters is that it ran.
		usage := c[0] == "resize2fs" && strings.Contains(string(out), "Usage:")
		if err != nil && !usage {
			t.Errorf("%s in the image: %v\n%s", strings.Join(c, " "), err, out)
		}
	}
}
