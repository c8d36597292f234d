package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/agent"
	"github.com/poolcsi/poolcsi/internal/central"
	"github.com/poolcsi/poolcsi/internal/config"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/fence"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/kubeletplugin"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/metrics"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/nodestate"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
	"github.com/poolcsi/poolcsi/internal/runner"
)

// serveOptions are the flags of `poolcsi serve`. newServeOptions holds the
// defaults; AddFlags binds the fields to a flag set, taking the defaults from
// the fields, so the flag set, the README's table and the tests read one source.
type serveOptions struct {
	Endpoint        string
	NodeID          string
	DriverName      string
	Mode            string
	ConfigFile      string
	Pools           poolFlags
	MaxVolumes      int64
	ExpandOnNode    bool
	PathPrefix      string
	StatsHealthTTL  time.Duration
	MemoryLimitMiB  int64
	MountRetry      time.Duration
	MetricsAddr     string
	HealthzAddr     string
	RegistrationDir string
	KubeletEndpoint string
	StateDir        string

	// Percent, as on the command line; health.Options wants fractions.
	PoolFullPercent   float64
	VolumeFullPercent float64

	PVCEventsInterval time.Duration
	ClaimSnapshots    bool
	Kubeconfig        string
	LeaseNamespace    string

	ShareDir          string
	ShareTypes        string
	ShareMountTimeout time.Duration
	ShareKeyFile      string

	Lease  lease.Timing
	Freeze driver.FreezeTiming

	CgroupRoot       string
	IOLimitsInterval time.Duration

	EphemeralPool  string
	EphemeralSweep time.Duration

	// The local agent (localagent.go).
	LocalAgent       bool
	CallsNamespace   string
	AgentWorkers     int
	AgentCallTimeout time.Duration
	AgentHeartbeat   time.Duration

	// The local driver's central controller (localcentral.go).
	LocalCentral   bool
	NodeStaleAfter time.Duration
	NodeCallPickup time.Duration
}

func newServeOptions() *serveOptions {
	return &serveOptions{
		Endpoint:          "unix:///csi/csi.sock",
		DriverName:        "poolcsi.io",
		Mode:              string(driver.ModeAll),
		PathPrefix:        defaultPathPrefix,
		StatsHealthTTL:    5 * time.Second,
		MemoryLimitMiB:    defaultMemoryLimitMiB,
		MountRetry:        30 * time.Second,
		PoolFullPercent:   health.DefaultOptions.PoolFullThreshold * 100,
		VolumeFullPercent: health.DefaultOptions.VolumeFullThreshold * 100,
		ShareDir:          poolmount.DefaultShareDir,
		ShareTypes:        strings.Join(driver.DefaultShareTypes, ","),
		ShareMountTimeout: poolmount.DefaultTimeout,
		Lease:             lease.Default,
		Freeze:            driver.DefaultFreezeTiming,
		CgroupRoot:        "/sys/fs/cgroup",
		IOLimitsInterval:  driver.DefaultIOLimitsInterval,
		EphemeralSweep:    driver.DefaultEphemeralSweep,
		StateDir:          "/var/lib/poolcsi/state",
		AgentWorkers:      agent.DefaultWorkers,
		AgentCallTimeout:  agent.DefaultCallTimeout,
		AgentHeartbeat:    agent.DefaultHeartbeat,
		NodeStaleAfter:    central.DefaultStaleAfter,
		NodeCallPickup:    central.DefaultPickup,
	}
}

