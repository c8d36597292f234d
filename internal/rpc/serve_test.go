package rpc

import (
	"context"
	"net"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
)

// A server told to stop returns with no error and calls Stop; one whose listener fails
// returns the failure and calls Stop too, so the loops beside it end.
func TestServing(t *testing.T) {
	for _, c := range []struct {
		name    string
		broken  bool
		wantErr bool
	}{
		{"told to stop", false, false},
		{"listener fails", true, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			lis, err := net.Listen("unix", filepath.Join(t.TempDir(), "s.sock"))
			if err != nil {
				t.Fatal(err)
			}
			if c.broken {
				_ = lis.Close()
			}
			ctx, cancel := context.WithCancel(context.Background())
			stopped, started := false, false
			s := &Serving{Server: grpc.NewServer(), Listener: lis, Endpoint: "test",
				Stop: func() { stopped = true; cancel() }, Started: func() { started = true }}
			done := make(chan struct{})
			go func() { _ = s.Run(ctx); close(done) }()
			if !c.broken {
				cancel()
			}
			<-done
			if !stopped || !started {
				t.Errorf("stopped %v, started %v", stopped, started)
			}
			if (s.Err() != nil) != c.wantErr {
				t.Errorf("Err() = %v", s.Err())
			}
		})
	}
}
