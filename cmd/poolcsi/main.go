// Command poolcsi is the poolcsi CSI driver: `poolcsi serve` runs it, `poolcsi
// version` prints its version. Flags and wiring only; the logic lives in internal/.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/demo"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/fsx"
	"github.com/poolcsi/poolcsi/internal/metrics"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// version is set with -ldflags "-X main.version=..." by release builds; otherwise
// the module version from the build info is used.
var version = ""

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

const usage = `poolcsi — a CSI driver that carves volumes out of local or shared directory pools.

Usage:
  poolcsi serve --endpoint unix:///path/csi.sock --node-id NODE --pool NAME=PATH[,shared] [flags]
  poolcsi demo [--temp-dir DIR]     (as root: a guided tour of the CSI calls on a throw-away pool)
  poolcsi pool list|check --path POOL_DIR
  poolcsi pool unfence --path POOL_DIR --volume VOLUME_ID [--node NODE]
  poolcsi version

Run "poolcsi serve -h" for the flags of serve.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	// serve and demo end on SIGTERM or SIGINT by cleaning up (the server
	// stops, the demo unmounts what it made); the pool commands keep the
	// default action, which ends the process at once whatever it is blocked
	// in: every write of theirs is crash-safe, as a SIGKILL's would be.
	ctx := context.Background()
	if os.Args[1] != "pool" {
		var stop context.CancelFunc
		ctx, stop = signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
		defer stop()
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(ctx, os.Args[2:])
	case "demo":
		err = runDemo(ctx, os.Args[2:])
	case "pool":
		err = poolCmd(ctx, os.Args[2:])
	case "version":
		fmt.Println(buildVersion())
	case "-h", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "poolcsi: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	klog.Flush()
	if err != nil {
		if !errors.Is(err, errProblems) {
			fmt.Fprintf(os.Stderr, "poolcsi: %v\n", err)
		}
		os.Exit(1)
	}
}

func runDemo(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	tempDir := fs.String("temp-dir", "", "where to make the throw-away pool (default: the system temp directory)")
	verbose := fs.Bool("driver-log", false, "also print the driver's own log")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("demo: unexpected arguments %s", strings.Join(fs.Args(), " "))
	}
	if !*verbose {
		// The demo prints the calls itself; the driver's log would interleave.
		klog.SetLogger(logr.Discard())
	}
	return demo.Run(ctx, demo.Config{Out: os.Stdout, TempDir: *tempDir, Version: buildVersion()})
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
// Issue 14 measures it: docs/performance.md.
const defaultMemoryLimitMiB = 20

// setMemoryLimit applies --memory-limit-mib unless GOMEMLIMIT is set, which
// the runtime has already applied and which an operator set on purpose.
func setMemoryLimit(mib int64) {
	if os.Getenv("GOMEMLIMIT") != "" || mib <= 0 {
		return
	}
	debug.SetMemoryLimit(mib << 20)
}

// readShareKeys reads --share-key-file: one key per line (a Kubernetes
// Secret's value, mounted through links), the first the one that tags. No
// file, no keys.
func readShareKeys(path string) ([][]byte, error) {
	if path == "" {
		return nil, nil
	}
	raw, err := fsx.ReadFileFollow(path, 16<<10)
	if err != nil {
		return nil, fmt.Errorf("--share-key-file: %w", err)
	}
	var keys [][]byte
	for _, line := range strings.Split(string(raw), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			keys = append(keys, []byte(line))
		}
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("--share-key-file %s holds no key", path)
	}
	return keys, nil
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

// leaseStates are the node's leases as the metrics report them.
func leaseStates(d *driver.Driver) []metrics.LeaseState {
	var out []metrics.LeaseState
	for _, s := range d.LeaseStates() {
		out = append(out, metrics.LeaseState{Pool: s.Pool, Age: s.Age, Fenced: s.Fenced})
	}
	return out
}
