// Package driver implements the CSI Identity, Controller and Node services of
// poolcsi: request validation, gRPC error codes, per-volume locking and
// idempotency. The on-disk format lives in internal/pool, devices and mounts in
// internal/mount.
package driver

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/ephemeral"
	"github.com/poolcsi/poolcsi/internal/fence"
	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/iolimits"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/nodestate"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
	"github.com/poolcsi/poolcsi/internal/rpc"
	"github.com/poolcsi/poolcsi/internal/runner"
	"github.com/poolcsi/poolcsi/internal/unixsock"
)

// TopologyKey is the topology segment that pins local-pool volumes to their node.
const TopologyKey = poolset.TopologyKey

// Mode selects which CSI services a process serves.
type Mode string

const (
	ModeController Mode = "controller"
	ModeNode       Mode = "node"
	ModeAll        Mode = "all"
)

// ParseMode accepts controller, node or all.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeController, ModeNode, ModeAll:
		return m, nil
	}
	return "", fmt.Errorf("mode %q: want controller, node or all", s)
}

func (m Mode) controller() bool { return m == ModeController || m == ModeAll }
func (m Mode) node() bool       { return m == ModeNode || m == ModeAll }

// FreezeTiming is the schedule of freezes across nodes (freeze.Timing).
type FreezeTiming = freeze.Timing

// DefaultFreezeTiming is the schedule when none is given.
var DefaultFreezeTiming = freeze.DefaultTiming

// Options configure a Driver.
type Options struct {
	Name    string // CSI driver name, e.g. poolcsi.io
	Version string
	NodeID  string
	Mode    Mode
	Pools   []*pool.Pool
	// MaxVolumesPerNode is reported by NodeGetInfo; 0 means no limit. A loop
	// device per volume is the real bound on a node.
	MaxVolumesPerNode int64
	// ExpandOnNode moves image growth of local pools into NodeExpandVolume and
	// stops advertising controller EXPAND_VOLUME, for deployments whose single
	// resizer cannot reach every node's local pool (see docs/deploy.md).
	ExpandOnNode bool
	// Health holds the thresholds of the volume health checks; zero values
	// take health.DefaultOptions.
	Health health.Options
	// StatsHealthTTL is how long NodeGetVolumeStats reuses a volume's
	// node-side health (0: never). The checks read the whole mount table and
	// sysfs, a few hundred microseconds, twenty times the rest of the call;
	// kubelet asks once a minute and always gets a fresh answer with a few
	// seconds, while a burst of callers does not pay for the checks each time.
	// NodeGetVolumeHealth never reuses one.
	StatsHealthTTL time.Duration
	// PathPrefix, if set, is the only directory staging and target paths may
	// be under (kubelet's root directory). Below it, and below / when unset, no
	// component of such a path may be a symbolic link.
	PathPrefix string
	// Host is how the driver reaches the node's kernel; the zero value is
	// the real one.
	Host layout.Host
	// Readiness are extra checks whose faults Probe logs, such as the pool mounts of the config's
	// mount stanzas; each returns why the driver is not ready, or nil.
	Readiness []func() error
	// Shares mounts the shares StorageClasses name (internal/poolmount; a
	// fake in unit tests); nil: StorageClasses cannot name shares.
	Shares ShareMounter
	// ShareTypes are the share types StorageClasses and volume IDs may name
	// (--share-types); with Shares set, nil means DefaultShareTypes.
	ShareTypes []string
	// ShareKeys are the cluster's share keys (--share-key-file): the first
	// tags the IDs of volumes on shares, any verifies a tag. Without one,
	// StorageClasses cannot name shares.
	ShareKeys [][]byte
	// Lease is the schedule of node leases in shared pools; the zero value
	// takes lease.Default (docs/fencing.md).
	Lease lease.Timing
	// Freeze is the schedule of freezes across nodes for snapshots; the
	// zero value takes DefaultFreezeTiming (docs/snapshots.md).
	Freeze FreezeTiming
	// CgroupRoot is where the node finds pods' cgroups for volumes' I/O
	// limits ("": /sys/fs/cgroup).
	CgroupRoot string
	// IOLimitsInterval is how often the node re-applies the I/O limits of
	// the volumes published here (0: DefaultIOLimitsInterval).
	IOLimitsInterval time.Duration
	// EphemeralPool is the pool of inline volumes whose attributes name
	// none; "" takes the first local pool that allows them (docs/ephemeral.md).
	EphemeralPool string
	// EphemeralSweepInterval is how often a node plugin removes the inline
	// volumes no unpublish removed, besides once at start; 0 takes
	// DefaultEphemeralSweep, a negative value sweeps at start only.
	EphemeralSweepInterval time.Duration
	// State is this node plugin's own record store, outside every pool
	// (--state-dir, internal/nodestate): what it staged and froze, which it
	// must know when a pool stops answering or after a restart. nil keeps
	// the records in memory (unit tests).
	State *nodestate.Store
	// StartupFence, if set, is the guard over this process's start: its
	// lease keeper stops it, and counts from its start (lease.go).
	StartupFence *fence.StartupFence
	// StartWait bounds how long Serve waits for the pools' start-up passes
	// before the server answers (start.go); 0: a quarter of the lease
	// margin, at most 5 s. A pool whose passes have not run by then answers
	// UNAVAILABLE, after each call waited at most the lease margin, until
	// they have.
	StartWait time.Duration
}

