package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// A call is for one node: another node's call, or a method off the allow-list, is never
// run and never answered, whoever wrote it.
func TestNeverAnotherNodesCall(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	w := e.worker(t)
	other := e.call(t, "a", "DeleteVolume", "local.x", deleteReq("local.x"), start)
	// A method off the list, written by hand past the CRD's enum.
	odd := e.call(t, "b", "DeleteVolume", "local.y", deleteReq("local.y"), start)
	u, _ := e.client.Resource(nodecall.CallsResource).Namespace("poolcsi").Get(ctx, odd.Name, metav1GetOptions)
	_ = unstructuredSet(u.Object, "NodePublishVolume", "spec", "method")
	if _, err := e.client.Resource(nodecall.CallsResource).Namespace("poolcsi").Update(ctx, u, metav1UpdateOptions); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{"local.x", "local.y"} {
		if more, err := w.Step(ctx, target); more || err != nil {
			t.Errorf("Step(%s) = %v, %v", target, more, err)
		}
	}
	if got := e.srv.asked(); len(got) != 0 {
		t.Errorf("invoked %v", got)
	}
	for _, name := range []string{other.Name, odd.Name} {
		if st := e.get(t, name).Status; st != (nodecall.CallStatus{}) {
			t.Errorf("%s answered: %+v", name, st)
		}
	}
}

// The Running write, conditional on the version read, comes before the invoke; the
// answer is the node's, with its code.
func TestCommitPointThenAnswer(t *testing.T) {
	for _, tc := range []struct {
		name     string
		answer   error
		wantCode codes.Code
	}{
		{"ok", nil, codes.OK},
		{"not found", status.Error(codes.NotFound, "volume local.v not found"), codes.NotFound},
		{"resource exhausted", status.Error(codes.ResourceExhausted, "pool full"), codes.ResourceExhausted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, "b")
			c := e.call(t, "b", "CreateVolume", "local.v", &csi.CreateVolumeRequest{Name: "pvc-1", Secrets: map[string]string{"s": "x"}}, start)
			var seen nodecall.CallStatus
			e.srv.handle = func(ctx context.Context, method string, req proto.Message) (proto.Message, error) {
				seen = e.get(t, c.Name).Status // what the API server holds while the node works
				if tc.answer != nil {
					return nil, tc.answer
				}
				return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: "local.v", CapacityBytes: 5}}, nil
			}
			var pokes atomic.Int32
			w := e.worker(t)
			w.changed = func() { pokes.Add(1) }
			if _, err := w.Step(ctx, "local.v"); err != nil {
				t.Fatal(err)
			}
			if seen.Phase != nodecall.Running || seen.Nonce != c.Spec.Nonce || seen.Attempts != 1 || seen.Started == nil {
				t.Errorf("status during the invoke: %+v", seen)
			}
			st := e.get(t, c.Name).Status
			if st.Phase != nodecall.Done || st.Nonce != c.Spec.Nonce || codes.Code(st.Code) != tc.wantCode || st.Attempts != 1 || st.Finished == nil {
				t.Errorf("answer: %+v", st)
			}
			if tc.answer != nil {
				if st.Message != status.Convert(tc.answer).Message() || st.Response != "" || pokes.Load() != 0 {
					t.Errorf("error answer: %+v, pokes %d", st, pokes.Load())
				}
				return
			}
			m, _ := nodecall.Lookup("CreateVolume")
			resp, err := m.DecodeResponse(st.Response)
			if err != nil || resp.(*csi.CreateVolumeResponse).GetVolume().GetVolumeId() != "local.v" {
				t.Errorf("response %q: %v", st.Response, err)
			}
			if pokes.Load() != 1 {
				t.Errorf("capacity prompted %d times after a create, want 1", pokes.Load())
			}
			if req := e.srv.reqs[0].(*csi.CreateVolumeRequest); req.GetName() != "pvc-1" || len(req.GetSecrets()) != 0 {
				t.Errorf("node asked %v", req)
			}
			// Answered: a second pass runs nothing.
			if _, err := w.Step(ctx, "local.v"); err != nil || len(e.srv.asked()) != 1 {
				t.Errorf("second pass: %v, asked %v", err, e.srv.asked())
			}
		})
	}
}

