// Package tools builds the real Kubernetes components the harness runs (kube-apiserver,
// kubelet, the CSI sidecars, the e2e suite) from the Go module proxy, once per version,
// into a cache shared by the tests and by cmd/prebuild.
package tools

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/sys/unix"
)

// Versions of the real components the harness runs. Changing one rebuilds only that tool:
// binaries are cached under CacheDir()/<tool>-<version>-<go version>/.
const (
	KubeVersion        = "v1.36.3" // k8s.io/kubernetes; staging modules at v0.36.3
	EtcdVersion        = "v3.6.16" // go.etcd.io/etcd/server/v3
	ProvisionerVersion = "v6.3.0"  // github.com/kubernetes-csi/external-provisioner/v6
	AttacherVersion    = "v4.13.0" // github.com/kubernetes-csi/external-attacher/v4
	ResizerVersion     = "v2.3.0"  // github.com/kubernetes-csi/external-resizer/v2
	SnapshotterVersion = "v8.7.0"  // github.com/kubernetes-csi/external-snapshotter/v8 (and its client/v8)
)

// Tool is one binary the harness builds from the Go module proxy.
type Tool struct {
	Name    string // binary name
	Module  string // module to require
	Version string
	Package string // package to build
	Main    string // if set, the wrapper module's own main.go (Package is then ".")
	// ReplaceFrom builds the wrapper's replace lines from the required module's go.mod.
	ReplaceFrom func(f *modfile.File) [][2]string
	LDFlags     string
	// TestBinary builds the package's tests (go test -c), as e2e.test is.
	TestBinary bool
}

func kubeLDFlags() string {
	v := strings.TrimPrefix(KubeVersion, "v")
	parts := strings.SplitN(v, ".", 3)
	var b strings.Builder
	b.WriteString("-s -w")
	for _, pkg := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		fmt.Fprintf(&b, " -X %s.gitVersion=%s -X %s.gitMajor=%s -X %s.gitMinor=%s", pkg, KubeVersion, pkg, parts[0], pkg, parts[1])
		fmt.Fprintf(&b, " -X %s.gitTreeState=clean -X %s.gitCommit=0000000000000000000000000000000000000000 -X %s.buildDate=2026-01-01T00:00:00Z", pkg, pkg, pkg)
	}
	return b.String()
}

// stagingReplaces pins every k8s.io staging module that k8s.io/kubernetes replaces with a
// ./staging path to the published v0.x version of the same release.
func stagingReplaces(f *modfile.File) [][2]string {
	staging := "v0." + strings.SplitN(strings.TrimPrefix(KubeVersion, "v1."), ".", 2)[0] + "." + strings.SplitN(KubeVersion, ".", 3)[2]
	var out [][2]string
	for _, r := range f.Replace {
		if strings.HasPrefix(r.New.Path, "./staging/") {
			out = append(out, [2]string{r.Old.Path, staging})
		}
	}
	return out
}

// snapshotterReplaces is ownReplaces plus the snapshot client module, which the
// external-snapshotter builds from its own ./client directory (a path replace, dropped in a
// dependency): the published client/v8 of the same tag stands in for it.
func snapshotterReplaces(f *modfile.File) [][2]string {
	return append(ownReplaces(f), [2]string{SnapshotClientModule, SnapshotterVersion})
}

const SnapshotClientModule = "github.com/kubernetes-csi/external-snapshotter/client/v8"

// ownReplaces copies a module's own replace lines (ignored when it is a dependency).
func ownReplaces(f *modfile.File) [][2]string {
	var out [][2]string
	for _, r := range f.Replace {
		if r.New.Version != "" && r.New.Path == r.Old.Path && r.Old.Version == "" {
			out = append(out, [2]string{r.Old.Path, r.New.Version})
		}
	}
	return out
}

