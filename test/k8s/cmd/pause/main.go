// Command pause is the pod sandbox image of the kubelet tests: no registry is reachable, so
// the test builds its own. It sleeps until kubelet stops the sandbox.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	// As PID 1 of a shared PID namespace it must reap orphans; SIGCHLD ignored does that.
	signal.Ignore(syscall.SIGCHLD)
	<-sig
}
