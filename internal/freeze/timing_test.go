package freeze

import (
	"testing"
	"time"
)

func TestTimingValidate(t *testing.T) {
	ok := DefaultTiming
	for _, tt := range []struct {
		name string
		t    Timing
		ok   bool
	}{
		{"default", ok, true},
		{"no poll", Timing{MaxHold: time.Minute, AckTimeout: time.Second}, false},
		{"ack within two polls", Timing{Poll: time.Second, MaxHold: time.Minute, AckTimeout: time.Second}, false},
		{"hold within two polls", Timing{Poll: time.Second, MaxHold: time.Second, AckTimeout: 10 * time.Second}, false},
		{"budget below the hold", Timing{Poll: time.Second, MaxHold: time.Minute, AckTimeout: 10 * time.Second, Budget: time.Second}, false},
		{"negative budget", Timing{Poll: time.Second, MaxHold: time.Minute, AckTimeout: 10 * time.Second, Budget: -1}, false},
		{"budget of one hold", Timing{Poll: time.Second, MaxHold: time.Minute, AckTimeout: 10 * time.Second, Budget: time.Minute}, true},
	} {
		if err := tt.t.Validate(); (err == nil) != tt.ok {
			t.Errorf("%s: Validate() = %v, want ok %t", tt.name, err, tt.ok)
		}
	}
}

// TestAllowance: after a hold the device is not frozen again for as long as
// it lasted, and within any hour for at most the budget, whatever nonces the
// requests bring (they do not reach the allowance at all).
func TestAllowance(t *testing.T) {
	tm := Timing{Poll: time.Second, MaxHold: time.Minute, AckTimeout: 10 * time.Second, Budget: 3 * time.Minute}
	f := New(Deps{}, tm)
	now := time.Unix(1e6, 0)
	if b, why := f.allowance("7:1", now, tm); b != time.Minute || why != "" {
		t.Fatalf("fresh device: %s %q, want the maximum hold", b, why)
	}
	f.spend("7:1", now, now.Add(time.Minute))
	now = now.Add(time.Minute + 30*time.Second)
	if b, why := f.allowance("7:1", now, tm); b != 0 || why == "" {
		t.Fatalf("half a hold after a hold: %s, want a refusal", b)
	}
	if b, _ := f.allowance("7:2", now, tm); b != time.Minute {
		t.Fatalf("another device: %s, want its own allowance", b)
	}
	for range 2 {
		now = now.Add(2 * time.Minute)
		f.spend("7:1", now, now.Add(time.Minute))
		now = now.Add(time.Minute)
	}
	now = now.Add(3 * time.Minute)
	if b, why := f.allowance("7:1", now, tm); b != 0 || why == "" {
		t.Fatalf("budget spent within the hour: %s, want a refusal", b)
	}
	now = now.Add(time.Hour)
	if b, why := f.allowance("7:1", now, tm); b != time.Minute || why != "" {
		t.Fatalf("an hour later: %s %q, want the maximum hold again", b, why)
	}
}