// AddFlags registers serve's own flags (not klog's) on fs.
func (o *serveOptions) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Endpoint, "endpoint", o.Endpoint, "the CSI socket, unix://PATH (a stale socket file, one nothing answers on, is replaced)")
	fs.StringVar(&o.NodeID, "node-id", o.NodeID, "this node's ID; use the Kubernetes node name (default: the host name)")
	fs.StringVar(&o.DriverName, "driver-name", o.DriverName, "CSI driver name")
	fs.StringVar(&o.Mode, "mode", o.Mode, "services to serve: controller, node or all")
	fs.StringVar(&o.ConfigFile, "config", o.ConfigFile, "YAML config `FILE`: pools: [{name, path, shared, overcommit, ephemeral, mount: {type, source, options, timeout}}]; flags win on a name clash (docs/pools.md)")
	fs.Int64Var(&o.MaxVolumes, "max-volumes-per-node", o.MaxVolumes, "volumes a node may hold (0: no limit): reported by NodeGetInfo and held by ControllerPublishVolume (counted from a per-node index in the pool, docs/format.md#the-attach-limits-index)")
	fs.BoolVar(&o.ExpandOnNode, "expand-on-node", o.ExpandOnNode, "grow local-pool images in NodeExpandVolume and do not advertise controller expansion (one cluster-wide resizer for node-local pools; docs/deploy.md)")
	fs.StringVar(&o.MetricsAddr, "metrics-address", o.MetricsAddr, "host:port to serve Prometheus /metrics on (docs/metrics.md); empty: off")
	fs.Float64Var(&o.PoolFullPercent, "pool-full-threshold", o.PoolFullPercent, "percent of a pool's filesystem in use above which its sparse volumes report PoolNearlyFull")
	fs.Float64Var(&o.VolumeFullPercent, "volume-full-threshold", o.VolumeFullPercent, "percent of a volume's filesystem (bytes or inodes) in use above which it reports VolumeNearlyFull")
	fs.DurationVar(&o.MountRetry, "mount-retry", o.MountRetry, "how often a pool whose mount: stanza failed is mounted again")
	fs.StringVar(&o.PathPrefix, "allowed-path-prefix", o.PathPrefix, "the only directory staging and target paths may be strictly below (the chart sets kubelet's root directory, whose own path may go through links); below it no path component may be a symbolic link, and each path is resolved once and used through what was resolved; / allows any path (docs/format.md#what-the-driver-trusts-and-what-it-does-not)")
	fs.StringVar(&o.StateDir, "state-dir", o.StateDir, "where the node plugin keeps its own records, outside every pool (what it staged and froze: the self-fence and freeze recovery read them when a pool no longer answers or after a restart); on the node's own disk, kept across restarts of the plugin (docs/fencing.md); empty: in memory only, which a node plugin with shared pools or --share-dir refuses (a restart would fence nothing)")
	fs.StringVar(&o.RegistrationDir, "registration-dir", o.RegistrationDir, "kubelet's plugins_registry directory: register the node plugin with kubelet there (replaces node-driver-registrar); empty: off")
	fs.StringVar(&o.KubeletEndpoint, "kubelet-registration-path", o.KubeletEndpoint, "the CSI socket as kubelet sees it on the host, given to kubelet at registration (default: the --endpoint path)")
	fs.DurationVar(&o.StatsHealthTTL, "stats-health-ttl", o.StatsHealthTTL, "how long NodeGetVolumeStats reuses a volume's node-side health condition (kubelet asks every minute); 0: recompute every call")
	fs.DurationVar(&o.PVCEventsInterval, "pvc-events-interval", o.PVCEventsInterval, "how often to put volume health on the claims as events (VolumeConditionAbnormal), as the health monitor sidecar does; 0: off")
	fs.BoolVar(&o.ClaimSnapshots, "claim-local-snapshots", o.ClaimSnapshots, "label snapshot.storage.kubernetes.io/managed-by=<node-id> the contents of this driver the snapshot-controller leaves unlabelled whose source this node's pools hold: pre-provisioned VolumeSnapshotContents, group member VolumeSnapshotContents, and VolumeGroupSnapshotContents (all their volumes, or their group snapshot, here; only if the group snapshot CRDs are installed when poolcsi starts), so that this node's csi-snapshotter (--node-deployment) serves them")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "kubeconfig for --pvc-events-interval and --claim-local-snapshots (default: the pod's service account)")
	fs.StringVar(&o.LeaseNamespace, "leader-election-namespace", o.LeaseNamespace, "with --pvc-events-interval: only the holder of a Lease in this namespace reports, so controller replicas do not repeat each other; empty: no leader election")
	fs.StringVar(&o.HealthzAddr, "healthz-address", o.HealthzAddr, "host:port to serve /healthz on from an in-process Probe, as the livenessprobe sidecar does (no sidecar needed); empty: off")
	fs.StringVar(&o.ShareDir, "share-dir", o.ShareDir, "where the shares StorageClasses name are mounted, one directory each; empty: StorageClasses cannot name shares (docs/pools.md#shares-named-by-a-storageclass)")
	fs.StringVar(&o.ShareTypes, "share-types", o.ShareTypes, "the share types (mount types) StorageClasses and volume IDs may name, comma-separated, each with its own source grammar and option allow-list; fuse.ceph (ceph-fuse, run with the driver's own argv) and bind (a node directory) only when listed")
	fs.DurationVar(&o.ShareMountTimeout, "share-mount-timeout", o.ShareMountTimeout, "how long one mount of a share may take before it is killed")
	fs.StringVar(&o.ShareKeyFile, "share-key-file", o.ShareKeyFile, "the cluster's share key `FILE`, one key per line (the first tags new volume IDs on shares, any verifies a tag; at least 32 bytes each): every controller and node of the cluster needs it (the chart mounts it from the Secret shareKey.existingSecret names). Without it StorageClasses cannot name shares (docs/pools.md#what-a-volume-id-may-carry-and-why)")
	fs.DurationVar(&o.Lease.Duration, "lease-duration", o.Lease.Duration, "how long a node plugin may go without renewing its lease in a shared pool before it fences itself off (its loop devices there stop taking I/O); a controller force-detaches a volume from a node only after this plus --lease-margin without a renewal (docs/fencing.md)")
	fs.DurationVar(&o.Lease.Interval, "lease-renew-interval", o.Lease.Interval, "how often a node plugin renews its lease in each shared pool")
	fs.DurationVar(&o.Lease.Margin, "lease-margin", o.Lease.Margin, "how much longer than the lease duration a controller waits, by its own clock, before it takes a volume from a node that stopped renewing")
	fs.DurationVar(&o.Freeze.Poll, "freeze-poll-interval", o.Freeze.Poll, "how often a node plugin reads its freeze inbox in each pool, where a controller on another node asks it to freeze a volume's filesystem for a snapshot (docs/snapshots.md#freezing-across-nodes)")
	fs.DurationVar(&o.Freeze.MaxHold, "freeze-max-hold", o.Freeze.MaxHold, "the longest a node plugin keeps a filesystem frozen for another node's snapshot, by its own clock: a controller that dies mid-copy never leaves it frozen longer, and a copy that outlasts it fails and is retried")
	fs.DurationVar(&o.Freeze.AckTimeout, "freeze-ack-timeout", o.Freeze.AckTimeout, "how long a controller waits for a node to confirm a freeze before the snapshot fails UNAVAILABLE (or goes on without it, if the node's lease has expired)")
	fs.StringVar(&o.CgroupRoot, "cgroup-root", o.CgroupRoot, "where the node plugin finds pods' cgroups to hold them to their volumes' I/O limits (a VolumeAttributesClass's readBytesPerSecond, ...): cgroup v2 io.max, or v1 blkio/ below it; the node plugin needs the host's cgroup filesystem there, writable (docs/modify.md)")
	fs.DurationVar(&o.IOLimitsInterval, "io-limits-interval", o.IOLimitsInterval, "how often the node plugin re-applies the I/O limits of the volumes published on this node, so a changed VolumeAttributesClass reaches running pods")
	fs.Int64Var(&o.MemoryLimitMiB, "memory-limit-mib", o.MemoryLimitMiB, "soft limit of the Go runtime's memory in MiB (debug.SetMemoryLimit): the GC works harder near it instead of letting the heap double in a burst; 0: no limit. The GOMEMLIMIT environment variable, when set, wins (docs/performance.md#start-with-10000-volumes)")
	fs.Var(&o.Pools, "pool", "a pool, `NAME=PATH[,OPTION...]`; OPTION: shared, ephemeral or noephemeral (allow or refuse ephemeral inline volumes in it, docs/ephemeral.md); repeatable")
	fs.StringVar(&o.EphemeralPool, "ephemeral-pool", o.EphemeralPool, "the pool of ephemeral inline volumes whose attributes name none (default: the first local pool that allows them; docs/ephemeral.md)")
	fs.DurationVar(&o.EphemeralSweep, "ephemeral-sweep-interval", o.EphemeralSweep, "how often the node plugin removes the ephemeral inline volumes of this node that no unpublish removed and whose target no longer holds them, besides once at start; 0: at start only")
	fs.BoolVar(&o.LocalAgent, "local-agent", o.LocalAgent, "run the PoolCalls a central controller addresses to this node on this node's own socket, and keep this node's PoolNode (heartbeat, capacity of its local pools); needs --mode=all and the poolcalls/poolnodes CRDs (docs/design/central-controller.md)")
	fs.StringVar(&o.CallsNamespace, "calls-namespace", o.CallsNamespace, "with --local-agent or --local-central: the namespace of the PoolCalls and PoolNodes (default: the pod's own)")
	fs.IntVar(&o.AgentWorkers, "agent-workers", o.AgentWorkers, "with --local-agent: how many volumes' (targets') calls run at once; one target's calls run one at a time, in the order issued")
	fs.DurationVar(&o.AgentCallTimeout, "agent-call-timeout", o.AgentCallTimeout, "with --local-agent: how long one call may run on this node; longer than a sidecar's timeout on purpose (a long copy completes, and the retry finds it done)")
	fs.DurationVar(&o.AgentHeartbeat, "agent-heartbeat", o.AgentHeartbeat, "with --local-agent: how often this node's PoolNode is renewed; the controller takes a node that stops renewing as down")
	fs.BoolVar(&o.LocalCentral, "local-central", o.LocalCentral, "serve the local driver's central controller on --endpoint instead of a driver: Identity, Controller and GroupController, each call about a node's local pool carried to that node's --local-agent through a PoolCall; opens no pool (reads only the pool names of --config and --pool) and does no node work; needs --mode=controller and the poolcalls/poolnodes CRDs; the local driver takes no shares, so --share-dir and --share-types are not used (docs/design/central-controller.md)")
	fs.DurationVar(&o.NodeStaleAfter, "node-stale-after", o.NodeStaleAfter, "with --local-central: a node whose PoolNode this process has not seen change for this long, by its own clock, is down: its calls answer UNAVAILABLE at once and none is made")
	fs.DurationVar(&o.NodeCallPickup, "node-call-pickup", o.NodeCallPickup, "with --local-central: a call no node agent has taken within this long answers UNAVAILABLE (the call stays for the sidecar's retry)")
}

