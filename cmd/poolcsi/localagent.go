package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/client-go/dynamic"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/agent"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// The local agent (--local-agent, docs/design/central-controller.md §2.3): this node's
// side of the channel through which a central controller asks it for node-local work.
// Off by default; with it off, serve makes no API client and watches nothing for it.

// serviceAccountNamespace is where a pod finds its own namespace.
const serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// agentWaitLimit bounds how long serve waits on its way out for the agent's answers
// under way to be written.
const agentWaitLimit = 15 * time.Second

// validateLocalAgent checks the agent's flags.
func (o *serveOptions) validateLocalAgent() []error {
	var errs []error
	if o.AgentWorkers < 1 {
		errs = append(errs, fmt.Errorf("--agent-workers %d: want 1 or more", o.AgentWorkers))
	}
	if o.AgentHeartbeat <= 0 {
		errs = append(errs, fmt.Errorf("--agent-heartbeat %s: want a positive duration", o.AgentHeartbeat))
	}
	if o.AgentCallTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--agent-call-timeout %s: want a positive duration", o.AgentCallTimeout))
	}
	if o.LocalAgent && o.Mode != string(driver.ModeAll) {
		// The agent replays Controller calls on its own socket, which serves them only
		// in mode all.
		errs = append(errs, fmt.Errorf("--local-agent needs --mode=all (it runs Controller calls on this node's own socket), not %q", o.Mode))
	}
	return errs
}

// callsNamespace is --calls-namespace, or the pod's own namespace.
func (o *serveOptions) callsNamespace() (string, error) {
	if o.CallsNamespace != "" {
		return o.CallsNamespace, nil
	}
	b, err := os.ReadFile(serviceAccountNamespace)
	if err != nil {
		return "", fmt.Errorf("--calls-namespace not given and the pod's namespace unknown: %w", err)
	}
	if ns := strings.TrimSpace(string(b)); ns != "" {
		return ns, nil
	}
	return "", errors.New("--calls-namespace not given and the pod's namespace file is empty")
}

// startLocalAgent starts the agent's call worker and PoolNode publisher once this node's
// CSI socket answers, and returns a channel closed when both have stopped (after ctx
// ends, with the answers under way written). With --local-agent off it does nothing and
// the channel is closed already.
func (o *serveOptions) startLocalAgent(ctx context.Context, d *driver.Driver, nodeID string, opened []*pool.Pool) (<-chan struct{}, error) {
	done := make(chan struct{})
	if !o.LocalAgent {
		close(done)
		return done, nil
	}
	ns, err := o.callsNamespace()
	if err != nil {
		return nil, fmt.Errorf("--local-agent: %w", err)
	}
	cfg, err := apiServerConfig(o.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--local-agent: %w", err)
	}
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--local-agent: %w", err)
	}
	conn, err := grpc.NewClient(o.Endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("--local-agent: %w", err)
	}
	var local []string
	for _, p := range opened {
		if !p.Shared() {
			local = append(local, p.Name())
		}
	}
	pod, _ := os.Hostname() // the pod's name
	worker, publisher := agent.New(agent.Deps{
		Calls: nodecall.Store{Client: client, Namespace: ns},
		Node:  nodeID, Conn: conn, Pools: local, Kick: d.KickIOLimits,
		Workers: o.AgentWorkers, CallTimeout: o.AgentCallTimeout, Heartbeat: o.AgentHeartbeat,
		Version: buildVersion(), Pod: pod,
	})
	log := klog.FromContext(ctx).WithValues("namespace", ns, "node", nodeID)
	go func() {
		defer close(done)
		defer func() { _ = conn.Close() }()
		// Started once the socket answers: every call it takes goes through it.
		if err := probeEndpoint(o.Endpoint)(ctx); err != nil {
			if ctx.Err() == nil {
				log.Error(err, "Local agent not started: this node's CSI socket does not answer")
			}
			return
		}
		log.Info("Local agent started", "pools", local)
		var g errgroup.Group
		g.Go(func() error { return worker.Run(ctx) })
		g.Go(func() error { return publisher.Run(ctx) })
		if err := g.Wait(); err != nil {
			log.Error(err, "Local agent stopped")
		}
	}()
	return done, nil
}
