package central

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// The sweeper ages a call from when this process saw it in its state, never from what
// the call says (issued, started, finished are other clocks): Done for 10 min and not
// taken for 15 min are deleted, Running is left however long.
func TestSweeperAgesByObservation(t *testing.T) {
	for _, tc := range []struct {
		desc   string
		status func(c *nodecall.Call) nodecall.CallStatus
		// wait is how long after it was seen in its state the call is swept.
		wait time.Duration
	}{
		{"done", done(codes.OK, "", ""), DoneFor},
		{"done with an error", done(codes.NotFound, "gone", ""), DoneFor},
		{"not taken", nil, UntakenFor},
		{"another nonce's answer is not taken", func(c *nodecall.Call) nodecall.CallStatus {
			return nodecall.CallStatus{Nonce: "0123456789abcdef0123456789abcdef", Phase: nodecall.Done}
		}, UntakenFor},
		{"running", running, 0},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t)
			// Issued, started and finished a day ago by other clocks: no age comes from them.
			long := e.clock.Now().Add(-24 * time.Hour)
			c, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: "DeleteVolume", Target: "local.1", Request: deleteReq("local.1"), Issued: long, NotAfter: long})
			if err != nil {
				t.Fatal(err)
			}
			made, err := e.store.Create(ctx, c)
			if err != nil {
				t.Fatal(err)
			}
			e.cached(t, made.Name, made.ResourceVersion)
			e.judged(t, made.Name, "")
			if tc.status != nil {
				var state nodecall.Phase
				e.answer(t, made.Name, func(c *nodecall.Call) nodecall.CallStatus {
					st := tc.status(c)
					at := metav1.NewTime(long)
					st.Started, st.Finished = &at, &at
					state = stateOf(&nodecall.Call{Spec: c.Spec, Status: st})
					return st
				})
				e.judged(t, made.Name, state)
			}
			exists := func() bool {
				_, err := e.store.Get(ctx, made.Name)
				if err != nil && !apierrors.IsNotFound(err) {
					t.Fatal(err)
				}
				return err == nil
			}
			limit := tc.wait
			if limit == 0 {
				limit = 2 * RunningFor
			}
			e.clock.Step(limit - time.Second)
			e.sweep.Sweep(ctx)
			if !exists() {
				t.Fatalf("swept a second early")
			}
			e.clock.Step(time.Second)
			e.sweep.Sweep(ctx)
			if exists() == (tc.wait != 0) {
				t.Errorf("after %v: exists %v", limit, exists())
			}
		})
	}
}

// A state change restarts the age, and a sweep that judged a version the API server no
// longer holds deletes nothing (its delete is conditional on that version).
func TestSweeperPreconditions(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	c, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: "DeleteVolume", Target: "local.1", Request: deleteReq("local.1"), Issued: e.clock.Now(), NotAfter: e.clock.Now()})
	if err != nil {
		t.Fatal(err)
	}
	made, err := e.store.Create(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	e.cached(t, made.Name, made.ResourceVersion)
	e.judged(t, made.Name, "")
	e.clock.Step(UntakenFor - time.Minute)
	// Taken at last: Running restarts the age, and Done after it.
	e.answer(t, made.Name, running)
	e.judged(t, made.Name, nodecall.Running)
	e.clock.Step(time.Hour)
	e.answer(t, made.Name, done(codes.OK, "", ""))
	e.judged(t, made.Name, nodecall.Done)
	e.clock.Step(DoneFor - time.Second)
	e.sweep.Sweep(ctx)
	if _, err := e.store.Get(ctx, made.Name); err != nil {
		t.Fatalf("swept before its Done was 10 min old: %v", err)
	}
	// The informer stops: the sweeper's view lags the API server, where an agent
	// answers the call again meanwhile (a re-run after a restart).
	e.cancel()
	cur, err := e.store.Get(ctx, made.Name)
	if err != nil {
		t.Fatal(err)
	}
	cur.Status.Attempts++
	if _, err := e.store.UpdateStatus(ctx, cur); err != nil {
		t.Fatal(err)
	}
	e.clock.Step(time.Second)
	e.sweep.Sweep(ctx)
	if _, err := e.store.Get(ctx, made.Name); err != nil {
		t.Errorf("a version the sweeper never judged was deleted: %v", err)
	}
}
