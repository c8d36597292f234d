package rpc

import (
	"context"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
)

// callChain runs handler through chain as grpc.ChainUnaryInterceptor does.
func callChain(ctx context.Context, chain []grpc.UnaryServerInterceptor, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if len(chain) == 0 {
		return handler(ctx, req)
	}
	return chain[0](ctx, req, info, func(ctx context.Context, req any) (any, error) {
		return callChain(ctx, chain[1:], req, info, handler)
	})
}

// bufferedLogger is a context logger whose every line is kept, at every
// verbosity the interceptors use.
func bufferedLogger(t *testing.T) (context.Context, func() string) {
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.Verbosity(5), ktesting.BufferLogs(true)))
	underlier, ok := logger.GetSink().(ktesting.Underlier)
	if !ok {
		t.Fatal("ktesting's logger has no buffer")
	}
	return klog.NewContext(context.Background(), logger), func() string { return underlier.GetBuffer().String() }
}

// Every line of a call carries what its request names, put there once by the
// interceptor, and never the request's secrets.
func TestCallLogLinesCarryTheIDs(t *testing.T) {
	tests := []struct {
		name     string
		method   string
		req      any
		want     []string // on every line of the call
		notWant  []string // on no line
		handlerE error
	}{
		{"a node call, failing", "/csi.v1.Node/NodeStageVolume",
			&csi.NodeStageVolumeRequest{VolumeId: "local.0123", StagingTargetPath: "/st", Secrets: map[string]string{"key": "s3cret"}},
			[]string{`volume="local.0123"`}, []string{"s3cret"}, status.Error(codes.NotFound, "no volume")},
		{"CreateVolume: its name", "/csi.v1.Controller/CreateVolume",
			&csi.CreateVolumeRequest{Name: "pvc-1", Secrets: map[string]string{"key": "s3cret"}, Parameters: map[string]string{"pool": "local"}},
			[]string{`name="pvc-1"`}, []string{"s3cret", "volume="}, nil},
		{"CreateSnapshot: its name and source", "/csi.v1.Controller/CreateSnapshot",
			&csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: "local.0123", Secrets: map[string]string{"k": "s3cret"}},
			[]string{`volume="local.0123"`, `name="snap-1"`}, []string{"s3cret"}, nil},
		{"DeleteSnapshot", "/csi.v1.Controller/DeleteSnapshot", &csi.DeleteSnapshotRequest{SnapshotId: "local.0123@s"},
			[]string{`snapshot="local.0123@s"`}, nil, nil},
		{"a group snapshot", "/csi.v1.GroupController/DeleteVolumeGroupSnapshot",
			&csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "g-1", SnapshotIds: []string{"a@1"}},
			[]string{`groupSnapshot="g-1"`}, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, logged := bufferedLogger(t)
			info := &grpc.UnaryServerInfo{FullMethod: tt.method}
			_, err := callChain(ctx, Interceptors(), tt.req, info, func(ctx context.Context, req any) (any, error) {
				klog.FromContext(ctx).Info("Handler at work")
				var own []any // a handler's own value, as handlers add it today
				if r, ok := req.(interface{ GetVolumeId() string }); ok {
					own = []any{"volume", r.GetVolumeId()}
				}
				klog.FromContext(ctx).V(4).Info("Handler in detail", own...)
				return &csi.NodeStageVolumeResponse{}, tt.handlerE
			})
			if status.Code(err) != status.Code(tt.handlerE) {
				t.Fatalf("error %v, want %v", err, tt.handlerE)
			}
			out := logged()
			lines := strings.Split(strings.TrimSpace(out), "\n")
			if len(lines) != 4 { // the call, the handler's two lines, the answer
				t.Fatalf("%d lines logged:\n%s", len(lines), out)
			}
			for _, line := range lines {
				for _, w := range append([]string{`method="` + tt.method + `"`}, tt.want...) {
					if !strings.Contains(line, w) {
						t.Errorf("a line lacks %s: %s", w, line)
					}
				}
				if strings.Count(line, "volume=") > 1 {
					t.Errorf("the volume twice on one line: %s", line)
				}
			}
			for _, nw := range tt.notWant {
				if strings.Contains(out, nw) {
					t.Errorf("the log holds %q:\n%s", nw, out)
				}
			}
		})
	}
}

// An ID is cut at maxLoggedID on the lines it is put on.
func TestRequestIDsBounded(t *testing.T) {
	long := strings.Repeat("x", 2*maxLoggedID)
	kv := requestIDs(&csi.NodeUnstageVolumeRequest{VolumeId: long})
	if len(kv) != 2 || kv[0] != "volume" || kv[1] != long[:maxLoggedID]+"…" {
		t.Fatalf("requestIDs = %q", kv)
	}
	if kv := requestIDs(&csi.ProbeRequest{}); len(kv) != 0 {
		t.Fatalf("requestIDs(Probe) = %q", kv)
	}
}

// panicky is an Identity service whose first GetPluginInfo panics.
type panicky struct {
	csi.UnimplementedIdentityServer
	calls atomic.Int64
}

func (p *panicky) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	if n := p.calls.Add(1); n == 1 {
		var pools []string
		_ = pools[n-1] // an index out of range: the kind of bug the recovery is for
	}
	return &csi.GetPluginInfoResponse{Name: "poolcsi.test", VendorVersion: "v0"}, nil
}

// A handler's panic answers its call Internal and the server goes on serving,
// whether the handler ran in the call's goroutine (no deadline) or in
// answerInTime's (a deadline).
func TestHandlerPanicAnswersInternal(t *testing.T) {
	for _, deadline := range []bool{false, true} {
		t.Run(map[bool]string{false: "no deadline", true: "a deadline"}[deadline], func(t *testing.T) {
			lis := bufconn.Listen(1 << 20)
			srv := grpc.NewServer(grpc.ChainUnaryInterceptor(Interceptors()...))
			csi.RegisterIdentityServer(srv, &panicky{})
			served := make(chan error, 1)
			go func() { served <- srv.Serve(lis) }()
			t.Cleanup(func() {
				srv.Stop()
				if err := <-served; err != nil {
					t.Errorf("serve: %v", err)
				}
			})
			conn, err := grpc.NewClient("passthrough:///bufnet", grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = conn.Close() })
			ids := csi.NewIdentityClient(conn)
			call := func() (*csi.GetPluginInfoResponse, error) {
				ctx := context.Background()
				if deadline {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, time.Minute)
					defer cancel()
				}
				return ids.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
			}
			if _, err := call(); status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "panicked") {
				t.Fatalf("the panicking call: %v, want Internal", err)
			}
			info, err := call()
			if err != nil || info.GetName() != "poolcsi.test" {
				t.Fatalf("the next call: %v, %v", info, err)
			}
		})
	}
}

// The panic is logged with its stack, on the call's logger.
func TestHandlerPanicLogged(t *testing.T) {
	ctx, logged := bufferedLogger(t)
	info := &grpc.UnaryServerInfo{FullMethod: "/csi.v1.Node/NodePublishVolume"}
	_, err := callChain(ctx, Interceptors(), &csi.NodePublishVolumeRequest{VolumeId: "local.0123"}, info,
		func(context.Context, any) (any, error) { panic("handler bug") })
	if status.Code(err) != codes.Internal {
		t.Fatalf("%v, want Internal", err)
	}
	out := logged()
	for _, w := range []string{"GRPC handler panicked", `panic="handler bug"`, `volume="local.0123"`, "runtime/debug.Stack", "TestHandlerPanicLogged"} {
		if !strings.Contains(out, w) {
			t.Errorf("the log lacks %s:\n%s", w, out)
		}
	}
}
