package central

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

func createReq(name string) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		Parameters: map[string]string{"pool": "local"}, Secrets: map[string]string{"token": "x"}}
}

func done(code codes.Code, msg, response string) func(c *nodecall.Call) nodecall.CallStatus {
	return func(c *nodecall.Call) nodecall.CallStatus {
		return nodecall.CallStatus{Nonce: c.Spec.Nonce, Phase: nodecall.Done, Code: int32(code), Message: msg, Response: response, Attempts: 1}
	}
}

func running(c *nodecall.Call) nodecall.CallStatus {
	return nodecall.CallStatus{Nonce: c.Spec.Nonce, Phase: nodecall.Running, Attempts: 1}
}

func encodedCreate(t *testing.T, id string) string {
	t.Helper()
	m, _ := nodecall.Lookup("CreateVolume")
	s, err := m.EncodeResponse(&csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: id, CapacityBytes: 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// One CreateVolume on node b, and what the agent (the test) does meanwhile: the answer is
// the node's own, with its code and message; every way of not getting one is UNAVAILABLE
// or ABORTED, and says why.
func TestCall(t *testing.T) {
	const name = "pvc-1"
	const target = "local.3f2a"
	for _, tc := range []struct {
		desc string
		// agent plays the node once the call exists (nil: the node is down, see stale).
		agent    func(t *testing.T, e *env, name string)
		stale    time.Duration // node b not seen changing for this long before the call
		wantCode codes.Code
		wantMsg  string
	}{
		{desc: "stale node: nothing created", stale: 34 * time.Second,
			wantCode: codes.Unavailable, wantMsg: "poolcsi on node b has not renewed for 34 s"},
		{desc: "done ok", agent: func(t *testing.T, e *env, name string) {
			e.answer(t, name, running)
			e.answer(t, name, done(codes.OK, "", encodedCreate(t, target)))
		}, wantCode: codes.OK},
		{desc: "done with the node's code", agent: func(t *testing.T, e *env, name string) {
			e.answer(t, name, done(codes.ResourceExhausted, "pool local has 5 MiB free, 64 MiB asked", ""))
		}, wantCode: codes.ResourceExhausted, wantMsg: "pool local has 5 MiB free, 64 MiB asked"},
		{desc: "not taken", agent: func(t *testing.T, e *env, name string) {
			e.clock.Step(DefaultPickup)
		}, wantCode: codes.Unavailable, wantMsg: "poolcsi on node b has not taken the CreateVolume call within 10 s"},
		{desc: "wrong nonce is no answer", agent: func(t *testing.T, e *env, name string) {
			e.answer(t, name, func(c *nodecall.Call) nodecall.CallStatus {
				return nodecall.CallStatus{Nonce: "0123456789abcdef0123456789abcdef", Phase: nodecall.Done, Response: encodedCreate(t, target)}
			})
			e.clock.Step(DefaultPickup)
		}, wantCode: codes.Unavailable, wantMsg: "has not taken"},
		{desc: "deleted while waited on", agent: func(t *testing.T, e *env, name string) {
			e.answer(t, name, running)
			if err := e.store.Delete(context.Background(), name, ""); err != nil {
				t.Fatal(err)
			}
		}, wantCode: codes.Unavailable, wantMsg: "the CreateVolume call for node b was deleted before it was answered"},
		{desc: "node goes stale while running", agent: func(t *testing.T, e *env, name string) {
			e.answer(t, name, running)
			e.clock.Step(DefaultStaleAfter)
		}, wantCode: codes.Unavailable, wantMsg: "poolcsi on node b has not renewed for 20 s"},
		{desc: "running at the budget", agent: func(t *testing.T, e *env, name string) {
			e.answer(t, name, running)
			e.seenRunning(t, name)
			e.nodes.setLimit(time.Hour) // the node stays live past the budget
			e.clock.Step(time.Minute)
		}, wantCode: codes.Aborted, wantMsg: "CreateVolume of pvc-1 in progress on node b (attempt 1, 60 s)"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			e := newEnv(t)
			e.nodes.set("b", tc.stale)
			req := createReq(name)
			callName := nameOf(t, "b", "CreateVolume", req)
			res := e.call("b", "CreateVolume", target, req)
			if tc.agent != nil {
				e.cached(t, callName, "")
				e.settle(t, 3)
				tc.agent(t, e, callName)
			}
			r := <-res
			if got := status.Code(r.err); got != tc.wantCode || !strings.Contains(status.Convert(r.err).Message(), tc.wantMsg) {
				t.Fatalf("Call: %v, want %v %q", r.err, tc.wantCode, tc.wantMsg)
			}
			_, err := e.store.Get(context.Background(), callName)
			switch {
			case tc.agent == nil:
				if !apierrors.IsNotFound(err) {
					t.Errorf("a call was made for a stale node: %v", err)
				}
			case strings.HasPrefix(tc.desc, "done"):
				if tc.wantCode == codes.OK && r.resp.(*csi.CreateVolumeResponse).GetVolume().GetVolumeId() != target {
					t.Errorf("response %v", r.resp)
				}
				e.ch.bg.Wait()
				if _, err := e.store.Get(context.Background(), callName); !apierrors.IsNotFound(err) {
					t.Errorf("the answered call is still there: %v", err)
				}
			case tc.desc != "deleted while waited on":
				if err != nil {
					t.Errorf("the unanswered call is gone (its retry needs it): %v", err)
				}
			}
		})
	}
}

// Running at the budget is ABORTED; the retry derives the same call, finds the very
// object the node answered meanwhile, and returns its answer. Another request derives
// another call.
func TestRetryFindsTheSameCall(t *testing.T) {
	e := newEnv(t)
	e.nodes.setLimit(time.Hour)
	req := createReq("pvc-1")
	name := nameOf(t, "b", "CreateVolume", req)
	res := e.call("b", "CreateVolume", "local.1", req)
	first := e.cached(t, name, "")
	e.settle(t, 3)
	e.answer(t, name, running)
	e.clock.Step(time.Minute)
	if r := <-res; status.Code(r.err) != codes.Aborted {
		t.Fatalf("at the budget: %v", r.err)
	}
	e.answer(t, name, done(codes.OK, "", encodedCreate(t, "local.1")))

	// The same request again, its secrets and map order aside.
	again := proto.Clone(req).(*csi.CreateVolumeRequest)
	again.Secrets = map[string]string{"token": "other"}
	r := <-e.call("b", "CreateVolume", "local.1", again)
	if r.err != nil || r.resp.(*csi.CreateVolumeResponse).GetVolume().GetVolumeId() != "local.1" {
		t.Fatalf("retry: %v %v", r.resp, r.err)
	}
	e.ch.bg.Wait()
	if _, err := e.store.Get(context.Background(), name); !apierrors.IsNotFound(err) {
		t.Errorf("answered call not deleted: %v", err)
	}
	l, _ := e.store.List(context.Background(), "")
	if len(l) != 0 {
		t.Errorf("calls left: %d", len(l))
	}
	if first.UID == "" {
		t.Error("no UID")
	}

	// A retry after the call was deleted makes it again, same name, new nonce.
	res = e.call("b", "CreateVolume", "local.1", req)
	var second *nodecall.Call
	until(t, "the call made again", func() bool {
		second = e.ch.cached(name)
		return second != nil && second.UID != first.UID
	})
	if second.Spec.Nonce == first.Spec.Nonce {
		t.Errorf("made again with the old object's nonce")
	}
	e.answer(t, name, done(codes.OK, "", encodedCreate(t, "local.1")))
	if r := <-res; r.err != nil {
		t.Fatal(r.err)
	}
}

// A call being deleted (a finalizer holds it) is waited out and made again.
func TestCallBeingDeletedIsMadeAgain(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	req := createReq("pvc-1")
	c, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: "CreateVolume", Target: "local.1", Request: req, Issued: e.clock.Now(), NotAfter: e.clock.Now().Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	now := metav1Now(e)
	c.DeletionTimestamp = &now
	old, err := e.store.Create(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	e.cached(t, old.Name, "")
	res := e.call("b", "CreateVolume", "local.1", req)
	e.settle(t, 3)
	if err := e.store.Delete(ctx, old.Name, ""); err != nil {
		t.Fatal(err)
	}
	var made *nodecall.Call
	until(t, "the call made again", func() bool {
		made = e.ch.cached(old.Name)
		return made != nil && made.UID != old.UID
	})
	e.answer(t, old.Name, done(codes.OK, "", encodedCreate(t, "local.1")))
	if r := <-res; r.err != nil {
		t.Fatal(r.err)
	}
}

// Modify and Expand supersede the older calls of their target that no agent took; a
// taken one is left to run first.
func TestSupersede(t *testing.T) {
	for _, method := range []string{"ControllerModifyVolume", "ControllerExpandVolume"} {
		t.Run(method, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t)
			const id = "local.v"
			req := func(i int) proto.Message {
				if method == "ControllerExpandVolume" {
					return &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: int64(i) << 20}}
				}
				return &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: map[string]string{"readIOPS": string(rune('0' + i))}}
			}
			older := func(i int, node string, taken bool) *nodecall.Call {
				c, err := nodecall.NewCall(nodecall.Ask{Node: node, Method: method, Target: id, Request: req(i), Issued: e.clock.Now().Add(-time.Duration(10-i) * time.Second), NotAfter: e.clock.Now().Add(time.Minute)})
				if err != nil {
					t.Fatal(err)
				}
				made, err := e.store.Create(ctx, c)
				if err != nil {
					t.Fatal(err)
				}
				if taken {
					return e.answer(t, made.Name, running)
				}
				return e.cached(t, made.Name, made.ResourceVersion)
			}
			untaken := older(1, "b", false)
			taken := older(2, "b", true)
			otherNode := older(3, "a", false)
			expand := e.call("b", method, id, req(4))
			name := nameOf(t, "b", method, req(4))
			e.cached(t, name, "")
			e.gone(t, untaken.Name)
			m, _ := nodecall.Lookup(method)
			resp, err := m.EncodeResponse(m.NewResponse())
			if err != nil {
				t.Fatal(err)
			}
			e.answer(t, name, done(codes.OK, "", resp))
			if r := <-expand; r.err != nil {
				t.Fatal(r.err)
			}
			for _, c := range []*nodecall.Call{taken, otherNode} {
				if _, err := e.store.Get(ctx, c.Name); err != nil {
					t.Errorf("%s deleted: %v", c.Name, err)
				}
			}
		})
	}
	// Creates never supersede: each is its own volume.
}

