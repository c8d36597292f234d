package harness

import (
	"testing"

	"github.com/poolcsi/poolcsi/test/k8s/e2e"
)

// TestE2EStorage runs the Kubernetes storage e2e suite for external drivers (package e2e)
// against the chart on a two-node cluster: POOLCSI_E2E_FOCUS chooses the specs (default
// e2e.CIFocus); POOLCSI_E2E_REPORT makes it the conformance run, which writes the per-spec
// results there as Markdown. make e2e and make conformance run the same through
// cmd/conformance; make test leaves it out (-skip '^TestE2E').
func TestE2EStorage(t *testing.T) {
	cfg, err := e2e.ConfigFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	e2e.Storage(t, cfg)
}
