package lease

import (
	"math"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func TestValidate(t *testing.T) {
	tests := []struct {
		t  Timing
		ok bool
	}{
		{Default, true},
		{Timing{Duration: 10 * time.Second, Interval: 5 * time.Second, Margin: 5 * time.Second}, false}, // fewer than 3 renewals
		{Timing{Duration: 60 * time.Second, Interval: 5 * time.Second, Margin: time.Second}, false},     // margin below an interval
		{Timing{Duration: 60 * time.Second, Interval: 0, Margin: 5 * time.Second}, false},
		{Timing{Duration: MaxDuration, Interval: 5 * time.Second, Margin: MaxDuration}, true},
		{Timing{Duration: MaxDuration + time.Second, Interval: 5 * time.Second, Margin: 30 * time.Second}, false}, // a reader would clamp it
		{Timing{Duration: 60 * time.Second, Interval: 5 * time.Second, Margin: MaxDuration + time.Second}, false},
	}
	for _, tt := range tests {
		if err := tt.t.Validate(); (err == nil) != tt.ok {
			t.Errorf("%+v: %v, want ok=%t", tt.t, err, tt.ok)
		}
	}
}

// TestObserver: a record is expired only after it stays the same for the
// longer of the two durations plus the margin, by the observer's own clock;
// any change (renewal, new instance, a record appearing) starts the wait anew;
// a released lease is expired at once.
func TestObserver(t *testing.T) {
	tm := Timing{Duration: 60 * time.Second, Interval: 5 * time.Second, Margin: 30 * time.Second}
	o := NewObserver()
	now := time.Unix(1000, 0)
	o.now = func() time.Time { return now }
	rec := pool.Lease{Node: "a", Instance: "i1", Counter: 7, DurationSeconds: 60}
	step := func(d time.Duration, r pool.Lease, present bool) Verdict {
		now = now.Add(d)
		return o.Observe("p", "a", r, present, tm, false)
	}
	if v := step(0, rec, true); v.Expired || v.Wait != 90*time.Second {
		t.Fatalf("first sight: %+v", v)
	}
	if v := step(89*time.Second, rec, true); v.Expired {
		t.Fatalf("89 s unchanged: %+v", v)
	}
	rec.Counter++ // a renewal
	if v := step(10*time.Second, rec, true); v.Expired || v.Wait != 90*time.Second {
		t.Fatalf("after a renewal: %+v", v)
	}
	if v := step(90*time.Second, rec, true); !v.Expired {
		t.Fatalf("90 s unchanged: %+v", v)
	}
	restarted := pool.Lease{Node: "a", Instance: "i2", Counter: 1, DurationSeconds: 60}
	if v := step(time.Second, restarted, true); v.Expired {
		t.Fatalf("a restarted holder: %+v", v)
	}
	// A holder with a longer duration than the reader's is waited for.
	long := pool.Lease{Node: "a", Instance: "i3", Counter: 1, DurationSeconds: 300}
	if v := step(0, long, true); v.Wait != 330*time.Second {
		t.Fatalf("a holder's longer duration: %+v", v)
	}
	// No record at all: waited for like an unchanged one.
	if v := step(0, pool.Lease{}, false); v.Expired || v.Wait != 90*time.Second {
		t.Fatalf("no record: %+v", v)
	}
	if v := step(91*time.Second, pool.Lease{}, false); !v.Expired {
		t.Fatalf("no record for 91 s: %+v", v)
	}
	released := pool.Lease{Node: "a", Instance: "i3", Counter: 2, Released: true}
	if v := step(0, released, true); !v.Expired {
		t.Fatalf("released: %+v", v)
	}
}

// TestFenceBeforeExpiry: whatever happens between a holder's last successful
// renewal and a reader's first sight of it, the holder fences before the
// reader calls the lease expired.
func TestFenceBeforeExpiry(t *testing.T) {
	tm := Default
	start := time.Unix(5000, 0) // the renewal began
	for _, seenAfter := range []time.Duration{0, time.Millisecond, 10 * time.Second, 59 * time.Second} {
		// The holder fences at the first instant MustFence says so.
		fence := start
		for !tm.MustFence(start, fence) {
			fence = fence.Add(time.Millisecond)
		}
		// The reader saw the record at start+seenAfter (it cannot see it
		// before it was written) and calls it expired Expiry later.
		expiry := start.Add(seenAfter).Add(tm.Expiry(pool.Lease{DurationSeconds: int64(tm.Duration / time.Second)}))
		if got := expiry.Sub(fence); got < tm.Margin {
			t.Errorf("seen %s after the renewal began: the fence comes only %s before the expiry", seenAfter, got)
		}
	}
}

// TestHostileDurations: whatever a lease record declares (anyone who can
// write the pool can write it), the reader waits at least its own duration
// plus the margin, and at most MaxDuration plus the margin; the arithmetic
// never wraps around to a short wait.
func TestHostileDurations(t *testing.T) {
	tm := Default
	own := tm.Duration + tm.Margin
	longest := MaxDuration + tm.Margin
	tests := []struct {
		name string
		rec  pool.Lease
		want time.Duration
	}{
		{"the reader's own", pool.Lease{DurationSeconds: 60}, own},
		{"shorter than the reader's", pool.Lease{DurationSeconds: 1}, own},
		{"zero", pool.Lease{DurationSeconds: 0}, own},
		{"negative", pool.Lease{DurationSeconds: -5}, own},
		{"most negative", pool.Lease{DurationSeconds: math.MinInt64}, own},
		{"longer, within the bound", pool.Lease{DurationSeconds: 300}, 300*time.Second + tm.Margin},
		{"the bound", pool.Lease{DurationSeconds: int64(MaxDuration / time.Second)}, longest},
		{"a billion seconds", pool.Lease{DurationSeconds: 1000000000}, longest},
		{"overflows nanoseconds plus margin", pool.Lease{DurationSeconds: 9223372036}, longest},
		{"overflows nanoseconds", pool.Lease{DurationSeconds: 9223372037}, longest},
		{"largest", pool.Lease{DurationSeconds: math.MaxInt64}, longest},
		{"damaged", pool.Lease{Damaged: "a directory"}, longest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tm.Expiry(tt.rec); got != tt.want {
				t.Errorf("Expiry(%+v) = %s, want %s", tt.rec, got, tt.want)
			}
			// And through an observer: not expired a moment before, expired at it.
			o := NewObserver()
			now := time.Unix(1000, 0)
			o.now = func() time.Time { return now }
			rec := tt.rec
			rec.Node, rec.Instance, rec.Counter = "a", "i", 1
			if v := o.Observe("p", "a", rec, true, tm, true); v.Expired || v.Wait != tt.want {
				t.Fatalf("first sight: %+v", v)
			}
			now = now.Add(tt.want - time.Nanosecond)
			if v := o.Observe("p", "a", rec, true, tm, true); v.Expired {
				t.Fatalf("a moment before the expiry: %+v", v)
			}
			now = now.Add(time.Nanosecond)
			if v := o.Observe("p", "a", rec, true, tm, true); !v.Expired {
				t.Fatalf("at the expiry: %+v", v)
			}
		})
	}
}

