package harness

import (
	"strings"
	"testing"
	"time"
)

// The conformance bookkeeping needs no cluster: results merge by spec name, a chunk is
// done only when each of its specs has a result, and the report lists what has not run.
func TestConformanceResults(t *testing.T) {
	const (
		a = "External Storage [Driver: d] [Testpattern: p] volumes should store data"
		b = "External Storage [Driver: d] [Testpattern: p] provisioning should provision storage with any volume data source [Serial]"
		c = "External Storage [Driver: d] [Testpattern: q] volumes should allow exec"
	)
	if got := chunkOf.FindString(a); got != "External Storage [Driver: d] [Testpattern: p]" {
		t.Fatalf("chunk of %q = %q", a, got)
	}
	r := conformanceResults{}
	r.merge(&e2eResults{
		passed: []specResult{{name: a}},
		failed: []specResult{{name: b, message: "timed out\nwaiting"}},
	}, time.Date(2026, 11, 23, 0, 0, 0, 0, time.UTC))
	if !r.hasAll([]string{a, b}) || r.hasAll([]string{a, c}) {
		t.Fatalf("hasAll wrong: %v", r)
	}
	md := r.markdown([]string{a, b, c})
	for _, want := range []string{
		"3 specs: 1 passed, 1 failed, 0 skipped, 1 not run yet.",
		"- " + b + " — timed out waiting **Cause (this machine):**",
		"## Not run yet (1)\n\n- " + c,
		"(2026-11-23)",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	r.merge(&e2eResults{passed: []specResult{{name: b}}}, time.Now())
	if r[b].Result != "passed" {
		t.Errorf("a later result does not replace an earlier one: %v", r[b])
	}
}
