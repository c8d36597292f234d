// Package rpc is what every poolcsi gRPC server puts around its handlers: one
// interceptor chain (the call's logger with the IDs it names, the deadline
// guard, the recovery from a handler's panic). The CSI driver's server uses it,
// and so will any other server of the project, so that every call is logged,
// bounded and kept from taking the process down the same way.
package rpc

import (
	"google.golang.org/grpc"
	"k8s.io/utils/clock"
)

// Interceptors is the chain every call goes through, outermost first:
// logCalls (the context logger, with the method and the request's IDs),
// answerInTime (which may run the rest in a goroutine of its own), the
// caller's extra ones (metrics), then recoverPanics, innermost so that it runs
// in the handler's goroutine, whichever that is, and the extra interceptors
// see a panic as the Internal error it becomes.
func Interceptors(extra ...grpc.UnaryServerInterceptor) []grpc.UnaryServerInterceptor {
	return interceptors(clock.RealClock{}, extra)
}

// interceptors is Interceptors with answerInTime on clk.
func interceptors(clk clock.Clock, extra []grpc.UnaryServerInterceptor) []grpc.UnaryServerInterceptor {
	chain := append([]grpc.UnaryServerInterceptor{logCalls, answerInTime(clk)}, extra...)
	return append(chain, recoverPanics)
}
