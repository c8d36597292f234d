// Package tools builds the real Kubernetes components the harness runs (kube-apiserver,
// kubelet, the CSI sidecars, the e2e suite) from the Go module proxy, once per version,
// into a cache shared by the tests and by cmd/prebuild.
package tools

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/semver"
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
	LocalPathVersion   = "v0.0.30" // github.com/rancher/local-path-provisioner
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
	// Group, if set, names the tools that are built together from one wrapper module
	// (see Sidecars): each member's dependencies are then the highest that any member
	// asks for, so the packages they share compile once.
	Group string
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

// SidecarGroup builds the released CSI sidecars of client-go v0.37 (attacher, resizer,
// snapshotter and snapshot-controller), each from its tagged and unmodified source, from one
// wrapper module: built apart, each with the dependency versions its release pins, they
// shared almost no compiled package (client-go v0.37.0 and v0.37.1, grpc v1.83.2 and
// v1.84.0, three otelgrpc versions). Built together, each dependency is at the highest
// version any of them pins or requires (patch-level steps), so a sidecar may run with a
// newer dependency than its release did; docs/testing.md lists what resolves.
// csi-provisioner v6.3.0 stays apart: it is built on client-go v0.36.1 and k8s.io/kubernetes
// v1.36.1, and does not compile against client-go v0.37 (CSIStorageCapacityInformer).
const SidecarGroup = "csi-sidecars"

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
		LDFlags: "-s -w -X main.version=" + AttacherVersion, Group: SidecarGroup}
	Resizer = Tool{Name: "csi-resizer", Module: "github.com/kubernetes-csi/external-resizer/v2", Version: ResizerVersion,
		Package: "github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer", ReplaceFrom: ownReplaces,
		LDFlags: "-s -w -X main.version=" + ResizerVersion, Group: SidecarGroup}
	Snapshotter = Tool{Name: "csi-snapshotter", Module: "github.com/kubernetes-csi/external-snapshotter/v8", Version: SnapshotterVersion,
		Package: "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter", ReplaceFrom: snapshotterReplaces,
		LDFlags: "-s -w -X main.version=" + SnapshotterVersion, Group: SidecarGroup}
	SnapshotController = Tool{Name: "snapshot-controller", Module: "github.com/kubernetes-csi/external-snapshotter/v8", Version: SnapshotterVersion,
		Package: "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller", ReplaceFrom: snapshotterReplaces,
		LDFlags: "-s -w -X main.version=" + SnapshotterVersion, Group: SidecarGroup}
	// rancher/local-path-provisioner, what k3s provisions local volumes with: the
	// side-by-side benchmark (BenchmarkSideBySide) runs it beside poolcsi.
	LocalPath = Tool{Name: "local-path-provisioner", Module: "github.com/rancher/local-path-provisioner", Version: LocalPathVersion,
		Package: "github.com/rancher/local-path-provisioner", LDFlags: "-s -w -X main.VERSION=" + LocalPathVersion}
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

// Built tells whether tl's binary is in the cache: Build would return at once.
func (tl Tool) Built() bool { return fileExists(filepath.Join(tl.cacheEntry(), tl.Name)) }

// Build returns the cached binary, building it first if needed, and how long a build took
// (zero when the binary was cached). A build holds an flock on the cache entry (on the
// group's, for a tool of a group), so that the tests, cmd/prebuild and a second test run
// never build the same tool at once: the second waits and finds the first one's binary.
func (tl Tool) Build(ctx context.Context) (string, time.Duration, error) {
	buildMu.Lock()
	defer buildMu.Unlock()
	bin := filepath.Join(tl.cacheEntry(), tl.Name)
	if fileExists(bin) {
		return bin, 0, nil
	}
	if err := os.MkdirAll(CacheDir(), 0o755); err != nil {
		return "", 0, err
	}
	lock, err := os.OpenFile(tl.lockPath(), os.O_CREATE|os.O_RDWR, 0o644)
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
	if err := tl.build(ctx); err != nil {
		return "", 0, fmt.Errorf("building %s %s %s from the Go module proxy: %w", tl.Name, tl.Module, tl.Version, err)
	}
	return bin, time.Since(start), nil
}

// cacheEntry is the tool's directory in the cache: a new version or Go release is a new
// entry, and so is a new member of the tool's group (its dependencies may then change).
func (tl Tool) cacheEntry() string {
	if tl.Group != "" {
		return filepath.Join(CacheDir(), fmt.Sprintf("%s-%s-%s-%s", tl.Name, tl.Version, tl.groupKey(), runtime.Version()))
	}
	return filepath.Join(CacheDir(), fmt.Sprintf("%s-%s-%s", tl.Name, tl.Version, runtime.Version()))
}

// lockPath is the flock a build holds: one per group, whose members one go build makes.
func (tl Tool) lockPath() string {
	if tl.Group != "" {
		return filepath.Join(CacheDir(), fmt.Sprintf("%s-%s.lock", tl.groupKey(), runtime.Version()))
	}
	return tl.cacheEntry() + ".lock"
}

// members are the tools built with tl: those of All in its group, or tl alone.
func (tl Tool) members() []Tool {
	if tl.Group == "" {
		return []Tool{tl}
	}
	var out []Tool
	for _, m := range All {
		if m.Group == tl.Group {
			out = append(out, m)
		}
	}
	return out
}

// groupKey names the group and what it is built from (every member's module and version).
func (tl Tool) groupKey() string {
	var mods []string
	for _, m := range tl.members() {
		mods = append(mods, m.Module+"@"+m.Version)
	}
	sort.Strings(mods)
	sum := sha256.Sum256([]byte(strings.Join(slices.Compact(mods), "\n")))
	return fmt.Sprintf("%s-%x", tl.Group, sum[:4])
}