// TestReleasedWhileStaged: a released lease ends the wait at once only for a
// node that holds no read-write stage of the volume; for one that does it is
// waited for like any unchanged record, and any change of any field (the
// released flag, a duration) starts the wait anew.
func TestReleasedWhileStaged(t *testing.T) {
	tm := Default
	o := NewObserver()
	now := time.Unix(1000, 0)
	o.now = func() time.Time { return now }
	live := pool.Lease{Node: "a", Instance: "i", Counter: 7, DurationSeconds: 60}
	if v := o.Observe("p", "a", live, true, tm, true); v.Expired {
		t.Fatalf("a live record: %+v", v)
	}
	now = now.Add(80 * time.Second)
	planted := live
	planted.Released = true
	if v := o.Observe("p", "a", planted, true, tm, true); v.Expired || v.Wait != 90*time.Second {
		t.Fatalf("released while staged: %+v, want a new wait of 90s", v)
	}
	now = now.Add(80 * time.Second)
	shorter := planted
	shorter.DurationSeconds = 1
	if v := o.Observe("p", "a", shorter, true, tm, true); v.Expired || v.Wait != 90*time.Second {
		t.Fatalf("a changed duration: %+v, want a new wait of 90s", v)
	}
	if v := o.Observe("p", "a", shorter, true, tm, false); !v.Expired {
		t.Fatalf("released, nothing staged: %+v", v)
	}
	if v := o.Observe("p", "b", pool.Lease{Node: "b", Released: true, Damaged: "x"}, true, tm, false); v.Expired {
		t.Fatalf("a damaged record's released flag: %+v", v)
	}
}
