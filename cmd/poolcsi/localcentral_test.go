package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	fakediscovery "k8s.io/client-go/discovery/fake"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/central"
	"github.com/poolcsi/poolcsi/internal/nodecall"
)

func TestLocalCentralFlags(t *testing.T) {
	const on, ctl = "--local-central", "--mode=controller"
	tests := []struct {
		name string
		args []string
		want string // a part of the error; empty: valid
	}{
		{name: "off by default, in any mode", args: []string{"--mode=node"}},
		{name: "on in controller mode", args: []string{on, ctl, "--node-stale-after=30s", "--node-call-pickup=5s", "--healthz-address=:0"}},
		// What the chart's local-controller Deployment passes (templates/localcontroller.yaml).
		{name: "the chart's", args: []string{ctl, on, "--driver-name=local.poolcsi.io", "--endpoint=unix:///csi/csi.sock",
			"--config=/etc/poolcsi/local.yaml", "--calls-namespace=poolcsi", "--healthz-address=:9821", "--metrics-address=:9824"}},
		{name: "on in mode all", args: []string{on}, want: "--local-central needs --mode=controller"},
		{name: "on in node mode", args: []string{on, "--mode=node"}, want: "--local-central needs --mode=controller"},
		{name: "with the agent", args: []string{on, ctl, "--local-agent"}, want: "excludes --local-agent"},
		{name: "with the kubelet registration", args: []string{on, ctl, "--registration-dir=/registration"}, want: "excludes --registration-dir"},
		{name: "with snapshot claims", args: []string{on, ctl, "--claim-local-snapshots"}, want: "excludes --claim-local-snapshots"},
		{name: "with claim events", args: []string{on, ctl, "--pvc-events-interval=1m"}, want: "excludes --pvc-events-interval"},
		{name: "with metrics", args: []string{on, ctl, "--metrics-address=:9090"}},
		{name: "with a share key", args: []string{on, ctl, "--share-key-file=/k"}, want: "excludes --share-key-file"},
		{name: "zero stale limit", args: []string{"--node-stale-after=0"}, want: "--node-stale-after"},
		{name: "negative pickup", args: []string{on, ctl, "--node-call-pickup=-1s"}, want: "--node-call-pickup"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := parseServeFlags(t, tt.args...).Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("Validate: %v, want no error", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("Validate: %v, want an error with %q", err, tt.want)
			}
		})
	}
	o := parseServeFlags(t)
	if o.LocalCentral || o.NodeStaleAfter != central.DefaultStaleAfter || o.NodeCallPickup != central.DefaultPickup {
		t.Errorf("defaults: %+v", o)
	}
}