// Driver serves the CSI services over one pool set: a server type per
// service (identity.go; the controller's and the group controller's
// handlers; the node's), each over the one core they share, embedded so the
// Driver answers every service.
type Driver struct {
	*core
	identityServer
	controllerServer
	nodeServer
}

// identityServer is the Identity service.
type identityServer struct {
	csi.UnimplementedIdentityServer
	*core
}

// controllerServer is the Controller and GroupController services.
type controllerServer struct {
	csi.UnimplementedControllerServer
	csi.UnimplementedGroupControllerServer
	*core
}

// nodeServer is the Node service.
type nodeServer struct {
	csi.UnimplementedNodeServer
	*core
}

// core is what the services share: the options, the pools, the per-volume
// locks, the node's kernel (layout.Deps) and the packages that do the
// driver's other jobs (leases, freezes, I/O limits).
type core struct {
	opts Options
	// pools are the operator's pools and the shares' (internal/poolset).
	pools *poolset.Set
	locks *volumeLocks
	layout.Deps
	// registered holds the pools this node has registered with (see registerNode).
	registered sync.Map
	// poolState holds each pool's last seen fault ("" when usable), so Probe
	// logs changes once (see notePools).
	poolState sync.Map
	// probing is closed when the pool checks Probe started last are done
	// (see Probe); probeMu guards it.
	probeMu sync.Mutex
	probing chan struct{}
	// poolChecks are NodeGetStorageHealth's pool checks under way (health.go).
	poolChecks poolChecks
	// conditions caches the node-side health NodeGetVolumeStats reports,
	// for Options.StatsHealthTTL (see statsCondition).
	conditions conditionCache
	// leases are this node's leases in shared pools and the controller's
	// view of other nodes' (lease.go).
	leases *fence.Keeper
	// freezes: freezes across nodes (internal/freeze). quiesceCopy is the
	// quiesce of a snapshot's copy; tests wrap it to look at the copy
	// between freeze and thaw.
	freezes     *freeze.Freezer
	quiesceCopy func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (thaw func() error, err error)
	// fill copies a group snapshot's member, its source already frozen
	// (group.go); a field so the tests see each copy's moment.
	fill func(ctx context.Context, p *pool.Pool, s *pool.Snapshot, v *pool.Volume) error
	// throttle holds pods to their volumes' I/O limits (internal/iolimits).
	throttle *iolimits.Throttle
	// ephemeralPool is where inline volumes go whose attributes name no
	// pool; nil when no pool takes them by default.
	ephemeralPool *pool.Pool
	// inline are this node's ephemeral inline volumes (internal/ephemeral).
	inline *ephemeral.Volumes
	// starting is the start-up passes of Serve's start (start.go), nil
	// before it.
	starting atomic.Pointer[startup]
	// beforePasses, if set, runs first in each pool's start-up passes:
	// tests hold a pool there as a filesystem that hangs would.
	beforePasses func(ctx context.Context, p *pool.Pool)
}

