package kubeletplugin

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// kubelet's side of registration: what its plugin watcher does with a new
// socket in plugins_registry.
func TestRegistrationAsKubeletSeesIt(t *testing.T) {
	dir, err := os.MkdirTemp("", "reg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	r := &Registrar{DriverName: "poolcsi.io", Endpoint: "/var/lib/kubelet/plugins/poolcsi.io/csi.sock", Dir: dir}
	// A stale socket of a killed process is replaced.
	stale, err := net.Listen("unix", r.SocketPath())
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	var ready atomic.Bool
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- r.Run(ctx, func(context.Context) error {
			if !ready.Load() {
				return errors.New("CSI socket not serving yet")
			}
			return nil
		})
	}()
	time.Sleep(200 * time.Millisecond)
	if c, err := net.Dial("unix", r.SocketPath()); err == nil {
		c.Close()
		t.Fatal("registration socket served before the CSI socket answered")
	}
	ready.Store(true)
	var conn *grpc.ClientConn
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.Dial("unix", r.SocketPath()); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no registration socket")
		}
		time.Sleep(50 * time.Millisecond)
	}
	conn, err = grpc.NewClient("unix://"+r.SocketPath(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := registerapi.NewRegistrationClient(conn)
	info, err := c.GetInfo(context.Background(), &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetType() != registerapi.CSIPlugin || info.GetName() != "poolcsi.io" || info.GetEndpoint() != r.Endpoint || len(info.GetSupportedVersions()) == 0 {
		t.Fatalf("GetInfo: %v", info)
	}
	for _, ok := range []bool{true, false} {
		if _, err := c.NotifyRegistrationStatus(context.Background(), &registerapi.RegistrationStatus{PluginRegistered: ok, Error: "test"}); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(r.SocketPath()); !os.IsNotExist(err) {
		t.Fatalf("the registration socket outlived the driver: %v", err)
	}
}

type prober struct {
	resp *csi.ProbeResponse
	err  error
}

func (p prober) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return p.resp, p.err
}

func TestHealthz(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    prober
		code int
		body string
	}{
		{"ready", prober{resp: &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}}, 200, "ok"},
		{"no ready field", prober{resp: &csi.ProbeResponse{}}, 200, "ok"},
		{"not ready", prober{resp: &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}}, 500, "not ready"},
		{"error", prober{err: status.Error(codes.FailedPrecondition, "pool p: broken")}, 500, "pool p: broken"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			Healthz(tc.p, time.Second).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
			if rec.Code != tc.code || !strings.Contains(rec.Body.String(), tc.body) {
				t.Fatalf("/healthz %d %q, want %d %q", rec.Code, rec.Body.String(), tc.code, tc.body)
			}
		})
	}
}
