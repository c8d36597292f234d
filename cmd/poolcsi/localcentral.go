package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/central"
	"github.com/poolcsi/poolcsi/internal/config"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/kubeletplugin"
	"github.com/poolcsi/poolcsi/internal/metrics"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/poolset"
	"github.com/poolcsi/poolcsi/internal/rpc"
	"github.com/poolcsi/poolcsi/internal/runner"
)

// The local driver's central controller (--local-central, docs/design/central-controller.md
// §1, §9): Identity, Controller and GroupController of the local driver, served on
// --endpoint beside the released provisioner, resizer and snapshotter, every call about a
// node's pool carried to that node's agent through PoolCalls. No pool is opened here and
// no node work is done: the only thing read of the pools is their names, from the same
// config the nodes read, for the parsers.
//
// No leader election of its own: the sidecars elect, and only the leader's sidecars call;
// what runs in every replica regardless (the sweeper, the capacity migration) deletes
// only with preconditions, so two replicas doing it race harmlessly.

// validateLocalCentral checks the central flags, and what --local-central excludes.
func (o *serveOptions) validateLocalCentral() []error {
	var errs []error
	if o.NodeStaleAfter <= 0 {
		errs = append(errs, fmt.Errorf("--node-stale-after %s: want a positive duration", o.NodeStaleAfter))
	}
	if o.NodeCallPickup <= 0 {
		errs = append(errs, fmt.Errorf("--node-call-pickup %s: want a positive duration", o.NodeCallPickup))
	}
	if !o.LocalCentral {
		return errs
	}
	if o.Mode != string(driver.ModeController) {
		errs = append(errs, fmt.Errorf("--local-central needs --mode=controller (it serves the local driver's controller; the nodes serve theirs), not %q", o.Mode))
	}
	// Each of these is node work, or needs the pools the central controller never opens.
	for _, c := range []struct {
		set  bool
		flag string
	}{
		{o.LocalAgent, "--local-agent (the node's side of the channel)"},
		{o.RegistrationDir != "", "--registration-dir (the node plugins register with kubelet)"},
		{o.ClaimSnapshots, "--claim-local-snapshots (the central snapshotter serves every content)"},
		{o.PVCEventsInterval > 0, "--pvc-events-interval (volume health is the nodes')"},
		{o.ShareKeyFile != "", "--share-key-file (the local driver takes no shares)"},
	} {
		if c.set {
			errs = append(errs, fmt.Errorf("--local-central excludes %s", c.flag))
		}
	}
	return errs
}

// centralPools is the names of the local pools the config and --pool give, sorted:
// what params.Config needs to check a class's pool. A shared pool there is refused:
// the local driver's config names local pools only.
func (o *serveOptions) centralPools() ([]string, error) {
	var file config.File
	if o.ConfigFile != "" {
		var err error
		if file, err = config.Load(o.ConfigFile); err != nil {
			return nil, err
		}
	}
	var names, shared []string
	for _, c := range config.Pools(file, o.Pools) {
		if c.Shared {
			shared = append(shared, c.Name)
			continue
		}
		names = append(names, c.Name)
	}
	if len(shared) > 0 {
		return nil, fmt.Errorf("--local-central serves local pools only; pool(s) %s are shared (they are the shared driver's)", strings.Join(shared, ", "))
	}
	slices.Sort(names)
	return names, nil
}

// centralInformerResync is the informers' resync: none, their handlers act on changes.
const centralInformerResync = 0

// runCentral serves the central controller until ctx ends.
func (o *serveOptions) runCentral(ctx context.Context) error {
	pools, err := o.centralPools()
	if err != nil {
		return err
	}
	ns, err := o.callsNamespace()
	if err != nil {
		return fmt.Errorf("--local-central: %w", err)
	}
	cfg, err := apiServerConfig(o.Kubeconfig)
	if err != nil {
		return fmt.Errorf("--local-central: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("--local-central: %w", err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("--local-central: %w", err)
	}
	disc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return fmt.Errorf("--local-central: %w", err)
	}
	c, err := o.newCentral(centralClients{Dynamic: dyn, Kube: kube, Discovery: disc}, ns, pools, clock.RealClock{})
	if err != nil {
		return fmt.Errorf("--local-central: %w", err)
	}
	klog.FromContext(ctx).Info("Serving the local driver's central controller", "namespace", ns, "pools", pools,
		"nodeStaleAfter", o.NodeStaleAfter, "nodeCallPickup", o.NodeCallPickup)
	return c.run(ctx)
}

// centralClients are the API clients the central controller acts through.
type centralClients struct {
	Dynamic   dynamic.Interface
	Kube      kubernetes.Interface
	Discovery discovery.DiscoveryInterface
}

// centralController is the central controller's parts, wired; run serves them.
type centralController struct {
	endpoint    string
	healthzAddr string
	server      *central.Server
	// metrics serves /metrics (nil without --metrics-address); interceptors record the
	// CSI calls served, as the node driver's do.
	metrics      *httpServer
	interceptors []grpc.UnaryServerInterceptor
	// informers stop after the server: a call under way waits on their events.
	informers []runner.Runner
	// beside are the loops that stop with the server.
	beside []runner.Runner
}