// CSI ephemeral inline volumes (docs/ephemeral.md) are internal/ephemeral's.
const (
	// AttrSize is an inline volume's size attribute.
	AttrSize = ephemeral.AttrSize
	// DefaultEphemeralSize is an inline volume's size when its attributes
	// name none.
	DefaultEphemeralSize = ephemeral.DefaultSize
	// DefaultEphemeralSweep is how often the node looks for inline volumes
	// no unpublish removed (Options.EphemeralSweepInterval).
	DefaultEphemeralSweep = ephemeral.DefaultSweep
	// ctxEphemeral marks an inline volume's NodePublishVolume.
	ctxEphemeral = ephemeral.ContextKey
)

// defaultEphemeralPool is the pool of inline volumes whose attributes name
// none (ephemeral.DefaultPool).
func defaultEphemeralPool(opts Options) (*pool.Pool, error) {
	return ephemeral.DefaultPool(opts.Pools, opts.EphemeralPool)
}

// New checks opts and prepares the node-side state (the loop device map).
func New(opts Options) (*Driver, error) {
	if opts.Name == "" {
		return nil, errors.New("driver name is empty")
	}
	if opts.NodeID == "" {
		return nil, errors.New("node ID is empty")
	}
	if len(opts.Pools) == 0 && opts.Shares == nil {
		return nil, errors.New("no pools configured")
	}
	if opts.PathPrefix != "" && (!filepath.IsAbs(opts.PathPrefix) || filepath.Clean(opts.PathPrefix) != opts.PathPrefix) {
		return nil, fmt.Errorf("allowed path prefix %q must be a clean absolute path", opts.PathPrefix)
	}
	if opts.Health.PoolFullThreshold == 0 {
		opts.Health.PoolFullThreshold = health.DefaultOptions.PoolFullThreshold
	}
	if opts.Health.VolumeFullThreshold == 0 {
		opts.Health.VolumeFullThreshold = health.DefaultOptions.VolumeFullThreshold
	}
	if err := opts.Health.Validate(); err != nil {
		return nil, err
	}
	if opts.Lease == (lease.Timing{}) {
		opts.Lease = lease.Default
	}
	if err := opts.Lease.Validate(); err != nil {
		return nil, err
	}
	if opts.Freeze == (FreezeTiming{}) {
		opts.Freeze = DefaultFreezeTiming
	}
	if err := opts.Freeze.Validate(); err != nil {
		return nil, err
	}
	if opts.State == nil {
		opts.State = nodestate.Memory()
	}
	if opts.CgroupRoot == "" {
		opts.CgroupRoot = "/sys/fs/cgroup"
	}
	if opts.IOLimitsInterval == 0 {
		opts.IOLimitsInterval = DefaultIOLimitsInterval
	}
	if opts.IOLimitsInterval < 0 {
		return nil, fmt.Errorf("I/O limits interval %s must be positive", opts.IOLimitsInterval)
	}
	host, err := opts.Host.WithDefaults(opts.PathPrefix, opts.CgroupRoot)
	if err != nil {
		return nil, fmt.Errorf("read loop devices: %w", err)
	}
	d := &core{
		opts:  opts,
		locks: newVolumeLocks(),
		Deps: layout.Deps{Mounts: host.Mounts, Loops: host.Loops, Devs: host.Devices, FS: host.FS,
			NodeID: opts.NodeID, ExpandOnNode: opts.ExpandOnNode, PathPrefix: opts.PathPrefix, State: opts.State},
	}
	d.quiesceCopy = func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (func() error, error) {
		return d.freezes.Quiesce(ctx, p, vid, v)
	}
	// A clone freezes its source as a snapshot does; read late, so a test's
	// wrapper of quiesceCopy sees clones too.
	d.Freeze = func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (func() error, error) {
		return d.quiesceCopy(ctx, p, vid, v)
	}
	d.fill = func(ctx context.Context, p *pool.Pool, s *pool.Snapshot, v *pool.Volume) error {
		return p.Snapshots().Fill(ctx, s, v, nil)
	}
	if d.pools, err = poolset.New(poolset.Deps{NodeID: opts.NodeID, Shares: opts.Shares, ShareTypes: opts.ShareTypes,
		ShareKeys: opts.ShareKeys, Joined: d.registerNode, Recovered: d.recovered,
		// As long as a call on a pool whose open was pending waited before:
		// a slow pool serves, a hung one answers UNAVAILABLE within the margin.
		HeldWait: opts.Lease.Margin,
		// A share's pool is not laid out while this node's records hold
		// loop devices of its images (fence.LayoutGuard).
		LayoutGuard: func(name string) func() error { return fence.LayoutGuard(&d.Deps, name) }}, opts.Pools); err != nil {
		return nil, err
	}
	// The same guard over the configured shared pools, through this
	// driver's kernel (the start opened them with one through the real one).
	for _, p := range opts.Pools {
		if p.Shared() {
			p.SetLayoutGuard(fence.LayoutGuard(&d.Deps, p.Name()))
		}
	}
	d.throttle = iolimits.New(iolimits.Deps{Cgroups: host.Cgroups, Node: &d.Deps, Names: d.pools.Names, Pool: d.pools.Pool, Interval: opts.IOLimitsInterval})
	d.leases = fence.NewKeeper(fence.Deps{NodeID: opts.NodeID, Timing: opts.Lease, Names: d.pools.Names, Pool: d.pools.Pool,
		Node: &d.Deps, Lock: d.lockFor, Startup: opts.StartupFence})
	d.LeaseLost = d.leases.Lost
	d.freezes = newFreezes(d)
	if d.ephemeralPool, err = defaultEphemeralPool(opts); err != nil {
		return nil, err
	}
	if d.opts.EphemeralSweepInterval == 0 {
		d.opts.EphemeralSweepInterval = DefaultEphemeralSweep
	}
	d.inline = ephemeral.New(ephemeral.Deps{NodeID: opts.NodeID, Node: &d.Deps, Configured: d.pools.Configured, Pool: d.pools.Pool,
		Topology: d.pools.Topology, Default: d.ephemeralPool, Lock: d.lockFor,
		EnsureLease: func(ctx context.Context, p *pool.Pool) error { return d.leases.EnsureLease(ctx, p) },
		Forget:      d.conditions.forget})
	return &Driver{core: d, identityServer: identityServer{core: d}, controllerServer: controllerServer{core: d}, nodeServer: nodeServer{core: d}}, nil
}

