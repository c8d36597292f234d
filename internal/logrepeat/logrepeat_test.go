package logrepeat

import (
	"testing"
	"time"
)

func TestFailures(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	type step struct {
		ok         bool // a success instead of a failure
		msg        string
		at         time.Duration
		log        bool
		suppressed int
		recovered  int // for a success: the failures it ends
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"the same failure every 5 s: once, then at the interval", []step{
			{msg: "a", at: 0, log: true},
			{msg: "a", at: 5 * time.Second},
			{msg: "a", at: 10 * time.Second},
			{msg: "a", at: Interval - time.Second},
			{msg: "a", at: Interval, log: true, suppressed: 3},
			{msg: "a", at: Interval + 5*time.Second},
		}},
		{"a changed failure is logged at once", []step{
			{msg: "a", at: 0, log: true},
			{msg: "a", at: 5 * time.Second},
			{msg: "b", at: 10 * time.Second, log: true, suppressed: 1},
			{msg: "b", at: 15 * time.Second},
		}},
		{"a success ends the episode: the next failure is logged", []step{
			{msg: "a", at: 0, log: true},
			{msg: "a", at: 5 * time.Second},
			{ok: true, at: 10 * time.Second, recovered: 2},
			{ok: true, at: 15 * time.Second},
			{msg: "a", at: 20 * time.Second, log: true},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f Failures
			for i, s := range tc.steps {
				if s.ok {
					if got := f.Succeeded(); got != s.recovered {
						t.Errorf("step %d: Succeeded() = %d, want %d", i, got, s.recovered)
					}
					continue
				}
				log, sup := f.Failed(s.msg, t0.Add(s.at))
				if log != s.log || sup != s.suppressed {
					t.Errorf("step %d (%q at %s): Failed() = %v, %d; want %v, %d", i, s.msg, s.at, log, sup, s.log, s.suppressed)
				}
			}
		})
	}
}