var (
	Etcd = Tool{Name: "etcd", Module: "go.etcd.io/etcd/server/v3", Version: EtcdVersion, Package: ".",
		Main:    "package main\n\nimport (\n\t\"os\"\n\n\t\"go.etcd.io/etcd/server/v3/etcdmain\"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n",
		LDFlags: "-s -w"}
	APIServer = Tool{Name: "kube-apiserver", Module: "k8s.io/kubernetes", Version: KubeVersion,
		Package: "k8s.io/kubernetes/cmd/kube-apiserver", ReplaceFrom: stagingReplaces, LDFlags: kubeLDFlags()}
	ControllerManager = Tool{Name: "kube-controller-manager", Module: "k8s.io/kubernetes", Version: KubeVersion,
		Package: "k8s.io/kubernetes/cmd/kube-controller-manager", ReplaceFrom: stagingReplaces, LDFlags: kubeLDFlags()}
	Scheduler = Tool{Name: "kube-scheduler", Module: "k8s.io/kubernetes", Version: KubeVersion,
		Package: "k8s.io/kubernetes/cmd/kube-scheduler", ReplaceFrom: stagingReplaces, LDFlags: kubeLDFlags()}
	Kubelet = Tool{Name: "kubelet", Module: "k8s.io/kubernetes", Version: KubeVersion,
		Package: "k8s.io/kubernetes/cmd/kubelet", ReplaceFrom: stagingReplaces, LDFlags: kubeLDFlags()}
	Proxy = Tool{Name: "kube-proxy", Module: "k8s.io/kubernetes", Version: KubeVersion,
		Package: "k8s.io/kubernetes/cmd/kube-proxy", ReplaceFrom: stagingReplaces, LDFlags: kubeLDFlags()}
	// The Kubernetes e2e suite and its all-purpose test image, for the storage specs of
	// external drivers (test/k8s/e2e).
	E2E = Tool{Name: "e2e.test", Module: "k8s.io/kubernetes", Version: KubeVersion,
		Package: "k8s.io/kubernetes/test/e2e", ReplaceFrom: stagingReplaces, LDFlags: kubeLDFlags(), TestBinary: true}
	Agnhost = Tool{Name: "agnhost", Module: "k8s.io/kubernetes", Version: KubeVersion,
		Package: "k8s.io/kubernetes/test/images/agnhost", ReplaceFrom: stagingReplaces, LDFlags: "-s -w"}
	// The ginkgo CLI, which runs e2e.test's specs on several processes (make conformance);
	// the version k8s.io/kubernetes v1.36.3 builds e2e.test with, as the CLI requires.
	Ginkgo = Tool{Name: "ginkgo", Module: "github.com/onsi/ginkgo/v2", Version: "v2.28.1",
		Package: "github.com/onsi/ginkgo/v2/ginkgo", LDFlags: "-s -w"}
	Provisioner = Tool{Name: "csi-provisioner", Module: "github.com/kubernetes-csi/external-provisioner/v6", Version: ProvisionerVersion,
		Package: "github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner", ReplaceFrom: ownReplaces,
		LDFlags: "-s -w -X main.version=" + ProvisionerVersion}
	Attacher = Tool{Name: "csi-attacher", Module: "github.com/kubernetes-csi/external-attacher/v4", Version: AttacherVersion,
		Package: "github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher", ReplaceFrom: ownReplaces,
		LDFlags: "-s -w -X main.version=" + AttacherVersion}
	Resizer = Tool{Name: "csi-resizer", Module: "github.com/kubernetes-csi/external-resizer/v2", Version: ResizerVersion,
		Package: "github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer", ReplaceFrom: ownReplaces,
		LDFlags: "-s -w -X main.version=" + ResizerVersion}
	Snapshotter = Tool{Name: "csi-snapshotter", Module: "github.com/kubernetes-csi/external-snapshotter/v8", Version: SnapshotterVersion,
		Package: "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter", ReplaceFrom: snapshotterReplaces,
		LDFlags: "-s -w -X main.version=" + SnapshotterVersion}
	SnapshotController = Tool{Name: "snapshot-controller", Module: "github.com/kubernetes-csi/external-snapshotter/v8", Version: SnapshotterVersion,
		Package: "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller", ReplaceFrom: snapshotterReplaces,
		LDFlags: "-s -w -X main.version=" + SnapshotterVersion}
	// All in build order.
	All = []Tool{Etcd, APIServer, ControllerManager, Scheduler, Kubelet, Proxy, Provisioner, Attacher, Resizer, Snapshotter, SnapshotController}
)

// CacheDir is $POOLCSI_K8S_CACHE, or $HOME/.cache/poolcsi-k8s.
func CacheDir() string {
	if d := os.Getenv("POOLCSI_K8S_CACHE"); d != "" {
		return d
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "poolcsi-k8s")
	}
	return filepath.Join(os.TempDir(), "poolcsi-k8s")
}

// goBin is the go command of the toolchain running the tests: go test puts its
// GOROOT/bin first on the PATH of the test process.
func goBin() string { return "go" }

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// goEnv is the environment for building the tools: module mode, no workspace, no toolchain
// downloads, static binaries.
func goEnv() []string {
	return append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off", "GOTOOLCHAIN=local", "CGO_ENABLED=0")
}

// Nice runs a build below the tests' priority, so that a build beside a running test (the
// prebuild of hack/test.sh) slows the test as little as it can.
func Nice(ctx context.Context, name string, args ...string) *exec.Cmd {
	if p, err := exec.LookPath("nice"); err == nil {
		return exec.CommandContext(ctx, p, append([]string{"-n", "10", name}, args...)...)
	}
	return exec.CommandContext(ctx, name, args...)
}