// Validate refuses what serve could only fail on later, or would silently
// misread. It checks the values alone, without touching the host; what needs
// the host (pool paths, the share key file) is checked where it is opened.
func (o *serveOptions) Validate() error {
	var errs []error
	if o.Endpoint == "" {
		errs = append(errs, errors.New("--endpoint is empty"))
	}
	if o.DriverName == "" {
		errs = append(errs, errors.New("--driver-name is empty"))
	} else if err := kubeletplugin.ValidateDriverName(o.DriverName); err != nil {
		// It names the registration socket, leases, metrics and events.
		errs = append(errs, fmt.Errorf("--driver-name: %w", err))
	}
	if _, err := driver.ParseMode(o.Mode); err != nil {
		errs = append(errs, fmt.Errorf("--mode: %w", err))
	}
	if o.MaxVolumes < 0 {
		errs = append(errs, fmt.Errorf("--max-volumes-per-node %d: want 0 (no limit) or more", o.MaxVolumes))
	}
	if o.MemoryLimitMiB < 0 {
		errs = append(errs, fmt.Errorf("--memory-limit-mib %d: want 0 (no limit) or more", o.MemoryLimitMiB))
	}
	if err := o.healthOptions().Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--pool-full-threshold / --volume-full-threshold: %w", err))
	}
	// A ticker runs every --mount-retry: it must be positive.
	if o.MountRetry <= 0 {
		errs = append(errs, fmt.Errorf("--mount-retry %s: want a positive duration", o.MountRetry))
	}
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{
		{"stats-health-ttl", o.StatsHealthTTL},
		{"pvc-events-interval", o.PVCEventsInterval},
		{"share-mount-timeout", o.ShareMountTimeout},
		{"ephemeral-sweep-interval", o.EphemeralSweep},
	} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("--%s %s: negative", d.flag, d.v))
		}
	}
	if err := o.Lease.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--lease-duration / --lease-renew-interval / --lease-margin: %w", err))
	}
	if err := o.Freeze.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--freeze-poll-interval / --freeze-max-hold / --freeze-ack-timeout: %w", err))
	}
	errs = append(errs, o.validateLocalAgent()...)
	errs = append(errs, o.validateLocalCentral()...)
	return errors.Join(errs...)
}

