// Command poolcsi is the poolcsi CSI driver: `poolcsi serve` runs it; `demo`,
// `pool` and `version` are for operators. Flags and wiring only; the logic lives in internal/.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/demo"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/metrics"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// Set with -ldflags "-X main.version=... -X main.commit=... -X main.buildDate=..."
// (the Makefile's build does); what is not set comes from the build info.
var (
	version   = ""
	commit    = ""
	buildDate = ""
)

// buildVersion is the version the driver reports (GetPluginInfo, logs): the
// -ldflags version, else the module version plus the VCS revision.
func buildVersion() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		v := bi.Main.Version
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 12 {
				v += "+" + s.Value[:12]
			}
		}
		if v != "" {
			return v
		}
	}
	return "devel"
}

// versionInfo is what `poolcsi version` prints.
type versionInfo struct {
	Version, Commit, GoVersion, Platform, BuildDate string
}

// readVersionInfo takes -ldflags first and fills the gaps from bi (nil: no
// build info): go build stamps the revision and the commit time, not the
// build time, so without -X main.buildDate the date shown is the commit's.
func readVersionInfo(bi *debug.BuildInfo) versionInfo {
	vi := versionInfo{Version: buildVersion(), Commit: commit, GoVersion: runtime.Version(),
		Platform: runtime.GOOS + "/" + runtime.GOARCH, BuildDate: buildDate}
	if bi == nil {
		return vi
	}
	var rev, when string
	dirty := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			when = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if vi.Commit == "" && rev != "" {
		vi.Commit = rev
		if dirty {
			vi.Commit += " (modified)"
		}
	}
	if vi.BuildDate == "" && when != "" {
		vi.BuildDate = when + " (commit time)"
	}
	return vi
}

