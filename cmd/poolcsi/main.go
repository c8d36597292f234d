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
	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/config"
	"github.com/poolcsi/poolcsi/internal/demo"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/fsx"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/kubeletplugin"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/metrics"
	"github.com/poolcsi/poolcsi/internal/pool"
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

// poolFlags collects repeated --pool flags.
type poolFlags []pool.Config

func (p *poolFlags) String() string { return fmt.Sprint(*p) }
func (p *poolFlags) Set(s string) error {
	c, err := config.ParsePoolFlag(s)
	if err != nil {
		return err
	}
	*p = append(*p, c)
	return nil
}

func serve(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	klog.InitFlags(fs)
	endpoint := fs.String("endpoint", "unix:///csi/csi.sock", "CSI endpoint (unix socket)")
	nodeID := fs.String("node-id", "", "this node's ID (the Kubernetes node name); defaults to the host name")
	driverName := fs.String("driver-name", "poolcsi.io", "CSI driver name")
	mode := fs.String("mode", "all", "services to serve: controller, node or all")
	configFile := fs.String("config", "", "YAML config file with a pools: list")
	maxVolumes := fs.Int64("max-volumes-per-node", 0, "volumes a node may hold, reported to the scheduler (0: no limit)")
	expandOnNode := fs.Bool("expand-on-node", false, "grow local-pool images in NodeExpandVolume and do not advertise controller expansion (for a cluster-wide resizer serving node-local pools)")
	metricsAddr := fs.String("metrics-address", "", "host:port to serve Prometheus /metrics on (empty: no metrics)")
	poolFull := fs.Float64("pool-full-threshold", health.DefaultOptions.PoolFullThreshold*100, "percent of a pool's filesystem in use above which its sparse volumes report PoolNearlyFull")
	volumeFull := fs.Float64("volume-full-threshold", health.DefaultOptions.VolumeFullThreshold*100, "percent of a volume's filesystem (bytes or inodes) in use above which it reports VolumeNearlyFull")
	mountRetry := fs.Duration("mount-retry", 30*time.Second, "how often a pool whose mount stanza failed is mounted again")
	pathPrefix := fs.String("allowed-path-prefix", defaultPathPrefix, "the only directory staging and target paths may be below (kubelet's root directory, whose own path may go through links; below it no component may be one); / for any path")
	registrationDir := fs.String("registration-dir", "", "kubelet's plugins_registry directory: register the node plugin with kubelet there (replaces node-driver-registrar); empty: off")
	kubeletEndpoint := fs.String("kubelet-registration-path", "", "the CSI socket as kubelet sees it on the host, given to kubelet at registration (default: the --endpoint path)")
	statsHealthTTL := fs.Duration("stats-health-ttl", 5*time.Second, "how long NodeGetVolumeStats reuses a volume's node-side health condition (0: recompute every call)")
	pvcEvents := fs.Duration("pvc-events-interval", 0, "how often to put volume health on the claims as events (VolumeConditionAbnormal), as the health monitor sidecar does; 0: off")
	claimSnapshots := fs.Bool("claim-local-snapshots", false, "label the pre-provisioned VolumeSnapshotContents of this driver whose snapshot this node's pools hold snapshot.storage.kubernetes.io/managed-by=<node-id>, so that this node's csi-snapshotter (--node-deployment) serves them")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig for --pvc-events-interval and --claim-local-snapshots (default: the pod's service account)")
	leaseNamespace := fs.String("leader-election-namespace", "", "with --pvc-events-interval: only the holder of a Lease in this namespace reports, so controller replicas do not repeat each other; empty: no leader election")
	healthzAddr := fs.String("healthz-address", "", "host:port to serve /healthz on, answering Probe in-process as the livenessprobe sidecar does; empty: off")
	shareDir := fs.String("share-dir", poolmount.DefaultShareDir, "where the shares StorageClasses name are mounted, one directory each; empty: StorageClasses cannot name shares")
	shareTypes := fs.String("share-types", strings.Join(driver.DefaultShareTypes, ","), "the share types (mount types) StorageClasses and volume IDs may name, comma-separated; bind mounts a node directory")
	shareTimeout := fs.Duration("share-mount-timeout", poolmount.DefaultTimeout, "how long one mount of a share may take before it is killed")
	shareKeyFile := fs.String("share-key-file", "", "the cluster's share key, one per line (the first tags new volume IDs, any verifies one; at least 32 bytes each): every controller and node of the cluster must have it. Without it StorageClasses cannot name shares")
	leaseDuration := fs.Duration("lease-duration", lease.Default.Duration, "how long a node plugin may go without renewing its lease in a shared pool before it fences itself off (its loop devices there stop taking I/O); a controller force-detaches a volume from a node only after this plus --lease-margin without a renewal (docs/fencing.md)")
	leaseInterval := fs.Duration("lease-renew-interval", lease.Default.Interval, "how often a node plugin renews its lease in each shared pool")
	leaseMargin := fs.Duration("lease-margin", lease.Default.Margin, "how much longer than the lease duration a controller waits, by its own clock, before it takes a volume from a node that stopped renewing")
	memLimit := fs.Int64("memory-limit-mib", defaultMemoryLimitMiB, "soft limit of the Go runtime's memory in MiB (debug.SetMemoryLimit): the GC works harder near it instead of letting the heap double in a burst; 0: no limit. The GOMEMLIMIT environment variable, when set, wins")
	var pools poolFlags
	fs.Var(&pools, "pool", "a pool, NAME=PATH[,shared]; repeatable")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("serve: unexpected arguments %s", strings.Join(fs.Args(), " "))
	}
	setMemoryLimit(*memLimit)
	m, err := driver.ParseMode(*mode)
	if err != nil {
		return err
	}
	if *nodeID == "" {
		if *nodeID, err = os.Hostname(); err != nil {
			return fmt.Errorf("--node-id not given and no host name: %w", err)
		}
	}
	var file config.File
	if *configFile != "" {
		if file, err = config.Load(*configFile); err != nil {
			return err
		}
	}
	mounts := config.Mounts(file, pools)
	var readiness []func() error
	var opened []*pool.Pool
	for _, c := range config.Pools(file, pools) {
		if spec, ok := mounts[c.Name]; ok {
			m, err := poolmount.New(c.Name, c.Path, spec)
			if err != nil {
				return err
			}
			// A pool that cannot be mounted is reported by Probe, not fatal: the
			// other pools keep serving and the mount is retried.
			if err := m.Ensure(ctx); err != nil {
				klog.ErrorS(err, "Pool not mounted at start-up; retrying in the background", "pool", c.Name)
			}
			go m.Keep(ctx, *mountRetry)
			readiness = append(readiness, m.Ready)
		}
		p, err := pool.Open(c)
		if err != nil {
			return err
		}
		opened = append(opened, p)
	}
	shares, types, err := shareMounter(*shareDir, *shareTypes, *shareTimeout)
	if err != nil {
		return err
	}
	shareKeys, err := readShareKeys(*shareKeyFile)
	if err != nil {
		return err
	}
	thresholds := health.Options{PoolFullThreshold: *poolFull / 100, VolumeFullThreshold: *volumeFull / 100}
	d, err := driver.New(driver.Options{
		Name:              *driverName,
		Version:           buildVersion(),
		PathPrefix:        *pathPrefix,
		StatsHealthTTL:    *statsHealthTTL,
		NodeID:            *nodeID,
		Mode:              m,
		Pools:             opened,
		MaxVolumesPerNode: *maxVolumes,
		ExpandOnNode:      *expandOnNode,
		Health:            thresholds,
		Readiness:         readiness,
		Shares:            shares,
		ShareTypes:        types,
		ShareKeys:         shareKeys,
		Lease:             lease.Timing{Duration: *leaseDuration, Interval: *leaseInterval, Margin: *leaseMargin},
	})
	if err != nil {
		return err
	}
	var interceptors []grpc.UnaryServerInterceptor
	if *metricsAddr != "" {
		mx := metrics.New(*driverName, opened, thresholds)
		if m == driver.ModeNode || m == driver.ModeAll {
			mx.WatchLeases(func() []metrics.LeaseState { return leaseStates(d) })
		}
		if _, err := mx.Serve(ctx, *metricsAddr); err != nil {
			return err
		}
		interceptors = append(interceptors, mx.Interceptor)
	}
	if *pvcEvents > 0 {
		if err := startPVCEvents(ctx, d, *driverName, *kubeconfig, *leaseNamespace, *pvcEvents); err != nil {
			return err
		}
	}
	if *claimSnapshots {
		if err := startSnapshotClaims(ctx, d, *driverName, *nodeID, *kubeconfig); err != nil {
			return err
		}
	}
	if *healthzAddr != "" {
		if err := serveHealthz(ctx, *healthzAddr, d); err != nil {
			return err
		}
	}
	if *registrationDir != "" {
		csiPath := *kubeletEndpoint
		if csiPath == "" {
			csiPath = strings.TrimPrefix(*endpoint, "unix://")
		}
		r := &kubeletplugin.Registrar{DriverName: *driverName, Endpoint: csiPath, Dir: *registrationDir}
		go func() {
			if err := r.Run(ctx, probeEndpoint(*endpoint)); err != nil {
				klog.ErrorS(err, "Kubelet plugin registration stopped; kubelet will not use this node plugin until it restarts")
			}
		}()
	}
	return d.Serve(ctx, *endpoint, interceptors...)
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
