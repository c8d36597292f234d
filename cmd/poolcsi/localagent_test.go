package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestLocalAgentFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string // a part of the error; empty: valid
	}{
		{name: "off by default, in any mode", args: []string{"--mode=node"}},
		{name: "on in mode all", args: []string{"--local-agent", "--agent-workers=1", "--agent-heartbeat=1s", "--agent-call-timeout=1m"}},
		{name: "on in node mode", args: []string{"--local-agent", "--mode=node"}, want: "--local-agent needs --mode=all"},
		{name: "on in controller mode", args: []string{"--local-agent", "--mode=controller"}, want: "--local-agent needs --mode=all"},
		{name: "no workers", args: []string{"--agent-workers=0"}, want: "--agent-workers"},
		{name: "zero heartbeat", args: []string{"--agent-heartbeat=0"}, want: "--agent-heartbeat"},
		{name: "negative call timeout", args: []string{"--agent-call-timeout=-1s"}, want: "--agent-call-timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := parseServeFlags(t, tt.args...).Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("Validate: %v, want no error", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("Validate: %v, want an error with %q", err, tt.want)
			}
		})
	}
	o := parseServeFlags(t)
	if o.LocalAgent || o.AgentWorkers != 4 || o.AgentHeartbeat != 5*time.Second || o.AgentCallTimeout != 10*time.Minute || o.CallsNamespace != "" {
		t.Errorf("defaults: %+v", o)
	}
}

// Off, the agent makes no API client: a kubeconfig that does not exist is never read.
// On, a missing kubeconfig is an error at start, not a silent agent that never runs.
func TestLocalAgentOffTouchesNothing(t *testing.T) {
	o := parseServeFlags(t, "--kubeconfig=/nonexistent/kubeconfig", "--calls-namespace=poolcsi")
	stopped, err := o.startLocalAgent(context.Background(), nil, "b", nil)
	if err != nil {
		t.Fatalf("off: %v", err)
	}
	select {
	case <-stopped:
	default:
		t.Error("off: the agent's channel is not closed")
	}
	o.LocalAgent = true
	if _, err := o.startLocalAgent(context.Background(), nil, "b", nil); err == nil || !strings.Contains(err.Error(), "--local-agent") {
		t.Errorf("on without a kubeconfig: %v", err)
	}
}