func (vi versionInfo) write(w io.Writer) {
	fmt.Fprintf(w, "poolcsi %s\n", vi.Version)
	fmt.Fprintf(w, "  commit:  %s\n", orUnknown(vi.Commit))
	fmt.Fprintf(w, "  go:      %s %s\n", vi.GoVersion, vi.Platform)
	fmt.Fprintf(w, "  built:   %s\n", orUnknown(vi.BuildDate))
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

const usage = `poolcsi — a CSI driver that carves volumes out of local or shared directory pools.

Usage:
  poolcsi serve --endpoint unix:///path/csi.sock --node-id NODE --pool NAME=PATH[,shared] [flags]
  poolcsi demo [--temp-dir DIR]     (as root: a guided tour of the CSI calls on a throw-away pool)
  poolcsi pool init|list|check --path POOL_DIR
  poolcsi pool unfence --path POOL_DIR --volume VOLUME_ID [--node NODE]
  poolcsi status [--endpoint unix:///path/csi.sock] [-o text|json]   (what the driver answers: pools, volumes, health)
  poolcsi call [--endpoint unix:///path/csi.sock] METHOD ['{json}']   (any CSI call, JSON in and out)
  poolcsi version                   (also: poolcsi --version)

Every command takes -h for its flags, e.g. "poolcsi serve -h".
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run is main without the exit, for the tests: the exit code of args.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	// serve and demo end on SIGTERM or SIGINT by cleaning up (the server
	// stops, the demo unmounts what it made); the pool commands keep the
	// default action, which ends the process at once whatever it is blocked
	// in: every write of theirs is crash-safe, as a SIGKILL's would be.
	ctx := context.Background()
	if args[0] != "pool" {
		var stop context.CancelFunc
		ctx, stop = signalContext()
		defer stop()
	}
	// -h asks for the usage: it goes to stdout and exits 0, for every command as for
	// `poolcsi -h`; a usage error goes to stderr and exits non-zero.
	if asksHelp(args[1:]) {
		stderr = stdout
	}
	var err error
	switch args[0] {
	case "serve":
		err = serve(ctx, args[1:], stderr)
	case "demo":
		err = runDemo(ctx, args[1:], stdout, stderr)
	case "pool":
		err = poolCmd(ctx, args[1:], stdout, stderr)
	case "status":
		err = statusCmd(ctx, args[1:], stdout, stderr)
	case "call":
		err = callCmd(ctx, args[1:], stdout, stderr)
	case "version", "--version", "-version":
		err = versionCmd(args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
	default:
		fmt.Fprintf(stderr, "poolcsi: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	klog.Flush()
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0 // -h asked for the usage, which the flag set printed
	case errors.Is(err, errProblems):
		return 1 // pool check printed them
	case errors.Is(err, errAbnormal):
		return 2 // status printed what
	}
	fmt.Fprintf(stderr, "poolcsi: %v\n", err)
	return 1
}

// asksHelp tells whether args, a command's, hold -h, -help or --help as a flag (before a
// "--" that ends the flags).
func asksHelp(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "-h", "-help", "--help":
			return true
		}
	}
	return false
}

// signalContext ends on SIGINT or SIGTERM, with the signal as its cause.
func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
}

// newFlagSet is a flag set whose usage says what the command does before its
// flags. Parse errors and -h print to stderr, as the flag package does.
func newFlagSet(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: poolcsi %s\n", synopsis)
		n := 0
		fs.VisitAll(func(*flag.Flag) { n++ })
		if n > 0 {
			fmt.Fprintln(fs.Output(), "\nFlags:")
			fs.PrintDefaults()
		}
	}
	return fs
}

// parseFlags parses args, which must hold flags only. It returns
// flag.ErrHelp for -h, which run turns into exit code 0.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected arguments %s", fs.Name(), strings.Join(fs.Args(), " "))
	}
	return nil
}

func versionCmd(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "version\n\nPrints the version, the commit, the Go version and the build date.", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	bi, _ := debug.ReadBuildInfo()
	readVersionInfo(bi).write(stdout)
	return nil
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", "demo [flags]\n\nAs root: starts the driver in this process on a throw-away local pool and walks one\nvolume through the calls kubelet and the sidecars make, printing each.", stderr)
	tempDir := fs.String("temp-dir", "", "where to make the throw-away pool (default: the system temp directory)")
	verbose := fs.Bool("driver-log", false, "also print the driver's own log")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if !*verbose {
		// The demo prints the calls itself; the driver's log would interleave.
		klog.SetLogger(logr.Discard())
	}
	return demo.Run(ctx, demo.Config{Out: stdout, TempDir: *tempDir, Version: buildVersion()})
}

// defaultPathPrefix is kubelet's default root directory: a driver started
// without --allowed-path-prefix mounts nowhere else.
const defaultPathPrefix = "/var/lib/kubelet"

// defaultMemoryLimitMiB is the soft memory limit of `serve`. The driver's live
// heap is a few MiB; what grows it is a burst, an unpaged ListVolumes of a
// large pool, during which GOGC=100 lets the heap reach twice what the burst
// holds, and the runtime keeps those pages until a later GC. The driver runs on
// every node (a DaemonSet), so its footprint counts: with the limit the GC
// collects earlier in such a burst, which costs CPU only then. The limit is
// soft: a heap that needs more gets it (the runtime never fails an allocation
// for it, and caps GC work at about half the CPU), so it cannot cause an
// out-of-memory kill; the container's own limit (deploy/) is far above it.
// docs/performance.md ("Start with 10,000 volumes") measures it.
const defaultMemoryLimitMiB = 20

// setMemoryLimit applies --memory-limit-mib unless GOMEMLIMIT is set, which
// the runtime has already applied and which an operator set on purpose.
func setMemoryLimit(mib int64) {
	if os.Getenv("GOMEMLIMIT") != "" || mib <= 0 {
		return
	}
	debug.SetMemoryLimit(mib << 20)
}

// shareMounter is the share machinery --share-dir and --share-types ask for:
// none when the directory is empty.
func shareMounter(dir, typeList string, timeout time.Duration) (driver.ShareMounter, []string, error) {
	if dir == "" {
		return nil, nil, nil
	}
	sh, err := poolmount.NewShares(dir, timeout)
	if err != nil {
		return nil, nil, fmt.Errorf("--share-dir: %w", err)
	}
	types := []string{}
	for _, t := range strings.Split(typeList, ",") {
		if t = strings.TrimSpace(t); t != "" {
			types = append(types, t)
		}
	}
	return sh, types, nil
}

// peerLeaseStates are every node's leases as the controller's metrics report them.
func peerLeaseStates(d *driver.Driver) []metrics.PeerLeaseState {
	var out []metrics.PeerLeaseState
	for _, s := range d.PeerLeases() {
		out = append(out, metrics.PeerLeaseState{Pool: s.Pool, Node: s.Node, Unchanged: s.Unchanged, Stages: s.Stages})
	}
	return out
}

// leaseStates are the node's leases as the metrics report them.
func leaseStates(d *driver.Driver) []metrics.LeaseState {
	var out []metrics.LeaseState
	for _, s := range d.LeaseStates() {
		out = append(out, metrics.LeaseState{Pool: s.Pool, Age: s.Age, Fenced: s.Fenced, FailedClosed: s.FailedClosed})
	}
	return out
}