// buildMu serializes one process's builds: two at once on two cores only slow each other.
var buildMu sync.Mutex

// build makes tl and the rest of its group in one go build, in a wrapper module that
// requires each member's module and carries the replace lines they carry (ignored in a
// dependency): where members pin one module at different versions, the highest that any of
// them pins or requires wins, as minimal version selection would choose without the pins.
func (tl Tool) build(ctx context.Context) error {
	work, err := os.MkdirTemp("", "poolcsi-k8s-wrap-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	members := tl.members()
	gomod := &modfile.File{}
	if err := gomod.AddModuleStmt("poolcsi.test/wrap/" + tl.Name); err != nil {
		return err
	}
	if err := gomod.AddGoStmt("1.26.0"); err != nil {
		return err
	}
	var sums []string
	var modFiles []*modfile.File
	var replaceFrom []func(*modfile.File) [][2]string
	required := map[string]bool{}
	for _, m := range members {
		if required[m.Module+"@"+m.Version] {
			continue
		}
		required[m.Module+"@"+m.Version] = true
		if err := gomod.AddRequire(m.Module, m.Version); err != nil {
			return err
		}
		if m.ReplaceFrom == nil {
			continue
		}
		f, sum, err := moduleFiles(m.Module, m.Version)
		if err != nil {
			return err
		}
		sums = append(sums, sum)
		modFiles = append(modFiles, f)
		replaceFrom = append(replaceFrom, m.ReplaceFrom)
	}
	pins := mergePins(modFiles, replaceFrom)
	paths := make([]string, 0, len(pins))
	for p := range pins {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		if err := gomod.AddReplace(p, "", p, pins[p]); err != nil {
			return err
		}
	}
	out, err := gomod.Format()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(work, "go.mod"), out, 0o644); err != nil {
		return err
	}
	if len(sums) > 0 {
		if err := os.WriteFile(filepath.Join(work, "go.sum"), []byte(mergeSums(sums)), 0o644); err != nil {
			return err
		}
	}
	if tl.Main != "" {
		if err := os.WriteFile(filepath.Join(work, "main.go"), []byte(tl.Main), 0o644); err != nil {
			return err
		}
	}

	// Each binary goes to work/out/<name>, then into its cache entry.
	outDir := filepath.Join(work, "out")
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return err
	}
	var args []string
	switch {
	case tl.TestBinary:
		args = []string{"test", "-c", "-ldflags", tl.LDFlags, "-o", filepath.Join(outDir, tl.Name), tl.Package}
	case len(members) == 1:
		args = []string{"build", "-ldflags", tl.LDFlags, "-o", filepath.Join(outDir, tl.Name), tl.Package}
	default:
		// go build names a binary after its package's last element: the members' names.
		args = []string{"build"}
		for _, m := range members {
			args = append(args, "-ldflags", m.Package+"="+m.LDFlags)
		}
		args = append(args, "-o", outDir+"/")
		for _, m := range members {
			args = append(args, m.Package)
		}
	}
	cmd := Nice(ctx, goBin(), args...)
	cmd.Dir = work
	cmd.Env = goEnv()
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%w\n%s", err, LastLines(string(b), 40))
	}
	for _, m := range members {
		dir := m.cacheEntry()
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := os.Rename(filepath.Join(outDir, m.Name), filepath.Join(dir, m.Name)); err != nil {
			return err
		}
	}
	return nil
}

// mergePins merges the replace lines that replaceFrom[i] makes of the module files[i]:
// where two pin one module at different versions, the higher wins, and a pin is never below
// what any of the modules requires.
func mergePins(files []*modfile.File, replaceFrom []func(*modfile.File) [][2]string) map[string]string {
	pins := map[string]string{}
	for i, f := range files {
		for _, r := range replaceFrom[i](f) {
			if cur, ok := pins[r[0]]; !ok || semver.Compare(r[1], cur) > 0 {
				pins[r[0]] = r[1]
			}
		}
	}
	for _, f := range files {
		for _, r := range f.Require {
			if cur, ok := pins[r.Mod.Path]; ok && semver.Compare(r.Mod.Version, cur) > 0 {
				pins[r.Mod.Path] = r.Mod.Version
			}
		}
	}
	return pins
}

// moduleFiles fetches a module into the module cache and returns its parsed go.mod and,
// when the module's source has one, its go.sum ("" otherwise).
func moduleFiles(mod, ver string) (*modfile.File, string, error) {
	info, err := ModDownload(mod, ver)
	if err != nil {
		return nil, "", err
	}
	data, err := os.ReadFile(info.GoMod)
	if err != nil {
		return nil, "", err
	}
	f, err := modfile.Parse(info.GoMod, data, nil)
	if err != nil {
		return nil, "", err
	}
	sum, err := os.ReadFile(filepath.Join(info.Dir, "go.sum"))
	if errors.Is(err, os.ErrNotExist) {
		return f, "", nil
	}
	if err != nil {
		return nil, "", err
	}
	return f, string(sum), nil
}

// mergeSums joins go.sum files, each line once.
func mergeSums(sums []string) string {
	seen := map[string]bool{}
	var b strings.Builder
	for _, s := range sums {
		for _, line := range strings.Split(s, "\n") {
			if line != "" && !seen[line] {
				seen[line] = true
				b.WriteString(line + "\n")
			}
		}
	}
	return b.String()
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
