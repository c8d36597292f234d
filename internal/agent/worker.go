package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// ExpiryMargin is how long past a call's notAfter, by the agent's clock, the agent still
// starts it: notAfter is written by the controller's clock, and the two are never
// compared closer than this. It is an orphan guard, never what safety rests on.
const ExpiryMargin = 60 * time.Second

// resync is how often the informer hands every call of this node in again: a call whose
// answer could not be written is tried again at the latest then.
const resync = 5 * time.Minute

// writeTimeout bounds a status write made after the server's context ended: an answer to
// a call that ran is still worth writing while the process stops.
const writeTimeout = 10 * time.Second

const targetIndex = "target"

// Worker runs this node's calls: per target, in the order the controller issued them, at
// most Deps.Workers targets at once.
//
// The commit point is the status write {nonce, Running, attempts+1}, conditional on the
// resourceVersion read: the call is invoked only after that write succeeded, so of two
// agents (an old one and its successor) or an agent and the sweeper, exactly one goes on.
type Worker struct {
	deps    Deps
	changed func() // a call may have changed a pool's free space

	// calls lists the calls of one target (the informer's index; tests set their own).
	calls func(target string) []*nodecall.Call

	mu sync.Mutex
	// answered holds the nonce of each call this process answered, by name: the informer
	// may still show it Running, and it must not run again for that.
	answered map[string]string
}

func newWorker(deps Deps, changed func()) *Worker {
	return &Worker{deps: deps, changed: changed, answered: map[string]string{}}
}

// Run watches this node's calls and runs them until ctx ends. A call under way when ctx
// ends is an RPC on the socket, which the server's graceful stop lets finish; Run returns
// once its answer is written.
func (w *Worker) Run(ctx context.Context) error {
	log := klog.FromContext(ctx).WithValues("node", w.deps.Node)
	ctx = klog.NewContext(ctx, log)
	inf := w.deps.Calls.Informer(w.deps.Node, resync)
	if err := inf.AddIndexers(cache.Indexers{targetIndex: func(obj any) ([]string, error) {
		if c := nodecall.FromCache(obj); c != nil {
			return []string{c.Spec.Target}, nil
		}
		return nil, nil
	}}); err != nil {
		return fmt.Errorf("indexing calls by target: %w", err)
	}
	queue := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
	defer queue.ShutDown()
	enqueue := func(obj any) {
		if c := nodecall.FromCache(obj); c != nil && w.mine(ctx, c) {
			queue.Add(c.Spec.Target)
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: func(obj any) {
			if c := nodecall.FromCache(obj); c != nil {
				w.forget(c.Name)
			}
		},
	}); err != nil {
		return fmt.Errorf("watching calls: %w", err)
	}
	w.calls = func(target string) []*nodecall.Call {
		objs, err := inf.GetIndexer().ByIndex(targetIndex, target)
		if err != nil {
			return nil
		}
		out := make([]*nodecall.Call, 0, len(objs))
		for _, o := range objs {
			if c := nodecall.FromCache(o); c != nil {
				out = append(out, c)
			}
		}
		return out
	}
	go inf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return nil // ctx ended
	}
	log.Info("Taking this node's PoolCalls", "workers", w.deps.Workers)
	var wg sync.WaitGroup
	for range w.deps.Workers {
		wg.Go(func() {
			wait.UntilWithContext(ctx, func(ctx context.Context) {
				for w.next(ctx, queue) {
				}
			}, time.Second)
		})
	}
	<-ctx.Done()
	queue.ShutDown()
	wg.Wait()
	return nil
}

// next takes one target off the queue and runs its first call; false when the queue is
// shut down. The queue never hands one target to two workers at once.
func (w *Worker) next(ctx context.Context, queue workqueue.TypedRateLimitingInterface[string]) bool {
	target, shutdown := queue.Get()
	if shutdown {
		return false
	}
	defer queue.Done(target)
	more, err := w.Step(ctx, target)
	switch {
	case err != nil:
		klog.FromContext(ctx).Error(err, "PoolCall not answered; trying again", "target", target)
		queue.AddRateLimited(target)
	case more:
		queue.Forget(target)
		queue.Add(target)
	default:
		queue.Forget(target)
	}
	return ctx.Err() == nil
}