// Serve listens on endpoint (unix:///path/to.sock) and serves until ctx ends.
func (d *Driver) Serve(ctx context.Context, endpoint string, extra ...grpc.UnaryServerInterceptor) error {
	lis, err := Listen(endpoint)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(rpc.Interceptors(extra...)...))
	csi.RegisterIdentityServer(srv, d)
	if d.opts.Mode.controller() {
		csi.RegisterControllerServer(srv, d)
		csi.RegisterGroupControllerServer(srv, d)
	}
	if d.opts.Mode.node() {
		csi.RegisterNodeServer(srv, d)
	}
	if d.opts.Mode.controller() && d.opts.Mode.node() {
		// A group across nodes' holds need this node's mounts (grouphold.go).
		srv.RegisterService(&groupHoldDesc, d.controllerServer)
	}
	// The socket goes last: every loop has returned before it is removed.
	defer func() {
		if err := lis.Remove(); err != nil {
			klog.ErrorS(err, "Not removing the CSI socket")
		}
	}()
	// The server and the loops of its life stop with ctx; the freeze agent
	// only once all of them have returned (a call under way at the stop may
	// still freeze a volume; it thaws what it holds as it stops), and the
	// lease keeper last (a call under way may still stage a volume). A
	// server that fails ends ctx for the rest; what a loop returned is
	// logged, what the server returned is Serve's.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	server := &rpc.Serving{Server: srv, Listener: lis, Endpoint: endpoint, Stop: cancel, Started: func() {
		klog.InfoS("Serving CSI", "endpoint", endpoint, "driver", d.opts.Name, "version", d.opts.Version,
			"mode", d.opts.Mode, "node", d.opts.NodeID, "pools", d.pools.Names(), "shareTypes", d.pools.ShareTypes())
	}}
	withServer, afterServer, keeper := d.runners()
	// The lease keeper starts before the start-up passes below, which look
	// at every pool and wait for one that hangs (each look at a pool whose
	// filesystem has not answered since the start waits the open's wait
	// again): behind them, a node with a few hung pools renewed no lease for
	// tens of seconds, and its start-up fence fenced the volumes of its
	// healthy pools under their pods. The keeper renews the pools that answer
	// whatever the others do, and a share's pool the passes recover counts
	// from when it is added.
	serve := runner.Func(func(ctx context.Context) error {
		d.startPasses(ctx)
		if ctx.Err() != nil {
			return nil
		}
		return runner.Stages(ctx, append(withServer, server), afterServer)
	})
	if err := runner.Stages(ctx, []runner.Runner{serve}, keeper); err != nil {
		klog.ErrorS(err, "A loop of the driver failed")
	}
	return server.Err()
}

