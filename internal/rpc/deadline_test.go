package rpc

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	clocktesting "k8s.io/utils/clock/testing"
)

// callerContext is a call whose caller's deadline is remaining after clk's
// now. The context's own deadline is that instant of the wall clock too, but
// the margin and the answer are timed on clk alone, which only the test moves.
func callerContext(t *testing.T, clk *clocktesting.FakeClock, remaining time.Duration) (context.Context, time.Time) {
	deadline := clk.Now().Add(remaining)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	t.Cleanup(cancel)
	return ctx, deadline
}

func TestAnswerInTime(t *testing.T) {
	for _, c := range []struct{ remaining, margin time.Duration }{
		{time.Hour, time.Second},
		{60 * time.Second, time.Second},
		{5 * time.Second, 500 * time.Millisecond},
		{100 * time.Millisecond, 10 * time.Millisecond},
	} {
		clk := clocktesting.NewFakeClock(time.Now())
		ctx, caller := callerContext(t, clk, c.remaining)
		var got time.Time
		_, _ = answerInTime(clk)(ctx, nil, nil, func(ctx context.Context, _ any) (any, error) {
			got, _ = ctx.Deadline()
			return nil, nil
		})
		if m := caller.Sub(got); m != c.margin {
			t.Errorf("%s left: the handler's deadline is %s before the caller's, want %s", c.remaining, m, c.margin)
		}
	}
	_, _ = answerInTime(clocktesting.NewFakeClock(time.Now()))(context.Background(), nil, nil, func(ctx context.Context, _ any) (any, error) {
		if _, ok := ctx.Deadline(); ok {
			t.Error("a call without a deadline got one")
		}
		return nil, nil
	})
}

// TestAnswerInTimeWhenStuck: a handler stuck where no context reaches it (a
// blocked system call) does not keep the caller waiting past its deadline: the
// answer comes half a margin before it, by the server's clock. The clock is a
// fake one that only the test moves, so no timing on a loaded machine decides
// the result.
func TestAnswerInTimeWhenStuck(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	// A minute: the context's own wall-clock deadline never comes during the test.
	ctx, caller := callerContext(t, clk, time.Minute)
	answerAt := caller.Add(-AnswerMargin(time.Minute) / 2)
	release := make(chan struct{})
	defer close(release)
	answered := make(chan error, 1)
	go func() {
		_, err := answerInTime(clk)(ctx, nil, nil, func(context.Context, any) (any, error) {
			<-release // ignores its context, as a blocked open(2) does
			return nil, nil
		})
		answered <- err
	}()
	for !clk.HasWaiters() { // the interceptor's timer is set
		time.Sleep(time.Millisecond)
	}
	// The fake clock fires a timer in SetTime itself, so whether it fired is
	// known at once: no wait decides the result.
	clk.SetTime(answerAt.Add(-time.Nanosecond))
	if !clk.HasWaiters() {
		t.Fatalf("the answer came %s before half a margin ahead of the caller's deadline", answerAt.Sub(clk.Now()))
	}
	clk.SetTime(answerAt)
	if clk.HasWaiters() {
		t.Fatal("no answer due half a margin ahead of the caller's deadline")
	}
	err := <-answered
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "does not answer") {
		t.Fatalf("answer of a stuck call: %v, want DEADLINE_EXCEEDED saying what it waits for", err)
	}
}
