package rpc

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/utils/clock"
)

// maxAnswerMargin bounds AnswerMargin.
const maxAnswerMargin = time.Second

// AnswerMargin is how long before the caller's deadline a call stops waiting
// (for a lock, a stuck filesystem, another process's answer) so that its
// answer, with the reason, still reaches the caller in time: the server's copy
// of the deadline is the caller's, and an answer sent at that instant arrives
// after the caller gave up with a bare "context deadline exceeded". A tenth of
// the time the call has, at most a second.
func AnswerMargin(remaining time.Duration) time.Duration {
	return min(remaining/10, maxAnswerMargin)
}

// answerInTime makes every call with a deadline answer within it, the
// deadline read on clk. The handler gets a deadline AnswerMargin ahead of the
// caller's, and every wait it can bound (locks, commands) ends there with its
// own reason. A filesystem call can block where no context reaches it: on a
// shared pool, while the server waits for a client that died (CephFS, until
// the MDS gives up on it). If the handler has not returned half a margin
// later, the caller is answered DEADLINE_EXCEEDED saying so, and the handler
// finishes in the background (its context is cancelled when the call ends, so
// it stops at its next wait). Its per-volume guard stays held until then, so a
// retry of the same volume is told ABORTED "busy" instead of racing it, and
// finds its result.
func answerInTime(clk clock.Clock) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		deadline, ok := ctx.Deadline()
		if !ok {
			return handler(ctx, req)
		}
		margin := AnswerMargin(deadline.Sub(clk.Now()))
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
		timer := clk.NewTimer(deadline.Add(-margin / 2).Sub(clk.Now()))
		defer timer.Stop()
		select {
		case r := <-done:
			return r.resp, r.err
		case <-timer.C():
			method := "the call"
			if info != nil {
				method = info.FullMethod
			}
			return nil, status.Errorf(codes.DeadlineExceeded, "%s did not finish within its deadline: it is waiting on the pool's filesystem, which does not answer "+
				"(on a shared pool, a node that died holding what this call needs, until the server evicts it: docs/pools.md); "+
				"it goes on in the background, and a retry finds its result", method)
		}
	}
}