// A worker that read a call before someone else changed or deleted it loses the commit
// point and invokes nothing.
func TestConflictNoInvoke(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, e *env, c *nodecall.Call)
	}{
		{"taken by another agent", func(t *testing.T, e *env, c *nodecall.Call) {
			r := c.DeepCopy()
			r.Status = nodecall.CallStatus{Nonce: c.Spec.Nonce, Phase: nodecall.Running, Attempts: 1}
			if _, err := e.store.UpdateStatus(context.Background(), r); err != nil {
				t.Fatal(err)
			}
		}},
		{"deleted by the sweeper", func(t *testing.T, e *env, c *nodecall.Call) {
			if err := e.store.Delete(context.Background(), c.Name, c.ResourceVersion); err != nil {
				t.Fatal(err)
			}
		}},
		{"deleted and made again", func(t *testing.T, e *env, c *nodecall.Call) {
			if err := e.store.Delete(context.Background(), c.Name, ""); err != nil {
				t.Fatal(err)
			}
			again := c.DeepCopy()
			again.ResourceVersion, again.UID, again.Spec.Nonce = "", "", nodecall.NewNonce()
			if _, err := e.store.Create(context.Background(), again); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, "b")
			c := e.call(t, "b", "DeleteVolume", "local.v", deleteReq("local.v"), start)
			stale := e.get(t, c.Name)
			tc.change(t, e, c)
			w := e.worker(t)
			w.calls = func(string) []*nodecall.Call { return []*nodecall.Call{stale} } // a cache that lags
			if _, err := w.Step(ctx, "local.v"); err != nil {
				t.Fatal(err)
			}
			if got := e.srv.asked(); len(got) != 0 {
				t.Errorf("invoked %v on a stale read", got)
			}
		})
	}
}

// A call a dead predecessor left Running runs again, attempts 2; so does one whose answer
// another nonce holds.
func TestRunningAtRestartRunsAgain(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	c := e.call(t, "b", "DeleteVolume", "local.v", deleteReq("local.v"), start)
	r := c.DeepCopy()
	r.Status = nodecall.CallStatus{Nonce: c.Spec.Nonce, Phase: nodecall.Running, Attempts: 1}
	if _, err := e.store.UpdateStatus(ctx, r); err != nil {
		t.Fatal(err)
	}
	w := e.worker(t) // a new process
	if _, err := w.Step(ctx, "local.v"); err != nil {
		t.Fatal(err)
	}
	if st := e.get(t, c.Name).Status; st.Phase != nodecall.Done || st.Attempts != 2 || len(e.srv.asked()) != 1 {
		t.Errorf("status %+v, asked %v", st, e.srv.asked())
	}

	d := e.call(t, "b", "DeleteVolume", "local.w", deleteReq("local.w"), start)
	old := d.DeepCopy()
	old.Status = nodecall.CallStatus{Nonce: "an-older-call", Phase: nodecall.Done, Attempts: 3}
	if _, err := e.store.UpdateStatus(ctx, old); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Step(ctx, "local.w"); err != nil {
		t.Fatal(err)
	}
	if st := e.get(t, d.Name).Status; st.Phase != nodecall.Done || st.Nonce != d.Spec.Nonce || st.Attempts != 1 {
		t.Errorf("another nonce's answer: status %+v", st)
	}
}

