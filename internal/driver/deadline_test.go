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
// blocked system call) does not keep the caller waiting past its deadline:
// the answer's timer is set between the handler's deadline and the caller's,
// and when it fires the caller is answered. The test fires the timer itself,
// so no clock decides whether it passes.
func TestAnswerInTimeWhenStuck(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	caller, _ := ctx.Deadline()
	release := make(chan struct{})
	defer close(release)
	handlerDeadline := make(chan time.Time, 1)
	fire := make(chan time.Time)
	var at time.Time
	_, err := answerBy(ctx, nil, nil, func(ctx context.Context, _ any) (any, error) {
		d, _ := ctx.Deadline()
		handlerDeadline <- d
		<-release // ignores its context, as a blocked open(2) does
		return nil, nil
	}, func(t time.Time) (<-chan time.Time, func() bool) {
		at = t
		go func() { fire <- t }()
		return fire, func() bool { return true }
	})
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "does not answer") {
		t.Fatalf("answer of a stuck call: %v, want DEADLINE_EXCEEDED saying what it waits for", err)
	}
	if hd := <-handlerDeadline; !at.After(hd) || !at.Before(caller) {
		t.Fatalf("answer timer at %s: want after the handler's deadline %s and before the caller's %s", at, hd, caller)
	}
}
