package harness

import (
	"context"
	"os/exec"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// Restart stops the driver process and starts a new one with the same flags on
// the same socket, as kubelet restarts a crashed plugin. The Driver (and its
// connection, which reconnects) stays valid, and so does the place of its
// cleanup among the test's other cleanups.
func (d *Driver) Restart(t testing.TB) {
	t.Helper()
	d.Stop()
	cmd := exec.Command(d.cmd.Path, d.cmd.Args[1:]...)
	cmd.Stdout, cmd.Stderr = d.cmd.Stdout, d.cmd.Stderr
	done := make(chan struct{})
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d.cmd, d.done = cmd, done
	go func() { cmd.Wait(); close(done) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := csi.NewIdentityClient(d.Conn).Probe(ctx, &csi.ProbeRequest{})
		cancel()
		if err == nil {
			return
		}
		select {
		case <-done:
			t.Fatalf("restarted poolcsi exited before it was ready: %v\n%s", cmd.ProcessState, d.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("restarted poolcsi not ready after 30s: %v\n%s", err, d.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