// The calls of one target run one at a time, first issued first, whatever their names.
func TestFIFOByIssued(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	sizes := []int64{3, 1, 2} // issued third, first, second
	for _, s := range sizes {
		e.call(t, "b", "ControllerExpandVolume", "local.v", &csi.ControllerExpandVolumeRequest{VolumeId: "local.v", CapacityRange: &csi.CapacityRange{RequiredBytes: s}}, start.Add(time.Duration(s)*time.Millisecond))
	}
	e.call(t, "b", "DeleteVolume", "local.other", deleteReq("local.other"), start) // another target
	w := e.worker(t)
	var steps int
	for more := true; more; steps++ {
		var err error
		if more, err = w.Step(ctx, "local.v"); err != nil {
			t.Fatal(err)
		}
	}
	var got []int64
	for _, r := range e.srv.reqs {
		got = append(got, r.(*csi.ControllerExpandVolumeRequest).GetCapacityRange().GetRequiredBytes())
	}
	if !slices.Equal(got, []int64{1, 2, 3}) || steps != 3 {
		t.Errorf("ran %v in %d steps, want [1 2 3] in 3", got, steps)
	}
}

// notAfter is judged by the agent's clock with ExpiryMargin: past it, the call is
// answered ABORTED without being invoked.
func TestNotAfter(t *testing.T) {
	for _, tc := range []struct {
		name    string
		elapsed time.Duration // since notAfter
		runs    bool
	}{
		{"before", -time.Minute, true},
		{"within the margin", ExpiryMargin - time.Second, true},
		{"past the margin", ExpiryMargin + time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, "b")
			c := e.call(t, "b", "DeleteVolume", "local.v", deleteReq("local.v"), start)
			e.clock.SetTime(c.Spec.NotAfter.Add(tc.elapsed))
			if _, err := e.worker(t).Step(ctx, "local.v"); err != nil {
				t.Fatal(err)
			}
			st := e.get(t, c.Name).Status
			if ran := len(e.srv.asked()) == 1; ran != tc.runs {
				t.Fatalf("invoked: %v, want %v", ran, tc.runs)
			}
			if !tc.runs && (st.Phase != nodecall.Done || codes.Code(st.Code) != codes.Aborted || !strings.Contains(st.Message, "expired before it started") || st.Attempts != 0) {
				t.Errorf("expired call: %+v", st)
			}
		})
	}
}

// An answer whose call was deleted, or deleted and made again (another nonce), while it
// ran is dropped: the new call's status is not touched.
func TestStaleAnswerDropped(t *testing.T) {
	for _, remake := range []bool{false, true} {
		t.Run(map[bool]string{false: "deleted", true: "made again"}[remake], func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, "b")
			c := e.call(t, "b", "DeleteVolume", "local.v", deleteReq("local.v"), start)
			var again *nodecall.Call
			e.srv.handle = func(ctx context.Context, method string, req proto.Message) (proto.Message, error) {
				if err := e.store.Delete(ctx, c.Name, ""); err != nil {
					t.Error(err)
				}
				if remake {
					n := c.DeepCopy()
					n.ResourceVersion, n.UID, n.Spec.Nonce = "", "", nodecall.NewNonce()
					var err error
					if again, err = e.store.Create(ctx, n); err != nil {
						t.Error(err)
					}
				}
				return &csi.DeleteVolumeResponse{}, nil
			}
			if _, err := e.worker(t).Step(ctx, "local.v"); err != nil {
				t.Fatal(err)
			}
			got, err := e.store.Get(ctx, c.Name)
			switch {
			case !remake && !apierrors.IsNotFound(err):
				t.Errorf("deleted call: %+v %v", got, err)
			case remake && (err != nil || got.Status != (nodecall.CallStatus{}) || got.Spec.Nonce != again.Spec.Nonce):
				t.Errorf("the new call's status was written: %+v %v", got, err)
			}
		})
	}
}