func (o *serveOptions) healthOptions() health.Options {
	return health.Options{PoolFullThreshold: o.PoolFullPercent / 100, VolumeFullThreshold: o.VolumeFullPercent / 100}
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

const serveSynopsis = `serve --endpoint unix:///path/csi.sock --node-id NODE --pool NAME=PATH[,shared] [flags]

Serves the CSI Identity, Controller and/or Node services on a unix socket.`

// serveFlags is the flag set serve parses: serve's own flags and, apart
// under their own heading in the usage, klog's. klog.InitFlags fills a
// separate set whose flags are then copied, so the usage can tell them apart.
func serveFlags(o *serveOptions, stderr io.Writer) *flag.FlagSet {
	own := flag.NewFlagSet("serve", flag.ContinueOnError)
	o.AddFlags(own)
	logging := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(logging)

	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	own.VisitAll(func(f *flag.Flag) { fs.Var(f.Value, f.Name, f.Usage) })
	logging.VisitAll(func(f *flag.Flag) { fs.Var(f.Value, f.Name, f.Usage) })
	fs.Usage = func() {
		w := fs.Output()
		own.SetOutput(w)
		logging.SetOutput(w)
		fmt.Fprintf(w, "Usage: poolcsi %s\n\nFlags:\n", serveSynopsis)
		own.PrintDefaults()
		fmt.Fprintln(w, "\nLogging flags (klog):")
		logging.PrintDefaults()
	}
	return fs
}

func serve(ctx context.Context, args []string, stderr io.Writer) error {
	o := newServeOptions()
	if err := parseFlags(serveFlags(o, stderr), args); err != nil {
		return err
	}
	if err := o.Validate(); err != nil {
		return err
	}
	setMemoryLimit(o.MemoryLimitMiB)
	err := o.run(ctx)
	logStop(ctx, klog.Background(), err)
	return err
}

// logStop says in one line why serve stopped: the error it stopped on, or
// what ended ctx (signal.NotifyContext's cause names the signal).
func logStop(ctx context.Context, logger klog.Logger, err error) {
	switch {
	case err != nil:
		logger.Error(err, "poolcsi serve stopped")
	case context.Cause(ctx) != nil:
		logger.Info("poolcsi serve stopped", "cause", context.Cause(ctx).Error())
	default:
		logger.Info("poolcsi serve stopped", "cause", "the CSI server ended")
	}
}

// run starts the driver o describes and serves until ctx ends.
func (o *serveOptions) run(ctx context.Context) error {
	if o.LocalCentral {
		return o.runCentral(ctx)
	}
	mode, err := driver.ParseMode(o.Mode)
	if err != nil {
		return err
	}
	nodeID := o.NodeID
	if nodeID == "" {
		if nodeID, err = os.Hostname(); err != nil {
			return fmt.Errorf("--node-id not given and no host name: %w", err)
		}
	}
	// Only a node plugin keeps node-local records; a controller's pod has
	// no directory of the node's for them. Opened first: a pool that hangs
	// hangs openPools, and the node must still fence from its records.
	if err := o.checkStateDir(mode); err != nil {
		return err
	}
	state := nodestate.Memory()
	var guard *fence.StartupFence
	if mode != driver.ModeController && o.StateDir != "" {
		if state, err = nodestate.Open(o.StateDir, nodeID); err != nil {
			return fmt.Errorf("--state-dir: %w", err)
		}
		guard = fence.NewStartupFence(ctx, state, o.Lease)
	}
	err = o.start(ctx, mode, nodeID, state, guard)
	if err != nil {
		// Whatever failed (a config it cannot read, a pool mount stanza it
		// refuses, the socket), the process exits without its lease keeper:
		// nothing renews this node's leases, and its start-up fence must
		// have fenced before it goes, not be dropped with it.
		guard.Abandon(ctx, err)
	}
	guard.Started()
	return err
}

// start is run's part after the node's records are open and the start-up
// fence guards the start: it opens the pools and serves until ctx ends.
func (o *serveOptions) start(ctx context.Context, mode driver.Mode, nodeID string, state *nodestate.Store, guard *fence.StartupFence) error {
	opened, readiness, mounts, err := o.openPools(ctx, nodeID, state)
	if err != nil {
		return err
	}
	shares, types, err := shareMounter(o.ShareDir, o.ShareTypes, o.ShareMountTimeout)
	if err != nil {
		return err
	}
	shareKeys, err := readShareKeys(o.ShareKeyFile)
	if err != nil {
		return err
	}
	d, err := driver.New(driver.Options{
		Name:              o.DriverName,
		Version:           buildVersion(),
		PathPrefix:        o.PathPrefix,
		StatsHealthTTL:    o.StatsHealthTTL,
		NodeID:            nodeID,
		Mode:              mode,
		Pools:             opened,
		MaxVolumesPerNode: o.MaxVolumes,
		ExpandOnNode:      o.ExpandOnNode,
		Health:            o.healthOptions(),
		Readiness:         readiness,
		Shares:            shares,
		ShareTypes:        types,
		ShareKeys:         shareKeys,
		Lease:             o.Lease,
		Freeze:            o.Freeze,
		State:             state,
		StartupFence:      guard,
		CgroupRoot:        o.CgroupRoot,
		IOLimitsInterval:  o.IOLimitsInterval,
		EphemeralPool:     o.EphemeralPool,
		// 0 on the command line is "at start only", which the driver spells
		// negative (its zero is the default).
		EphemeralSweepInterval: sweepInterval(o.EphemeralSweep),
	})
	if err != nil {
		return err
	}
	answered(ctx, d, opened)
	interceptors, sidecars, err := o.sidecars(d, mode, nodeID, opened)
	if err != nil {
		return err
	}
	// The local agent (off unless --local-agent) replays calls on this
	// process's own socket: it starts once the socket answers and stops with
	// ctx, and is awaited after the server, longer than the loops beside it,
	// for the answers of the calls it ran.
	agentCtx, stopAgent := context.WithCancel(ctx)
	defer stopAgent()
	agentStopped, err := o.startLocalAgent(agentCtx, d, nodeID, opened)
	if err != nil {
		return err
	}
	server := runner.Func(func(ctx context.Context) error { return d.Serve(ctx, o.Endpoint, interceptors...) })
	err = runLoops(ctx, server, append(mounts, sidecars...), sidecarGrace)
	stopAgent()
	select {
	case <-agentStopped:
	case <-time.After(agentWaitLimit):
		klog.Background().Info("The local agent did not stop in time; exiting without it", "limit", agentWaitLimit)
	}
	return err
}

// sidecarGrace bounds how long serve waits, once the CSI server has
// stopped, for the loops beside it (the kubelet registration removes its
// socket on the way out, which a process that exited first would leave
// behind; a leader election releases its lease).
const sidecarGrace = 5 * time.Second

// runLoops is every long-running loop of serve, in one place, and the order
// they stop in:
//
//  1. the loops beside the CSI server (the retries of the pools' mounts,
//     metrics, claim events, snapshot claims, /healthz, the kubelet
//     registration) start first and stop when ctx ends, or when the server
//     has returned: one that fails stops nothing else;
//  2. the CSI server (Driver.Serve) stops when ctx ends: it lets the calls
//     under way finish, then stops the loops of its own life, and only then
//     its lease keeper and freeze agent (they must outlive every call that
//     may stage or freeze a volume), then removes its socket;
//  3. runLoops returns what the server returned, once the loops beside it
//     have returned too, or after grace.
func runLoops(ctx context.Context, server runner.Runner, beside []runner.Runner, grace time.Duration) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopBeside := runner.Start(ctx, beside...)
	err := server.Run(ctx)
	cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- stopBeside() }()
	select {
	case serr := <-stopped:
		if serr != nil {
			klog.ErrorS(serr, "A loop beside the CSI server failed")
		}
	case <-time.After(grace):
		klog.Background().Info("The loops beside the CSI server did not stop in time; exiting without them", "grace", grace)
	}
	return err
}