// mine reports whether c is for this node and of an allowed method: anything else is
// ignored, whoever wrote it.
func (w *Worker) mine(ctx context.Context, c *nodecall.Call) bool {
	if c.Spec.Node != w.deps.Node {
		klog.FromContext(ctx).V(4).Info("Ignoring another node's PoolCall", "call", c.Name, "callNode", c.Spec.Node)
		return false
	}
	if _, ok := nodecall.Lookup(c.Spec.Method); !ok {
		klog.FromContext(ctx).Info("Ignoring a PoolCall of a method the agent does not run", "call", c.Name, "method", c.Spec.Method)
		return false
	}
	return true
}

func (w *Worker) forget(name string) {
	w.mu.Lock()
	delete(w.answered, name)
	w.mu.Unlock()
}

// pending returns the calls of target this node has to run, first issued first.
func (w *Worker) pending(ctx context.Context, target string) []*nodecall.Call {
	var out []*nodecall.Call
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.calls(target) {
		if c.Spec.Target != target || !w.mine(ctx, c) || c.DeletionTimestamp != nil || c.Answered() {
			continue
		}
		if nonce, ok := w.answered[c.Name]; ok && nonce == c.Spec.Nonce {
			continue
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b *nodecall.Call) int {
		if c := a.Spec.Issued.Compare(b.Spec.Issued.Time); c != 0 {
			return c
		}
		return compareStrings(a.Name, b.Name)
	})
	return out
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Step runs the first pending call of target, and reports whether more wait behind it
// to be run now. An error is a call whose answer was not written (it runs again later).
// A call that lost its commit point is no error, and nothing behind it is run: its newer
// version comes with the next event and is judged then.
func (w *Worker) Step(ctx context.Context, target string) (more bool, err error) {
	calls := w.pending(ctx, target)
	if len(calls) == 0 || ctx.Err() != nil {
		return false, nil
	}
	answered, err := w.runCall(ctx, calls[0])
	return len(calls) > 1 && answered, err
}

// runCall takes c through the commit point, invokes it and writes the answer; it reports
// whether c is answered (or its answer dropped as stale); false with no error is a call
// that changed before its commit point.
func (w *Worker) runCall(ctx context.Context, c *nodecall.Call) (bool, error) {
	log := klog.FromContext(ctx).WithValues("call", c.Name, "method", c.Spec.Method, "target", c.Spec.Target)
	ctx = klog.NewContext(ctx, log)
	m, _ := nodecall.Lookup(c.Spec.Method) // pending kept allowed methods only
	now := w.deps.Clock.Now()

	if now.After(c.Spec.NotAfter.Add(ExpiryMargin)) {
		log.Info("PoolCall expired before it started; not running it", "notAfter", c.Spec.NotAfter)
		return w.answer(ctx, c, c.Spec.Nonce, codes.Aborted, "expired before it started (notAfter "+c.Spec.NotAfter.UTC().Format(time.RFC3339)+")", "")
	}
	req, decodeErr := m.DecodeRequest(c.Spec.Request)

	// The commit point: nothing runs unless this write, conditional on what was read,
	// succeeds. A conflict means the call changed (re-created, answered, taken); its new
	// version arrives as an event and is judged afresh.
	running := c.DeepCopy()
	attempts := int32(1)
	if c.Status.Nonce == c.Spec.Nonce {
		attempts = c.Status.Attempts + 1
	}
	started := metav1.NewTime(now)
	running.Status = nodecall.CallStatus{Nonce: c.Spec.Nonce, Phase: nodecall.Running, Attempts: attempts, Started: &started}
	running, err := w.deps.Calls.UpdateStatus(ctx, running)
	if err != nil {
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			log.V(2).Info("PoolCall changed before it started; not running this version", "reason", err.Error())
			return false, nil
		}
		return false, fmt.Errorf("marking PoolCall %s Running: %w", c.Name, err)
	}
	log.V(2).Info("Running PoolCall", "attempt", attempts)

	var code codes.Code
	var msg, response string
	if decodeErr != nil {
		code, msg = codes.InvalidArgument, "the PoolCall's request is not a "+m.Name+" request: "+decodeErr.Error()
	} else {
		code, msg, response = w.invoke(ctx, m, req)
	}
	// The answer is written even if the server's context ended meanwhile: the call ran.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeTimeout)
	defer cancel()
	settled, err := w.answer(wctx, running, c.Spec.Nonce, code, msg, response)
	if code == codes.OK {
		if m.ChangesSpace && w.changed != nil {
			w.changed()
		}
		if m.Name == "ControllerModifyVolume" && w.deps.Kick != nil {
			w.deps.Kick()
		}
	}
	return settled, err
}

