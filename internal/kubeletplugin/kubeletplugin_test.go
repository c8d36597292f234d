package kubeletplugin

import (
	"context"
	"errors"
	"math"
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
	"k8s.io/apimachinery/pkg/util/wait"
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

// A second instance (a restarted pod overlapping the one it replaces) waits while the
// first serves the registration socket, and registers once it is gone.
func TestRegistrationWaitsForAnotherInstance(t *testing.T) {
	dir, err := os.MkdirTemp("", "reg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	first := &Registrar{DriverName: "poolcsi.io", Endpoint: "/first/csi.sock", Dir: dir}
	second := &Registrar{DriverName: "poolcsi.io", Endpoint: "/second/csi.sock", Dir: dir,
		Retry: wait.Backoff{Duration: 20 * time.Millisecond, Factor: 2, Cap: 100 * time.Millisecond, Steps: math.MaxInt32}}
	ready := func(context.Context) error { return nil }
	ctx1, cancel1 := context.WithCancel(context.Background())
	done1 := make(chan error, 1)
	go func() { done1 <- first.Run(ctx1, ready) }()
	waitForEndpoint(t, first.SocketPath(), "/first/csi.sock")

	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	done2 := make(chan error, 1)
	go func() { done2 <- second.Run(ctx2, ready) }()
	select {
	case err := <-done2:
		t.Fatalf("the second instance gave up registration while the first served: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	waitForEndpoint(t, first.SocketPath(), "/first/csi.sock") // not taken over
	cancel1()
	if err := <-done1; err != nil {
		t.Fatal(err)
	}
	waitForEndpoint(t, second.SocketPath(), "/second/csi.sock")
	cancel2()
	if err := <-done2; err != nil {
		t.Fatal(err)
	}
}

// waitForEndpoint waits until the registration socket at path answers GetInfo with endpoint.
func waitForEndpoint(t *testing.T, path, endpoint string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		info, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{})
		cancel()
		conn.Close()
		if err == nil && info.GetEndpoint() == endpoint {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s does not answer with %s: %v %v", path, endpoint, info, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestValidateDriverName(t *testing.T) {
	for _, name := range []string{"poolcsi.io", "a", "csi-driver.example.com", "A1", strings.Repeat("a", 63)} {
		if err := ValidateDriverName(name); err != nil {
			t.Errorf("ValidateDriverName(%q): %v", name, err)
		}
	}
	for _, name := range []string{"", "../../x", "a/b", ".", "..", "-a", "a-", ".a", "a.", "a_b", "a b", "a\x00b", "é.io", strings.Repeat("a", 64)} {
		if err := ValidateDriverName(name); err == nil {
			t.Errorf("ValidateDriverName(%q): no error", name)
		}
	}
	// And the registrar refuses one by itself: its socket is named after it.
	r := &Registrar{DriverName: "../../x", Dir: t.TempDir()}
	if err := r.Run(context.Background(), func(context.Context) error { return nil }); err == nil || !strings.Contains(err.Error(), "driver name") {
		t.Fatalf("Run with driver name ../../x: %v", err)
	}
}