// checkStateDir refuses a node plugin without --state-dir that has shared
// pools or takes volumes on shares: its records of what it staged there would
// be in memory only, so after a restart its self-fence would find none of its
// devices while another node takes the volumes.
func (o *serveOptions) checkStateDir(mode driver.Mode) error {
	if mode == driver.ModeController || o.StateDir != "" {
		return nil
	}
	const why = "a node plugin keeps its records of what it staged there (which its self-fence fences when it loses its lease) in --state-dir; empty, they live in memory only and a restarted plugin would fence nothing. Give --state-dir a directory on the node's own disk, kept across restarts (docs/fencing.md)"
	if o.ShareDir != "" {
		return fmt.Errorf("--state-dir is empty but --share-dir is set (volumes on shares): %s", why)
	}
	var file config.File
	if o.ConfigFile != "" {
		var err error
		if file, err = config.Load(o.ConfigFile); err != nil {
			return err
		}
	}
	var shared []string
	for _, c := range config.Pools(file, o.Pools) {
		if c.Shared {
			shared = append(shared, c.Name)
		}
	}
	if len(shared) > 0 {
		return fmt.Errorf("--state-dir is empty but pool(s) %s are shared: %s", strings.Join(shared, ", "), why)
	}
	return nil
}

// openPools opens the configured pools, mounting those with a mount stanza
// first; the readiness checks are those of the mounts, and the runners
// retry the mounts that fail.
//
// The pools are opened side by side, and each one's mount and open together
// get one open wait (poolOpenWait): the start-up fence fences every pool of
// this node at half the lease margin unless the lease keeper runs by then,
// so a start must not wait for its hung pools one after another (three hung
// pools took three waits, past the fence, which then fenced the volumes of
// the healthy pools under their pods), nor for a mount that hangs up to its
// stanza's timeout (30 s by default, the whole margin). A mount still under
// way goes on in the background and its pool is opened unmounted: a pool
// with a mount stanza must be a mount point, so it is unavailable, never laid
// out on the disk below, until the mount lands.
func (o *serveOptions) openPools(ctx context.Context, nodeID string, state *nodestate.Store) ([]*pool.Pool, []func() error, []runner.Runner, error) {
	// A shared pool is not laid out while this node's records hold loop
	// devices attached from its images: a path without its pool.json is
	// then the pool gone from the path (covered, unmounted), not a new one
	// (fence.LayoutGuard), after a restart as well.
	records := &layout.Deps{State: state, Loops: new(mount.Loops)}
	var file config.File
	if o.ConfigFile != "" {
		var err error
		if file, err = config.Load(o.ConfigFile); err != nil {
			return nil, nil, nil, err
		}
	}
	mounts := config.Mounts(file, o.Pools)
	cfgs := config.Pools(file, o.Pools)
	// Refused stanzas fail the start before anything is mounted.
	mounters := make([]*poolmount.Mounter, len(cfgs))
	for i, c := range cfgs {
		if spec, ok := mounts[c.Name]; ok {
			m, err := poolmount.New(c.Name, c.Path, spec)
			if err != nil {
				return nil, nil, nil, err
			}
			mounters[i] = m
		}
	}
	wait := o.poolOpenWait()
	opened := make([]*pool.Pool, len(cfgs))
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for i, c := range cfgs {
		wg.Go(func() {
			deadline := time.Now().Add(wait)
			if m := mounters[i]; m != nil {
				ensured := make(chan error, 1)
				// Ensure ends at the stanza's timeout at the latest; the
				// mount's retries (Keep) wait for it.
				go func() { ensured <- m.Ensure(ctx) }()
				select {
				case err := <-ensured:
					// A pool that cannot be mounted is reported by Probe,
					// not fatal: the other pools keep serving and the
					// mount is retried.
					if err != nil {
						klog.ErrorS(err, "Pool not mounted at start-up; retrying in the background", "pool", c.Name)
					}
				case <-time.After(wait):
					klog.ErrorS(nil, "Pool's mount still under way after the start's wait; serving the other pools, and this one once it is mounted", "pool", c.Name, "waited", wait.String())
				}
			}
			// Only a configuration that can never work fails the start. A
			// pool whose filesystem is dead, missing, unreadable or hangs is
			// served unavailable (Probe, health, metrics and poolcsi status
			// say why) and used once it answers: the other pools keep
			// serving, and the process never dies on a lost pool
			// (docs/fencing.md).
			opts := []pool.Option{pool.WithNode(nodeID), pool.WithOpenWait(max(time.Until(deadline), minPoolOpenWait))}
			if c.Shared && state != nil {
				opts = append(opts, pool.WithLayoutGuard(fence.LayoutGuard(records, c.Name)))
			}
			p, err := pool.Open(c, opts...)
			if err != nil {
				errs[i] = err
				return
			}
			switch {
			case p.OpenPending():
				klog.ErrorS(p.OpenError(), "Pool unavailable at start-up: its filesystem does not answer; serving the other pools, and this one once it answers", "pool", c.Name)
			case p.OpenError() != nil:
				klog.ErrorS(p.OpenError(), "Pool unavailable at start-up; serving the other pools, and this one once it is repaired", "pool", c.Name)
			}
			opened[i] = p
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, nil, nil, err
	}
	var readiness []func() error
	var keep []runner.Runner
	for _, m := range mounters {
		if m != nil {
			keep = append(keep, m.Keep(o.MountRetry))
			readiness = append(readiness, m.Ready)
		}
	}
	return opened, readiness, keep, nil
}

// answered watches the pools whose filesystem did not answer within the
// start's wait: once one answers, it says so and runs Probe's pool checks,
// which register this node with the pool (the start's registration skipped
// it), instead of leaving that to the next probe.
func answered(ctx context.Context, d *driver.Driver, opened []*pool.Pool) {
	start := time.Now()
	for _, p := range opened {
		if !p.OpenPending() {
			continue
		}
		go func() {
			select {
			case <-p.Opened():
			case <-ctx.Done():
				return
			}
			klog.InfoS("Pool answered after the start's wait", "pool", p.Name(), "after", time.Since(start).Round(time.Millisecond).String(), "err", fmt.Sprint(p.OpenError()))
			// Twice: the first may join a round of checks that began
			// before the pool answered (and skipped it); the second
			// starts one after it.
			for range 2 {
				pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				_, err := d.Probe(pctx, &csi.ProbeRequest{})
				cancel()
				if err != nil {
					klog.ErrorS(err, "Probe after a pool answered", "pool", p.Name())
				}
			}
		}()
	}
}

// poolOpenWait is how long the start waits for one pool's filesystem: a
// pool that hangs longer is served unavailable. It is well inside half the
// lease margin, when a start that has not reached its lease keeper fences.
func (o *serveOptions) poolOpenWait() time.Duration {
	return max(min(o.Lease.Margin/4, 5*time.Second), minPoolOpenWait)
}

// minPoolOpenWait is the least wait a pool's open gets at start, even when
// its mount took the rest of the start's wait.
const minPoolOpenWait = 100 * time.Millisecond

// sidecars makes what serve runs beside the CSI server, each only when its
// flag asks: metrics (whose interceptor it returns), claim events, snapshot
// claims, /healthz and the kubelet registration. It opens their listeners
// and clients, so a bad address fails the start; runLoops runs them.
func (o *serveOptions) sidecars(d *driver.Driver, mode driver.Mode, nodeID string, opened []*pool.Pool) (interceptors []grpc.UnaryServerInterceptor, runners []runner.Runner, err error) {
	if o.MetricsAddr != "" {
		mx := metrics.New(o.DriverName, nodeID, opened, o.healthOptions())
		if mode == driver.ModeNode || mode == driver.ModeAll {
			mx.WatchLeases(func() []metrics.LeaseState { return leaseStates(d) })
		}
		if mode == driver.ModeController || mode == driver.ModeAll {
			mx.WatchPeerLeases(func() []metrics.PeerLeaseState { return peerLeaseStates(d) })
		}
		r, err := listenHTTP("metrics", o.MetricsAddr, "/metrics", mx.Handler(), 5*time.Second)
		if err != nil {
			return nil, nil, err
		}
		runners = append(runners, r)
		interceptors = append(interceptors, mx.Interceptor)
	}
	if o.PVCEventsInterval > 0 {
		r, err := pvcEvents(d, o.DriverName, o.Kubeconfig, o.LeaseNamespace, o.PVCEventsInterval)
		if err != nil {
			return nil, nil, err
		}
		runners = append(runners, r)
	}
	if o.ClaimSnapshots {
		r, err := snapshotClaims(d, o.DriverName, nodeID, o.Kubeconfig)
		if err != nil {
			return nil, nil, err
		}
		runners = append(runners, r)
	}
	if o.HealthzAddr != "" {
		r, err := listenHTTP("healthz", o.HealthzAddr, "/healthz", kubeletplugin.Healthz(d, 3*time.Second), 2*time.Second)
		if err != nil {
			return nil, nil, err
		}
		runners = append(runners, r)
	}
	if o.RegistrationDir != "" {
		csiPath := o.KubeletEndpoint
		if csiPath == "" {
			csiPath = strings.TrimPrefix(o.Endpoint, "unix://")
		}
		r := &kubeletplugin.Registrar{DriverName: o.DriverName, Endpoint: csiPath, Dir: o.RegistrationDir}
		runners = append(runners, runner.Func(func(ctx context.Context) error {
			if err := r.Run(ctx, probeEndpoint(o.Endpoint)); err != nil {
				klog.ErrorS(err, "Kubelet plugin registration stopped; kubelet will not use this node plugin until it restarts")
			}
			return nil
		}))
	}
	return interceptors, runners, nil
}

// sweepInterval turns --ephemeral-sweep-interval into the driver's option.
func sweepInterval(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
