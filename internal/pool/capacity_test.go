package pool

import (
	"bytes"
	"context"
	"errors"
	"math"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func TestCapacity(t *testing.T) {
	tests := []struct {
		name            string
		required, limit int64
		minimum         int64
		want            int64
		wantErr         error
	}{
		{"default", 0, 0, MiB, DefaultCapacity, nil},
		{"exact MiB", 64 * MiB, 0, MiB, 64 * MiB, nil},
		{"rounded up", 64*MiB + 1, 0, MiB, 65 * MiB, nil},
		{"raised to fs minimum", 64 * MiB, 0, 300 * MiB, 300 * MiB, nil},
		{"fs minimum above limit", 64 * MiB, 100 * MiB, 300 * MiB, 0, ErrOutOfRange},
		{"limit only", 0, 100 * MiB, MiB, 100 * MiB, nil},
		{"unaligned limit only", 0, 100*MiB + 5, MiB, 100 * MiB, nil},
		{"required equals limit", 10 * MiB, 10 * MiB, MiB, 10 * MiB, nil},
		{"rounding crosses limit", 10*MiB + 1, 10*MiB + 2, MiB, 0, ErrOutOfRange},
		{"limit below required", 10 * MiB, 5 * MiB, MiB, 0, ErrBadRange},
		{"negative", -1, 0, MiB, 0, ErrBadRange},
		{"too large", MaxCapacity + 1, 0, MiB, 0, ErrOutOfRange},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Capacity(tt.required, tt.limit, tt.minimum)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("Capacity = %d, %v; want %v", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("Capacity = %d, %v; want %d", got, err, tt.want)
			}
		})
	}
}

func TestAvailableBytes(t *testing.T) {
	tests := []struct {
		overcommit float64
		u          Usage
		want       int64
	}{
		{1, Usage{FreeBytes: 100, UnbackedBytes: 30}, 70},
		{1, Usage{FreeBytes: 100, UnbackedBytes: 130}, 0},
		{2, Usage{FreeBytes: 100, UnbackedBytes: 130}, 70},
	}
	for _, tt := range tests {
		p := &Pool{cfg: Config{Overcommit: tt.overcommit}}
		if got := p.Ledger().AvailableBytes(tt.u); got != tt.want {
			t.Errorf("overcommit %v, %+v: got %d want %d", tt.overcommit, tt.u, got, tt.want)
		}
	}
}

// Sizes near 2^63 are OUT_OF_RANGE, never wrapped into a small or negative size.
func TestCapacityNeverOverflows(t *testing.T) {
	for _, req := range []int64{math.MaxInt64, math.MaxInt64 - MiB + 2, MaxCapacity + 1, 1 << 62} {
		got, err := Capacity(req, 0, 0)
		if !errors.Is(err, ErrOutOfRange) {
			t.Errorf("Capacity(%d) = %d, %v; want ErrOutOfRange", req, got, err)
		}
	}
	if got, err := Capacity(MaxCapacity, 0, 0); err != nil || got != MaxCapacity {
		t.Errorf("Capacity(MaxCapacity) = %d, %v", got, err)
	}
}

// GetCapacity's figure from the ledger (no record read) is the exact
// measurement's: the same unbacked bytes, with images that hold data and a
// dir volume; a ledger that cannot be trusted is not used, the pool is
// measured instead.
func TestCapacityFromLedgerIsTheMeasurement(t *testing.T) {
	ctx := context.Background()
	p := openTemp(t)
	a := reserveBlock(t, p, "a", 8*MiB)
	reserveBlock(t, p, "b", 16*MiB)
	if _, err := p.Reserve(ctx, Spec{Name: "d", Layout: LayoutDir, AccessType: AccessFilesystem, CapacityBytes: 4 * MiB}); err != nil {
		t.Fatal(err)
	}
	aid, _ := ParseVolumeID(a.ID)
	// Some of a's promise is backed by blocks now.
	if err := os.WriteFile(p.ImagePath(aid), bytes.Repeat([]byte{1}, int(2*MiB)), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p.ImagePath(aid), 8*MiB); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	p.capacity = capacityCache{} // a new measurement
	check := func(wantLedger bool) {
		t.Helper()
		got, fromLedger, err := p.Ledger().capacityUsage()
		if err != nil {
			t.Fatal(err)
		}
		want, err := p.Ledger().Usage()
		if err != nil {
			t.Fatal(err)
		}
		if fromLedger != wantLedger || got.UnbackedBytes != want.UnbackedBytes {
			t.Fatalf("capacity from ledger %v (want %v): unbacked %d, measured %d", fromLedger, wantLedger, got.UnbackedBytes, want.UnbackedBytes)
		}
	}
	check(true)
	check(true) // the cached measurement
	if err := p.Delete(ctx, aid); err != nil {
		t.Fatal(err)
	}
	check(true) // a change to the ledger: measured again
	// An untrusted ledger (damaged, or older than the directories) is
	// never the answer.
	putLedgerFile(t, p, []byte(`{"version":1,"volumes":0,"provisionedBytes":0,"sum":"x"}`))
	check(false)
}