// The central controller reads the pools' names only, from the config and --pool as a
// node does; a shared pool in the local driver's config is refused.
func TestLocalCentralPools(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "local.yaml")
	// The paths do not exist: nothing is opened.
	if err := os.WriteFile(cfg, []byte("pools:\n- name: zeta\n  path: /nonexistent/z\n- name: alpha\n  path: /nonexistent/a\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string
		want []string
		err  string
	}{
		{name: "config and flag, sorted", args: []string{"--config=" + cfg, "--pool=mid=/nonexistent/m"}, want: []string{"alpha", "mid", "zeta"}},
		{name: "none given: the default pool", want: []string{"default"}},
		{name: "a shared pool", args: []string{"--config=" + cfg, "--pool=s=/nonexistent/s,shared"}, err: "pool(s) s are shared"},
		{name: "a config that does not exist", args: []string{"--config=" + filepath.Join(dir, "none.yaml")}, err: "none.yaml"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseServeFlags(t, tt.args...).centralPools()
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("centralPools: %v, %v; want an error with %q", got, err, tt.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tt.want) {
				t.Fatalf("centralPools: %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}

// Without an API server there is no central controller: an error at start, not a
// server that answers nothing.
func TestLocalCentralNeedsTheAPIServer(t *testing.T) {
	o := parseServeFlags(t, "--local-central", "--mode=controller", "--calls-namespace=poolcsi",
		"--kubeconfig=/nonexistent/kubeconfig", "--endpoint=unix://"+filepath.Join(t.TempDir(), "csi.sock"))
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	err := o.run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "--local-central") {
		t.Fatalf("run: %v, want an error naming --local-central", err)
	}
}

// centralTestClients are fake API clients that list what the central controller's
// informers may list.
func centralTestClients() centralClients {
	kinds := nodecall.ListKinds()
	for gvr, kind := range map[schema.GroupVersionResource]string{
		{Version: "v1", Resource: "nodes"}:                                                                   "NodeList",
		{Version: "v1", Resource: "persistentvolumes"}:                                                       "PersistentVolumeList",
		{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotcontents"}:                "VolumeSnapshotContentList",
		{Group: "groupsnapshot.storage.k8s.io", Version: "v1beta1", Resource: "volumegroupsnapshotcontents"}: "VolumeGroupSnapshotContentList",
		{Group: "groupsnapshot.storage.k8s.io", Version: "v1beta2", Resource: "volumegroupsnapshotcontents"}: "VolumeGroupSnapshotContentList",
	} {
		kinds[gvr] = kind
	}
	kube := kubefake.NewClientset()
	return centralClients{
		Dynamic:   dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), kinds),
		Kube:      kube,
		Discovery: &fakediscovery.FakeDiscovery{Fake: &kube.Fake},
	}
}

// The central controller serves the local driver's Identity, Controller and
// GroupController on the socket, and stops with its context, removing the socket.
func TestLocalCentralServesAndStops(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "csi.sock")
	o := parseServeFlags(t, "--local-central", "--mode=controller", "--driver-name=local.poolcsi.io",
		"--endpoint=unix://"+sock, "--healthz-address=127.0.0.1:0")
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	c, err := o.newCentral(centralTestClients(), "poolcsi", []string{"local"}, clock.RealClock{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.run(ctx) }()

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
	defer ccancel()
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(cctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetPluginInfo: %v", err)
	}
	if info.GetName() != "local.poolcsi.io" {
		t.Errorf("GetPluginInfo names %q, want the local driver", info.GetName())
	}
	// The Controller and GroupController services are registered: an unknown service
	// would be UNIMPLEMENTED with "unknown service", a registered one answers itself.
	for _, svc := range []string{"csi.v1.Controller", "csi.v1.GroupController"} {
		if !slices.ContainsFunc(grpcServices(t, c), func(s string) bool { return s == svc }) {
			t.Errorf("%s not registered", svc)
		}
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the central controller did not stop with its context")
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("the socket is left behind: %v", err)
	}
}

// grpcServices is what the central server registers.
func grpcServices(t *testing.T, c *centralController) []string {
	t.Helper()
	srv := grpc.NewServer()
	c.server.Register(srv)
	var out []string
	for name := range srv.GetServiceInfo() {
		out = append(out, name)
	}
	return out
}

// With --metrics-address the central controller serves /metrics: the node driver's CSI
// call histogram for its own calls (one dashboard for both) and the channel's metrics,
// the node view among them.
func TestLocalCentralServesMetrics(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "csi.sock")
	o := parseServeFlags(t, "--local-central", "--mode=controller", "--driver-name=local.poolcsi.io",
		"--endpoint=unix://"+sock, "--metrics-address=127.0.0.1:0")
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	cl := centralTestClients()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A PoolNode this process has not seen change: known, not live.
	store := nodecall.Store{Client: cl.Dynamic, Namespace: "poolcsi"}
	if _, err := store.CreateNode(ctx, &nodecall.PoolNode{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}); err != nil {
		t.Fatal(err)
	}
	c, err := o.newCentral(cl, "poolcsi", []string{"local"}, clock.RealClock{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
	defer ccancel()
	if _, err := csi.NewIdentityClient(conn).GetPluginInfo(cctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("GetPluginInfo: %v", err)
	}
	url := "http://" + c.metrics.lis.Addr().String() + "/metrics"
	want := []string{
		`csi_plugin_operations_seconds_count{driver_name="local.poolcsi.io",grpc_status_code="OK",method_name="/csi.v1.Identity/GetPluginInfo"} 1`,
		`poolcsi_central_node_live{node="node-1"} 0`,
		`poolcsi_central_node_unchanged_seconds{node="node-1"} -1`,
	}
	var body string
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, nil
		}
		defer func() { _ = resp.Body.Close() }()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return false, nil
		}
		body = string(b)
		for _, w := range want {
			if !strings.Contains(body, w) {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("/metrics never held %q: %v\n%s", want, err, body)
	}
}
