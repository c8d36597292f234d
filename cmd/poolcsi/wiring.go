package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/pvcevents"
	"github.com/poolcsi/poolcsi/internal/runner"
	"github.com/poolcsi/poolcsi/internal/snapclaim"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"
)

// The optional parts of serve that talk to kubelet or the API server.

// httpServer serves one handler on a listener until its context ends, then
// shuts down within grace.
type httpServer struct {
	name  string
	srv   *http.Server
	lis   net.Listener
	grace time.Duration
}

// listenHTTP opens addr (host:port) for handler at path, so a bad address
// fails the start; Run serves it.
func listenHTTP(name, addr, path string, handler http.Handler, grace time.Duration) (*httpServer, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%s address %s: %w", name, addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle(path, handler)
	klog.InfoS("Serving "+path, "address", lis.Addr().String())
	return &httpServer{name: name, lis: lis, grace: grace, srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}}, nil
}

// Run serves until ctx ends; a server that fails is logged, and stops nothing else.
func (h *httpServer) Run(ctx context.Context) error {
	served := make(chan error, 1)
	go func() { served <- h.srv.Serve(h.lis) }()
	select {
	case err := <-served:
		klog.ErrorS(err, "HTTP server stopped", "server", h.name, "address", h.lis.Addr().String())
		return nil
	case <-ctx.Done():
	}
	// ctx is done: the shutdown gets a deadline of its own.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.grace)
	defer cancel()
	if err := h.srv.Shutdown(sctx); err != nil {
		klog.ErrorS(err, "HTTP server did not shut down cleanly", "server", h.name, "address", h.lis.Addr().String())
	}
	if err := <-served; err != nil && !errors.Is(err, http.ErrServerClosed) {
		klog.ErrorS(err, "HTTP server stopped", "server", h.name)
	}
	return nil
}

// probeEndpoint calls Probe over the CSI socket: the registration waits until
// the socket kubelet will use answers.
func probeEndpoint(endpoint string) func(context.Context) error {
	return func(ctx context.Context) error {
		conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer func() { _ = conn.Close() }()
		_, err = csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
		return err
	}
}

// pvcEvents reports volume health on the claims every interval, through the
// API server kubeconfig (or the service account) names.
func pvcEvents(d *driver.Driver, name, kubeconfig, leaseNamespace string, interval time.Duration) (runner.Runner, error) {
	cfg, err := apiServerConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--pvc-events-interval: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--pvc-events-interval: %w", err)
	}
	r := &pvcevents.Reporter{Client: client, Driver: name, Conditions: func(ctx context.Context) (map[string]pvcevents.Condition, error) {
		sick, err := d.AbnormalVolumes(ctx)
		out := make(map[string]pvcevents.Condition, len(sick))
		for id, msg := range sick {
			out[id] = pvcevents.Condition{Abnormal: true, Message: msg}
		}
		return out, err
	}}
	if leaseNamespace == "" {
		return runner.Func(func(ctx context.Context) error {
			klog.InfoS("Reporting volume health on claims", "interval", interval)
			r.Run(ctx, interval)
			return nil
		}), nil
	}
	id, _ := os.Hostname() // the pod's name
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: strings.ReplaceAll(name, ".", "-") + "-pvc-events", Namespace: leaseNamespace},
		Client:     client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: id},
	}
	elect := leaderelection.LeaderElectionConfig{
		Lock: lock, ReleaseOnCancel: true,
		LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 5 * time.Second,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				klog.InfoS("Reporting volume health on claims (leader)", "interval", interval, "identity", id)
				r.Run(ctx, interval)
			},
			OnStoppedLeading: func() { klog.InfoS("No longer reporting volume health on claims", "identity", id) },
		},
	}
	return runner.Func(func(ctx context.Context) error { leaderelection.RunOrDie(ctx, elect); return nil }), nil
}

// apiServerConfig is the kubeconfig's API server, or the pod's service account's.
func apiServerConfig(kubeconfig string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("API server config: %w", err)
	}
	return cfg, nil
}

// snapshotClaims labels, for this node's csi-snapshotter, the snapshot contents
// nobody labelled whose source this node's pools hold (package snapclaim): pre-provisioned
// VolumeSnapshotContents, group members, and VolumeGroupSnapshotContents if the cluster
// serves them.
func snapshotClaims(d *driver.Driver, name, node, kubeconfig string) (runner.Runner, error) {
	cfg, err := apiServerConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--claim-local-snapshots: %w", err)
	}
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--claim-local-snapshots: %w", err)
	}
	disc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--claim-local-snapshots: %w", err)
	}
	c := &snapclaim.Claimer{
		Client: client, Discovery: disc, Driver: name, Node: node,
		Holds: snapshotHere(d), HoldsVolume: volumeHere(d), HoldsGroup: groupHere(d),
	}
	return runner.Func(func(ctx context.Context) error {
		klog.InfoS("Claiming unlabelled snapshot contents held here for this node's snapshotter", "node", node)
		c.Run(ctx, 10*time.Minute)
		return nil
	}), nil
}

// The claim's lookups are the CSI calls, in process: they parse a handle as the RPCs do
// (a hostile one is INVALID_ARGUMENT, logged by the claimer), and NOT_FOUND is a source
// that is not in this node's pools.

// snapshotHere is the lookup csi-snapshotter makes of a pre-provisioned content.
func snapshotHere(d *driver.Driver) func(context.Context, string) (bool, error) {
	return func(ctx context.Context, handle string) (bool, error) {
		resp, err := d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: handle})
		return len(resp.GetEntries()) > 0, err
	}
}

// volumeHere asks for one volume rather than listing them all: a group names a few
// volumes of a pool that may hold thousands.
func volumeHere(d *driver.Driver) func(context.Context, string) (bool, error) {
	return func(ctx context.Context, handle string) (bool, error) {
		_, err := d.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: handle})
		return found(err)
	}
}

// groupHere is the lookup csi-snapshotter makes of a pre-provisioned group content; the
// driver also checks that the members are exactly the group's.
func groupHere(d *driver.Driver) func(context.Context, string, []string) (bool, error) {
	return func(ctx context.Context, handle string, snapshots []string) (bool, error) {
		_, err := d.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: handle, SnapshotIds: snapshots})
		return found(err)
	}
}

func found(err error) (bool, error) {
	if status.Code(err) == codes.NotFound {
		return false, nil
	}
	return err == nil, err
}