// A request that does not decode is answered INVALID_ARGUMENT without an invoke; a modify
// makes the node re-apply I/O limits at once.
func TestBadRequestAndKick(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	var kicks atomic.Int32
	e.deps.Kick = func() { kicks.Add(1) }
	bad := e.call(t, "b", "DeleteVolume", "local.v", deleteReq("local.v"), start)
	u, _ := e.client.Resource(nodecall.CallsResource).Namespace("poolcsi").Get(ctx, bad.Name, metav1GetOptions)
	_ = unstructuredSet(u.Object, `{"volumeId":5}`, "spec", "request") // a field of the wrong type
	if _, err := e.client.Resource(nodecall.CallsResource).Namespace("poolcsi").Update(ctx, u, metav1UpdateOptions); err != nil {
		t.Fatal(err)
	}
	mod := e.call(t, "b", "ControllerModifyVolume", "local.m", &csi.ControllerModifyVolumeRequest{VolumeId: "local.m", MutableParameters: map[string]string{"readIOPS": "5"}}, start)
	w := e.worker(t)
	for _, target := range []string{"local.v", "local.m"} {
		if _, err := w.Step(ctx, target); err != nil {
			t.Fatal(err)
		}
	}
	if st := e.get(t, bad.Name).Status; codes.Code(st.Code) != codes.InvalidArgument || st.Phase != nodecall.Done {
		t.Errorf("bad request: %+v", st)
	}
	if got := e.srv.asked(); !slices.Equal(got, []string{"ControllerModifyVolume"}) || kicks.Load() != 1 {
		t.Errorf("asked %v, kicks %d", got, kicks.Load())
	}
	if st := e.get(t, mod.Name).Status; st.Phase != nodecall.Done || st.Code != 0 {
		t.Errorf("modify: %+v", st)
	}
}

// A ListSnapshots answer is cut to fit a call, with the token to the first entry left
// out; small entries, whose protojson is several times their wire size, included.
func TestListPageCut(t *testing.T) {
	for _, tc := range []struct {
		name  string
		count int
		entry func(i int) *csi.Snapshot
	}{
		{"long IDs", 3000, func(i int) *csi.Snapshot {
			return &csi.Snapshot{SnapshotId: fmt.Sprintf("local@%064d", i), SourceVolumeId: "local." + strings.Repeat("f", 64), ReadyToUse: true, SizeBytes: 1 << 30}
		}},
		{"small entries", 8000, func(i int) *csi.Snapshot {
			return &csi.Snapshot{SnapshotId: fmt.Sprintf("l@%d", i), SourceVolumeId: "l.v", ReadyToUse: true, SizeBytes: 1 << 40,
				CreationTime: timestamppb.New(start), GroupSnapshotId: "l@g"}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var entries []*csi.ListSnapshotsResponse_Entry
			for i := range tc.count {
				entries = append(entries, &csi.ListSnapshotsResponse_Entry{Snapshot: tc.entry(i)})
			}
			l := &csi.ListSnapshotsResponse{Entries: slices.Clone(entries)}
			cutPage(l)
			m, _ := nodecall.Lookup("ListSnapshots")
			if _, err := m.EncodeResponse(l); err != nil {
				t.Fatal(err)
			}
			n := len(l.Entries)
			if n == 0 || n == len(entries) || l.NextToken != entries[n].GetSnapshot().GetSnapshotId() {
				t.Errorf("cut to %d of %d, token %q", n, len(entries), l.NextToken)
			}
		})
	}
	small := &csi.ListSnapshotsResponse{Entries: []*csi.ListSnapshotsResponse_Entry{{Snapshot: &csi.Snapshot{SnapshotId: "l@1"}}}, NextToken: "l@2"}
	cutPage(small)
	if len(small.Entries) != 1 || small.NextToken != "l@2" {
		t.Errorf("a small page changed: %v", small)
	}
}