// Every method of the allow-list: the response decodes to the method's own type, and an
// error is the node's exact code and message.
func TestCallEveryMethod(t *testing.T) {
	for _, method := range nodecall.Methods() {
		t.Run(method, func(t *testing.T) {
			m, _ := nodecall.Lookup(method)
			for _, tc := range []struct {
				code codes.Code
				msg  string
			}{{codes.OK, ""}, {codes.NotFound, "snapshot local@k not found on node b"}} {
				e := newEnv(t)
				req := m.NewRequest()
				name := nameOf(t, "b", method, req)
				res := e.call("b", method, "local.t", req)
				e.cached(t, name, "")
				resp := ""
				if tc.code == codes.OK {
					var err error
					if resp, err = m.EncodeResponse(m.NewResponse()); err != nil {
						t.Fatal(err)
					}
				}
				e.answer(t, name, done(tc.code, tc.msg, resp))
				r := <-res
				if got := status.Convert(r.err); got.Code() != tc.code || got.Message() != tc.msg {
					t.Errorf("answer %v, want %v %q", r.err, tc.code, tc.msg)
				}
				if tc.code == codes.OK && (r.resp == nil || r.resp.ProtoReflect().Descriptor() != m.NewResponse().ProtoReflect().Descriptor()) {
					t.Errorf("response %T", r.resp)
				}
			}
		})
	}
}