// invoke replays the call on this node's own socket.
func (w *Worker) invoke(ctx context.Context, m nodecall.Method, req proto.Message) (codes.Code, string, string) {
	ictx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.deps.CallTimeout)
	defer cancel()
	resp := m.NewResponse()
	if err := w.deps.Conn.Invoke(ictx, m.FullMethod, req, resp); err != nil {
		st := status.Convert(err)
		if st.Code() == codes.OK { // not a status: the socket failed
			return codes.Unavailable, err.Error(), ""
		}
		return st.Code(), st.Message(), ""
	}
	if l, ok := resp.(*csi.ListSnapshotsResponse); ok {
		cutPage(l)
	}
	text, err := m.EncodeResponse(resp)
	if err != nil {
		return codes.Internal, "the node's answer does not fit a PoolCall: " + err.Error(), ""
	}
	return codes.OK, "", text
}

// cutPage cuts a ListSnapshots page to fit a call (nodecall.ListPage of protojson), with
// a next_token to the first entry left out (the driver's tokens are the ID of the first
// snapshot of the next page). Each entry is measured as it is written.
func cutPage(l *csi.ListSnapshotsResponse) {
	size := 64 // the braces, the field names and the token
	for i, e := range l.Entries {
		b, err := protojson.Marshal(e)
		size += len(b) + 1
		if (err != nil || size > nodecall.ListPage) && i > 0 {
			l.NextToken = e.GetSnapshot().GetSnapshotId()
			l.Entries = l.Entries[:i]
			return
		}
	}
}

// answer writes {nonce, Done, code, message, response} over c's status, conditional on
// c's resourceVersion. On a conflict it reads the call again and writes again only if it
// is still the call that ran (same nonce): otherwise the answer is stale and dropped.
func (w *Worker) answer(ctx context.Context, c *nodecall.Call, nonce string, code codes.Code, msg, response string) (bool, error) {
	log := klog.FromContext(ctx)
	msg = cut(msg, nodecall.MaxMessage)
	finished := metav1.NewTime(w.deps.Clock.Now())
	cur := c
	for range 3 {
		done := cur.DeepCopy()
		done.Status = nodecall.CallStatus{Nonce: nonce, Phase: nodecall.Done, Code: int32(code), Message: msg, Response: response,
			Attempts: c.Status.Attempts, Started: c.Status.Started, Finished: &finished}
		_, err := w.deps.Calls.UpdateStatus(ctx, done)
		if err == nil {
			w.mu.Lock()
			w.answered[c.Name] = nonce
			w.mu.Unlock()
			log.V(2).Info("Answered PoolCall", "code", code.String())
			return true, nil
		}
		if !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
			return false, fmt.Errorf("answering PoolCall %s: %w", c.Name, err)
		}
		if apierrors.IsConflict(err) {
			cur, err = w.deps.Calls.Get(ctx, c.Name)
		}
		if apierrors.IsNotFound(err) {
			log.Info("PoolCall deleted before its answer was written; dropping the answer", "code", code.String())
			return true, nil
		}
		if err != nil {
			return false, fmt.Errorf("reading PoolCall %s again: %w", c.Name, err)
		}
		if cur.Spec.Nonce != nonce {
			log.Info("PoolCall re-created while it ran; dropping the stale answer", "code", code.String())
			return true, nil
		}
	}
	return false, errors.New("answering PoolCall " + c.Name + ": conflicts on every try")
}

// cut shortens s to at most n bytes, never inside a UTF-8 character.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "")
}