// runners are the driver's long-running loops: those that stop with the
// server's context, those that stop only after the server has stopped, and
// the lease keeper, which stops after all of them.
func (d *Driver) runners() (withServer, afterServer, keeper []runner.Runner) {
	if d.opts.Mode.controller() && d.leases != nil {
		// What the lease cannot cover, made visible (internal/fence, peers.go).
		withServer = append(withServer, runner.Every{Interval: d.opts.Lease.Interval, F: d.leases.WatchPeers})
	}
	if d.opts.Mode.controller() {
		// Stops after the server: no delete queues for it once it is gone.
		afterServer = append(afterServer, trashEmptier{pools: d.servedPools})
	}
	if d.opts.Mode.node() {
		withServer = append(withServer, d.throttle,
			runner.Every{Interval: d.opts.EphemeralSweepInterval, AtStart: true, F: func(ctx context.Context) { d.inline.Sweep(ctx) }})
		afterServer = append(afterServer, d.freezes)
		keeper = append(keeper, d.leases)
	}
	return withServer, afterServer, keeper
}

// servedPools is every pool the driver serves now, configured or a share's.
func (d *Driver) servedPools() []*pool.Pool {
	var ps []*pool.Pool
	for _, name := range d.pools.Names() {
		if p := d.pools.Pool(name); p != nil {
			ps = append(ps, p)
		}
	}
	return ps
}

// Listen opens a unix socket endpoint, replacing a stale socket file left by a
// previous run (kubelet restarts plugins; the old socket would block the bind)
// but never a socket another process serves or anything that is not a socket.
func Listen(endpoint string) (*unixsock.Socket, error) {
	u, err := url.Parse(endpoint)
	if err != nil || u.Scheme != "unix" {
		return nil, fmt.Errorf("endpoint %q: want unix:///path/to/csi.sock", endpoint)
	}
	path := u.Path
	if path == "" {
		path = u.Opaque
	}
	if !filepath.IsAbs(path) {
		return nil, fmt.Errorf("endpoint %q: socket path must be absolute", endpoint)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	lis, err := unixsock.Listen(path)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	return lis, nil
}

// newFreezes is the driver's freezes, holding nothing: what a process
// starts with.
func newFreezes(d *core) *freeze.Freezer {
	// The freeze agent answers no request in a pool held for its start-up
	// passes (start.go): its crash thaw has not run yet.
	return freeze.New(freeze.Deps{NodeID: d.opts.NodeID, Node: &d.Deps, Names: d.pools.Served, Pool: d.pools.Pool, Lock: d.lockFor,
		Verdict: func(p *pool.Pool, node string, staged bool) (lease.Verdict, error) {
			return d.leases.Verdict(p, node, staged)
		},
		NodePlugin: d.opts.Mode.node()}, d.opts.Freeze)
}

// isLocal reports whether volumes of p live on this node only.
func isLocal(p *pool.Pool) bool { return !p.Shared() }

// layoutOf returns the implementation of l; an unknown layout (a volume.json
// written by a newer driver) is treated as an image, whose checks refuse
// anything they do not recognise.
func (d *core) layoutOf(l pool.Layout) layout.Layout {
	return layout.Of(&d.Deps, l)
}