// The caller gone: its own code, and the call stays for the retry.
func TestCallerGone(t *testing.T) {
	e := newEnv(t)
	req := createReq("pvc-1")
	name := nameOf(t, "b", "CreateVolume", req)
	ctx, cancel := context.WithCancel(context.Background())
	res := make(chan error, 1)
	go func() {
		_, err := e.ch.Call(ctx, "b", "CreateVolume", "local.1", req)
		res <- err
	}()
	e.cached(t, name, "")
	cancel()
	if err := <-res; status.Code(err) != codes.Canceled {
		t.Fatalf("Call: %v", err)
	}
	if _, err := e.store.Get(context.Background(), name); err != nil {
		t.Errorf("the call is gone: %v", err)
	}
}

// TestPending: the node of a create under way, for a leader that learnt nothing: a call
// not yet taken or running counts, one taken beats one not taken, one the node refused
// does not count, nor a call of another method or target; Underway counts only calls
// not answered yet.
func TestPending(t *testing.T) {
	e := newEnv(t)
	e.nodes.setLimit(time.Hour)
	if n, ok := e.ch.Pending("CreateVolume", "local.1"); ok {
		t.Fatalf("no call yet, pending on %s", n)
	}
	req := createReq("pvc-1")
	// On a first: taken, still running when its caller gave up (ABORTED), so nothing
	// deletes it when its answer comes.
	onA := nameOf(t, "a", "CreateVolume", req)
	res := e.call("a", "CreateVolume", "local.1", req)
	e.cached(t, onA, "")
	e.settle(t, 3)
	e.answer(t, onA, running)
	e.clock.Step(time.Minute)
	if r := <-res; status.Code(r.err) != codes.Aborted {
		t.Fatalf("at the budget: %v", r.err)
	}
	// Then on b, not taken.
	onB := nameOf(t, "b", "CreateVolume", req)
	resB := e.call("b", "CreateVolume", "local.1", req)
	e.cached(t, onB, "")
	if n, ok := e.ch.Pending("CreateVolume", "local.1"); !ok || n != "a" {
		t.Errorf("taken on a, not yet on b: %q %v", n, ok)
	}
	for _, other := range [][2]string{{"DeleteVolume", "local.1"}, {"CreateVolume", "local.2"}} {
		if n, ok := e.ch.Pending(other[0], other[1]); ok {
			t.Errorf("%v: pending on %s", other, n)
		}
	}
	// a refused it: nothing was made there, and b's call stands.
	e.answer(t, onA, done(codes.ResourceExhausted, "full", ""))
	if c := e.cached(t, onA, ""); !c.Answered() {
		t.Fatalf("a's answer not seen: %+v", c.Status)
	}
	if n, ok := e.ch.Pending("CreateVolume", "local.1"); !ok || n != "b" {
		t.Errorf("a refused: %q %v", n, ok)
	}
	if n, ok := e.ch.Underway("CreateVolume", "local.1"); !ok || n != "b" {
		t.Errorf("under way on b: %q %v", n, ok)
	}
	// b made it: no longer under way (its caller saw the answer in the cache, and the
	// call is answered there or deleted).
	e.answer(t, onB, done(codes.OK, "", `{"volume":{"volumeId":"local.1"}}`))
	if r := <-resB; r.err != nil {
		t.Fatalf("b's answer: %v", r.err)
	}
	if n, ok := e.ch.Underway("CreateVolume", "local.1"); ok {
		t.Errorf("answered, still under way on %s", n)
	}
}
