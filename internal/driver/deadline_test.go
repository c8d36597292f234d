package driver

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestAnswerInTime(t *testing.T) {
	for _, c := range []struct{ remaining, margin time.Duration }{
		{60 * time.Second, time.Second},
		{5 * time.Second, 500 * time.Millisecond},
		{100 * time.Millisecond, 10 * time.Millisecond},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), c.remaining)
		caller, _ := ctx.Deadline()
		var got time.Time
		_, _ = answerInTime(ctx, nil, nil, func(ctx context.Context, _ any) (any, error) {
			got, _ = ctx.Deadline()
			return nil, nil
		})
		cancel()
		if m := caller.Sub(got); m < c.margin-5*time.Millisecond || m > c.margin+5*time.Millisecond {
			t.Errorf("%s left: the handler's deadline is %s before the caller's, want %s", c.remaining, m, c.margin)
		}
	}
	_, _ = answerInTime(context.Background(), nil, nil, func(ctx context.Context, _ any) (any, error) {
		if _, ok := ctx.Deadline(); ok {
			t.Error("a call without a deadline got one")
		}
		return nil, nil
	})
}

// TestAnswerInTimeWhenStuck: a handler stuck where no context reaches it (a
// blocked system call) does not keep the caller waiting past its deadline.
func TestAnswerInTimeWhenStuck(t *testing.T) {
	// 2 s leaves a 200 ms margin, 100 ms of it for the timer to fire late: at 200 ms
	// (a 10 ms slack) the test failed on a loaded 2-core machine.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	caller, _ := ctx.Deadline()
	release := make(chan struct{})
	defer close(release)
	_, err := answerInTime(ctx, nil, nil, func(context.Context, any) (any, error) {
		<-release // ignores its context, as a blocked open(2) does
		return nil, nil
	})
	if time.Now().After(caller) {
		t.Fatalf("answered %s after the caller's deadline", time.Since(caller))
	}
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "does not answer") {
		t.Fatalf("answer of a stuck call: %v, want DEADLINE_EXCEEDED saying what it waits for", err)
	}
}
