package cluster

import (
	"bytes"
	"os"
	"strings"
	"testing"
)

// RunProgram ends the body at Fatal, Skip or a panic, as go test ends a test, and runs
// every cleanup afterwards, last first, with the context cancelled and the temp dirs
// removed after the cleanups registered after them.
func TestRunProgram(t *testing.T) {
	for _, tc := range []struct {
		name                string
		end                 func(t testing.TB)
		wantFail, wantSkip  bool
		wantLog, wantNotLog string
	}{
		{"passes", func(t testing.TB) { t.Log("done") }, false, false, "done", ""},
		{"error goes on", func(t testing.TB) { t.Errorf("bad %d", 1); t.Log("after") }, true, false, "after", ""},
		{"fatal stops", func(t testing.TB) { t.Fatalf("bad %d", 2); t.Log("after") }, true, false, "bad 2", "after"},
		{"skip stops", func(t testing.TB) { t.Skipf("missing %s", "x"); t.Log("after") }, false, true, "missing x", "after"},
		{"panic fails", func(t testing.TB) { panic("boom") }, true, false, "panic: boom", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			var order []string
			var dir string
			ctxDone := false
			failed, skipped := RunProgram("prog", &out, func(p testing.TB) {
				dir = p.TempDir()
				p.Cleanup(func() {
					order = append(order, "first")
					if _, err := os.Stat(dir); err != nil {
						t.Errorf("temp dir gone before a later cleanup: %v", err)
					}
				})
				p.Cleanup(func() {
					order = append(order, "second")
					ctxDone = p.Context().Err() != nil
				})
				tc.end(p)
			})
			if failed != tc.wantFail || skipped != tc.wantSkip {
				t.Errorf("failed %v skipped %v, want %v %v\n%s", failed, skipped, tc.wantFail, tc.wantSkip, &out)
			}
			if strings.Join(order, ",") != "second,first" {
				t.Errorf("cleanups ran %v, want second,first", order)
			}
			if !ctxDone {
				t.Error("the context was not cancelled before the cleanups")
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Errorf("temp dir %s left: %v", dir, err)
			}
			if !strings.Contains(out.String(), tc.wantLog) || (tc.wantNotLog != "" && strings.Contains(out.String(), tc.wantNotLog)) {
				t.Errorf("log %q: want %q, not %q", out.String(), tc.wantLog, tc.wantNotLog)
			}
		})
	}
}

// A Fatal in a cleanup fails the run and ends that cleanup, not the others.
func TestRunProgramCleanupFatal(t *testing.T) {
	var out bytes.Buffer
	ran := false
	failed, _ := RunProgram("prog", &out, func(p testing.TB) {
		p.Cleanup(func() { ran = true })
		p.Cleanup(func() { p.Fatal("cleanup failed") })
	})
	if !failed || !ran {
		t.Errorf("failed %v, earlier cleanup ran %v\n%s", failed, ran, &out)
	}
}
