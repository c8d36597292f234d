package rpc

import (
	"context"
	"errors"
	"fmt"
	"net"

	"google.golang.org/grpc"
)

// Serving is a gRPC server on its listener as a runner (internal/runner's shape): it
// serves until its context ends, then stops gracefully, so calls under way finish. When
// it returns it calls Stop, so a server that fails ends the loops started beside it.
// The node driver and the central controller serve through it.
type Serving struct {
	Server   *grpc.Server
	Listener net.Listener
	Endpoint string
	// Stop is called when the server has returned (nil: nothing).
	Stop context.CancelFunc
	// Started is called once, before serving: the caller's "Serving CSI" log line.
	Started func()

	err error
}

// Run serves until ctx ends or the server fails; what Serve returned is Err's.
func (s *Serving) Run(ctx context.Context) error {
	if s.Stop != nil {
		defer s.Stop()
	}
	go func() {
		<-ctx.Done()
		s.Server.GracefulStop()
	}()
	if s.Started != nil {
		s.Started()
	}
	if err := s.Server.Serve(s.Listener); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		s.err = fmt.Errorf("serve %s: %w", s.Endpoint, err)
	}
	return nil
}

// Err is why the server stopped serving before it was told to (nil: it was told to);
// read it once Run has returned.
func (s *Serving) Err() error { return s.err }
