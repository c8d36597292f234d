package lease

import (
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
		return o.Observe("p", "a", r, present, tm)
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