// Path returns the cached binary, building it first if needed (see Build).
func (tl Tool) Path(t testing.TB) string {
	t.Helper()
	bin, took, err := tl.Build(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if took > 0 {
		t.Logf("built %s %s in %s (cached in %s)", tl.Name, tl.Version, took.Round(time.Second), filepath.Dir(bin))
	}
	return bin
}

// Build returns the cached binary, building it first if needed, and how long a build took
// (zero when the binary was cached). A build holds an flock on the cache entry, so that the
// tests, cmd/prebuild and a second test run never build the same tool at once: the second
// waits and finds the first one's binary.
func (tl Tool) Build(ctx context.Context) (string, time.Duration, error) {
	buildMu.Lock()
	defer buildMu.Unlock()
	dir := tl.cacheEntry()
	bin := filepath.Join(dir, tl.Name)
	if fileExists(bin) {
		return bin, 0, nil
	}
	if err := os.MkdirAll(CacheDir(), 0o755); err != nil {
		return "", 0, err
	}
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", 0, err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", 0, fmt.Errorf("locking %s: %w", lock.Name(), err)
	}
	// Released by Close.
	if fileExists(bin) {
		return bin, 0, nil
	}
	start := time.Now()
	if err := tl.build(ctx, dir, bin); err != nil {
		return "", 0, fmt.Errorf("building %s %s %s from the Go module proxy: %w", tl.Name, tl.Module, tl.Version, err)
	}
	return bin, time.Since(start), nil
}

// cacheEntry is the tool's directory in the cache: a new version or Go release is a new entry.
func (tl Tool) cacheEntry() string {
	return filepath.Join(CacheDir(), fmt.Sprintf("%s-%s-%s", tl.Name, tl.Version, runtime.Version()))
}

// buildMu serializes one process's builds: two at once on two cores only slow each other.
var buildMu sync.Mutex

func (tl Tool) build(ctx context.Context, dir, bin string) error {
	work, err := os.MkdirTemp("", "poolcsi-k8s-wrap-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	gomod := &modfile.File{}
	if err := gomod.AddModuleStmt("poolcsi.test/wrap/" + tl.Name); err != nil {
		return err
	}
	if err := gomod.AddGoStmt("1.26.0"); err != nil {
		return err
	}
	if err := gomod.AddRequire(tl.Module, tl.Version); err != nil {
		return err
	}
	if tl.ReplaceFrom != nil {
		modPath, sumPath, err := download(tl.Module, tl.Version)
		if err != nil {
			return err
		}
		data, err := os.ReadFile(modPath)
		if err != nil {
			return err
		}
		f, err := modfile.Parse(modPath, data, nil)
		if err != nil {
			return err
		}
		for _, r := range tl.ReplaceFrom(f) {
			if err := gomod.AddReplace(r[0], "", r[0], r[1]); err != nil {
				return err
			}
		}
		if sumPath != "" {
			if sum, err := os.ReadFile(sumPath); err == nil {
				_ = os.WriteFile(filepath.Join(work, "go.sum"), sum, 0o644)
			}
		}
	}
	out, err := gomod.Format()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(work, "go.mod"), out, 0o644); err != nil {
		return err
	}
	if tl.Main != "" {
		if err := os.WriteFile(filepath.Join(work, "main.go"), []byte(tl.Main), 0o644); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp := bin + ".tmp"
	args := []string{"build", "-ldflags", tl.LDFlags, "-o", tmp, tl.Package}
	if tl.TestBinary {
		args = []string{"test", "-c", "-ldflags", tl.LDFlags, "-o", tmp, tl.Package}
	}
	cmd := Nice(ctx, goBin(), args...)
	cmd.Dir = work
	cmd.Env = goEnv()
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%w\n%s", err, LastLines(string(b), 40))
	}
	return os.Rename(tmp, bin)
}

// download fetches a module into the module cache and returns its go.mod and, when the
// module's source has one, its go.sum.
func download(mod, ver string) (string, string, error) {
	info, err := ModDownload(mod, ver)
	if err != nil {
		return "", "", err
	}
	sum := filepath.Join(info.Dir, "go.sum")
	if !fileExists(sum) {
		sum = ""
	}
	return info.GoMod, sum, nil
}

type modInfo struct{ GoMod, Dir, Error string }

// ModDownload runs `go mod download -json` for one module version.
func ModDownload(mod, ver string) (modInfo, error) {
	var info modInfo
	cmd := exec.Command(goBin(), "mod", "download", "-json", mod+"@"+ver)
	cmd.Env = goEnv()
	cmd.Dir = os.TempDir()
	b, err := cmd.Output()
	if err != nil {
		return info, fmt.Errorf("go mod download %s@%s: %w %s", mod, ver, err, b)
	}
	if err := json.Unmarshal(b, &info); err != nil {
		return info, err
	}
	if info.Error != "" {
		return info, fmt.Errorf("go mod download %s@%s: %s", mod, ver, info.Error)
	}
	return info, nil
}

func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// ForE2E are built only for the e2e storage suite (make e2e), not by TestTools.
var ForE2E = []Tool{E2E, Agnhost, Ginkgo}