// newCentral wires the central controller's parts over clients. With --metrics-address
// it opens the metrics listener, so a bad address fails the start.
func (o *serveOptions) newCentral(cl centralClients, namespace string, pools []string, clk clock.Clock) (*centralController, error) {
	store := nodecall.Store{Client: cl.Dynamic, Namespace: namespace}
	calls := store.Informer("", centralInformerResync) // every node's calls
	poolNodes := store.NodeInformer(centralInformerResync)
	nodes := central.NewNodeView(poolNodes, o.NodeStaleAfter, clk)
	c := &centralController{endpoint: o.Endpoint, healthzAddr: o.HealthzAddr}
	var cm *central.Metrics
	if o.MetricsAddr != "" {
		// The node driver's registry and call histogram (csi_plugin_operations_seconds,
		// the Go and process collectors; no pool is opened here, so no pool gauges),
		// and the channel's own metrics on the same registry.
		mx := metrics.New(o.DriverName, "", nil, health.Options{})
		var err error
		if cm, err = central.NewMetrics(central.MetricsDeps{Registry: mx.Registry, Nodes: nodes, Calls: calls}); err != nil {
			return nil, err
		}
		h, err := listenHTTP("metrics", o.MetricsAddr, "/metrics", mx.Handler(), 5*time.Second)
		if err != nil {
			return nil, err
		}
		c.metrics = h
		c.interceptors = append(c.interceptors, mx.Interceptor)
	}
	channel := central.NewChannel(central.ChannelDeps{
		Store: store, Calls: calls, Nodes: nodes,
		// The Node's UID as its PoolNode's owner names it; a read of the Node only when
		// the view has none (a PoolNode without its owner).
		NodeUID: func(ctx context.Context, node string) (string, error) {
			if uid, ok := nodes.NodeUID(node); ok {
				return uid, nil
			}
			uid, err := store.NodeUID(ctx, node)
			return string(uid), err
		},
		Clock: clk, Pickup: o.NodeCallPickup, Lifetime: central.DefaultCallLifetime,
		Metrics: cm,
	})
	hints := central.NewHints(central.HintsDeps{
		Client: cl.Dynamic, Driver: o.DriverName, TopologyKey: poolset.TopologyKey,
		Discovery: cl.Discovery, Resync: centralInformerResync,
	})
	server := central.NewServer(central.Deps{
		Name: o.DriverName, Version: buildVersion(), TopologyKey: poolset.TopologyKey,
		Params: params.Config{Pools: pools},
		Calls:  channel, Nodes: nodes, Hints: hints, Clock: clk,
		// The node pods of the release: which nodes still run the per-node provisioner.
		Rollout: central.PodRollout{Client: cl.Kube, Namespace: namespace},
	})
	migration := &central.CapacityMigration{Client: cl.Kube, Namespace: namespace, Driver: o.DriverName, Nodes: nodes}
	// A node that serves again has the central provisioner's objects at 0 re-made now,
	// not at its next poll.
	refresh := central.NewCapacityRefresh(central.RefreshDeps{Client: cl.Kube, Namespace: namespace, Driver: o.DriverName,
		TopologyKey: poolset.TopologyKey, Params: params.Config{Pools: pools}, View: nodes})
	sweeper := central.NewSweeper(store, calls, clk)
	sweeper.Metrics = cm
	c.server = server
	c.informers = []runner.Runner{informerRunner(calls), informerRunner(poolNodes), hints}
	c.beside = []runner.Runner{sweeper, migration, refresh}
	return c, nil
}

// informerRunner runs an informer until its context ends.
func informerRunner(inf cache.SharedIndexInformer) runner.Runner {
	return runner.Func(func(ctx context.Context) error {
		inf.RunWithContext(ctx)
		return nil
	})
}

// run serves the central controller until ctx ends, in stages: the CSI server and the
// loops beside it (sweeper, capacity migration, /healthz) stop first; the informers only
// once the server has let its calls under way finish (each waits on their events). A
// server that fails ends the rest.
func (c *centralController) run(ctx context.Context) error {
	lis, err := driver.Listen(c.endpoint)
	if err != nil {
		return err
	}
	defer func() {
		if err := lis.Remove(); err != nil {
			klog.ErrorS(err, "Not removing the CSI socket")
		}
	}()
	beside := c.beside
	if c.healthzAddr != "" {
		h, err := listenHTTP("healthz", c.healthzAddr, "/healthz", kubeletplugin.Healthz(c.server, 3*time.Second), 2*time.Second)
		if err != nil {
			return err
		}
		beside = append(slices.Clone(beside), h)
	}
	if c.metrics != nil {
		beside = append(slices.Clone(beside), c.metrics)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(rpc.Interceptors(c.interceptors...)...))
	c.server.Register(srv)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	server := &rpc.Serving{Server: srv, Listener: lis, Endpoint: c.endpoint, Stop: cancel, Started: func() {
		klog.InfoS("Serving CSI (central)", "endpoint", c.endpoint)
	}}
	if err := runner.Stages(ctx, append(slices.Clone(beside), server), c.informers); err != nil {
		klog.ErrorS(err, "A loop of the central controller failed")
	}
	return server.Err()
}
