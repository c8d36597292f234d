package driver

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// maxAnswerMargin bounds answerMargin.
const maxAnswerMargin = time.Second

// answerMargin is how long before the caller's deadline a call stops waiting
// (for a lock, a stuck filesystem) so that its answer, with the reason, still
// reaches the caller in time: the server's copy of the deadline is the
// caller's, and an answer sent at that instant arrives after the caller gave
// up with a bare "context deadline exceeded". A tenth of the time the call
// has, at most a second.
func answerMargin(remaining time.Duration) time.Duration {
	return min(remaining/10, maxAnswerMargin)
}

// answerInTime makes every call with a deadline answer within it. The handler
// gets a deadline answerMargin ahead of the caller's, and every wait it can
// bound (locks, commands) ends there with its own reason. A filesystem call
// can block where no context reaches it: on a shared pool, while the server
// waits for a client that died (CephFS, until the MDS gives up on it). If the
// handler has not returned half a margin later, the caller is answered
// DEADLINE_EXCEEDED saying so, and the handler finishes in the background
// (its context is cancelled when the call ends, so it stops at its next
// wait). Its per-volume guard stays held until then, so a retry of the same
// volume is told ABORTED "busy" instead of racing it, and finds its result.
func answerInTime(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	return answerBy(ctx, req, info, handler, timerAt)
}

// timerAt is a timer that fires at at, and its stop.
func timerAt(at time.Time) (<-chan time.Time, func() bool) {
	t := time.NewTimer(time.Until(at))
	return t.C, t.Stop
}

// answerBy is answerInTime whose answer of a stuck handler waits for
// answerTimer (the tests fire it themselves).
func answerBy(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler, answerTimer func(time.Time) (<-chan time.Time, func() bool)) (any, error) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return handler(ctx, req)
	}
	margin := answerMargin(time.Until(deadline))
	hctx, cancel := context.WithDeadline(ctx, deadline.Add(-margin))
	type result struct {
		resp any
		err  error
	}
	done := make(chan result, 1)
	go func() {
		defer cancel()
		resp, err := handler(hctx, req)
		done <- result{resp, err}
	}()
	fired, stop := answerTimer(deadline.Add(-margin / 2))
	defer stop()
	select {
	case r := <-done:
		return r.resp, r.err
	case <-fired:
		method := "the call"
		if info != nil {
			method = info.FullMethod
		}
		return nil, status.Errorf(codes.DeadlineExceeded, "%s did not finish within its deadline: it is waiting on the pool's filesystem, which does not answer "+
			"(on a shared pool, a node that died holding what this call needs, until the server evicts it: docs/pools.md); "+
			"it goes on in the background, and a retry finds its result", method)
	}
}
