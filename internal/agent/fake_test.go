package agent

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/nodecall/nodecalltest"
)

// csiServer is a node's CSI socket in process: every method the agent may call lands in
// handle, which the test sets; it records what was asked.
type csiServer struct {
	mu     sync.Mutex
	calls  []string        // method names, in the order asked
	reqs   []proto.Message // the requests, likewise
	handle func(ctx context.Context, method string, req proto.Message) (proto.Message, error)
}

func (s *csiServer) asked() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.calls...)
}

func (s *csiServer) serve(_ any, stream grpc.ServerStream) error {
	full, _ := grpc.MethodFromServerStream(stream)
	name := full[strings.LastIndex(full, "/")+1:]
	var req proto.Message
	if m, ok := nodecall.Lookup(name); ok {
		req = m.NewRequest()
	} else if name == "GetCapacity" {
		req = &csi.GetCapacityRequest{}
	} else {
		return status.Errorf(codes.Unimplemented, "%s", full)
	}
	if err := stream.RecvMsg(req); err != nil {
		return err
	}
	s.mu.Lock()
	s.calls = append(s.calls, name)
	s.reqs = append(s.reqs, req)
	h := s.handle
	s.mu.Unlock()
	resp, err := h(stream.Context(), name, req)
	if err != nil {
		return err
	}
	return stream.SendMsg(resp)
}

// okAnswers answers every call with an empty response of its method, and GetCapacity
// with 1 GiB.
func okAnswers(_ context.Context, method string, _ proto.Message) (proto.Message, error) {
	if method == "GetCapacity" {
		return &csi.GetCapacityResponse{AvailableCapacity: 1 << 30}, nil
	}
	m, _ := nodecall.Lookup(method)
	return m.NewResponse(), nil
}

// newConn starts srv on an in-memory listener and returns a client of it.
func newConn(t *testing.T, srv *csiServer) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	g := grpc.NewServer(grpc.UnknownServiceHandler(srv.serve))
	go func() { _ = g.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///node",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		g.Stop()
	})
	return conn
}

// start is the agent's clock in the tests.
var start = time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)

type env struct {
	client *nodecalltest.Client
	store  nodecall.Store
	srv    *csiServer
	clock  *clocktesting.FakeClock
	deps   Deps
}

func newEnv(t *testing.T, node string) *env {
	t.Helper()
	e := &env{client: nodecalltest.NewClient(nodecalltest.Node(node, "uid-"+node)), srv: &csiServer{handle: okAnswers}, clock: clocktesting.NewFakeClock(start)}
	e.store = nodecall.Store{Client: e.client, Namespace: "poolcsi"}
	e.deps = Deps{Calls: e.store, Node: node, Conn: newConn(t, e.srv), Pools: []string{"local"}, Clock: e.clock}
	return e
}

// worker is a worker over the store directly (no informer): each Step sees what the API
// server holds.
func (e *env) worker(t *testing.T) *Worker {
	w, _ := New(e.deps)
	w.calls = func(string) []*nodecall.Call {
		l, err := e.store.List(context.Background(), "")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	return w
}

// call creates a call for node and returns it as stored.
func (e *env) call(t *testing.T, node, method, target string, req proto.Message, issued time.Time) *nodecall.Call {
	t.Helper()
	c, err := nodecall.NewCall(nodecall.Ask{Node: node, Method: method, Target: target, Request: req, Issued: issued, NotAfter: issued.Add(15 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	made, err := e.store.Create(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	return made
}

func (e *env) get(t *testing.T, name string) *nodecall.Call {
	t.Helper()
	c, err := e.store.Get(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func deleteReq(id string) *csi.DeleteVolumeRequest { return &csi.DeleteVolumeRequest{VolumeId: id} }

var (
	metav1GetOptions    = metav1.GetOptions{}
	metav1UpdateOptions = metav1.UpdateOptions{}
)

func unstructuredSet(obj map[string]any, value string, path ...string) error {
	return unstructured.SetNestedField(obj, value, path...)
}