// The runner end to end, through the informer: a call made is answered; the runner stops
// with its context.
func TestRunAnswersThroughTheInformer(t *testing.T) {
	e := newEnv(t, "b")
	e.deps.Clock = nil // the workqueue and informer run on real time
	w, _ := New(e.deps)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	c := e.call(t, "b", "DeleteVolume", "local.v", deleteReq("local.v"), time.Now())
	e.call(t, "a", "DeleteVolume", "local.a", deleteReq("local.a"), time.Now())
	err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		return e.get(t, c.Name).Answered(), nil
	})
	if err != nil {
		t.Fatalf("not answered: %v (%+v)", err, e.get(t, c.Name).Status)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	if got := e.srv.asked(); !slices.Equal(got, []string{"DeleteVolume"}) {
		t.Errorf("asked %v", got)
	}
}

// A node's message longer than a call holds is cut, never inside a character.
func TestLongMessageCut(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	e.srv.handle = func(context.Context, string, proto.Message) (proto.Message, error) {
		return nil, status.Error(codes.Internal, "x"+strings.Repeat("é", nodecall.MaxMessage))
	}
	c := e.call(t, "b", "DeleteVolume", "local.v", deleteReq("local.v"), start)
	if _, err := e.worker(t).Step(ctx, "local.v"); err != nil {
		t.Fatal(err)
	}
	st := e.get(t, c.Name).Status
	if codes.Code(st.Code) != codes.Internal || len(st.Message) > nodecall.MaxMessage || len(st.Message) < nodecall.MaxMessage-1 || !utf8.ValidString(st.Message) {
		t.Errorf("message of %d bytes, valid UTF-8 %v", len(st.Message), utf8.ValidString(st.Message))
	}
}

// Through the runner: at most Workers targets run at once, one target's calls never run
// together, and they run in the order issued.
func TestRunWorkersAndTargets(t *testing.T) {
	e := newEnv(t, "b")
	e.deps.Clock = nil
	e.deps.Workers = 2
	var mu sync.Mutex
	inflight, most := 0, 0
	perTarget := map[string]int{}
	var order []string
	release := make(chan struct{})
	e.srv.handle = func(_ context.Context, _ string, req proto.Message) (proto.Message, error) {
		r := req.(*csi.ControllerExpandVolumeRequest)
		mu.Lock()
		inflight++
		most = max(most, inflight)
		perTarget[r.GetVolumeId()]++
		if perTarget[r.GetVolumeId()] > 1 {
			t.Errorf("two calls of %s at once", r.GetVolumeId())
		}
		order = append(order, fmt.Sprintf("%s/%d", r.GetVolumeId(), r.GetCapacityRange().GetRequiredBytes()))
		mu.Unlock()
		<-release
		mu.Lock()
		inflight--
		perTarget[r.GetVolumeId()]--
		mu.Unlock()
		return &csi.ControllerExpandVolumeResponse{}, nil
	}
	var calls []*nodecall.Call
	now := time.Now()
	for _, size := range []int64{2, 1} { // the second issued first
		for _, v := range []string{"local.a", "local.b", "local.c"} {
			calls = append(calls, e.call(t, "b", "ControllerExpandVolume", v,
				&csi.ControllerExpandVolumeRequest{VolumeId: v, CapacityRange: &csi.CapacityRange{RequiredBytes: size}}, now.Add(time.Duration(size)*time.Second)))
		}
	}
	w, _ := New(e.deps)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	poll := func(what string, cond func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) { return cond(), nil }); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	poll("two calls running", func() bool { mu.Lock(); defer mu.Unlock(); return inflight == 2 })
	close(release)
	poll("every call answered", func() bool {
		for _, c := range calls {
			if !e.get(t, c.Name).Answered() {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	if most != 2 {
		t.Errorf("at most %d calls at once, want 2", most)
	}
	for _, v := range []string{"local.a", "local.b", "local.c"} {
		if i, j := slices.Index(order, v+"/1"), slices.Index(order, v+"/2"); i < 0 || j < i {
			t.Errorf("%s ran in the order %v", v, order)
		}
	}
}
