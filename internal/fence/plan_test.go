package fence

import (
	"slices"
	"testing"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount"
)

// TestPlanFence: which devices a fence takes, from the kernel's devices and
// the node's records.
func TestPlanFence(t *testing.T) {
	const poolFS, otherFS = 40, 41
	rw := layout.StageRecord{Volume: "shared.a", FileDev: poolFS, FileIno: 7, Device: "/dev/loop1"}
	ro := layout.StageRecord{Volume: "shared.b", FileDev: poolFS, FileIno: 8, Device: "/dev/loop2", ReadOnly: true}
	ours := mount.LoopDevice{Device: "/dev/loop1", Dev: poolFS, Ino: 7}
	oursRO := mount.LoopDevice{Device: "/dev/loop2", Dev: poolFS, Ino: 8}
	samePoolOther := mount.LoopDevice{Device: "/dev/loop3", Dev: poolFS, Ino: 9}
	elsewhere := mount.LoopDevice{Device: "/dev/loop4", Dev: otherFS, Ino: 7}
	hung := mount.LoopDevice{Device: "/dev/loop5", Err: mount.ErrNotIdentified}
	for _, tc := range []struct {
		name       string
		devs       []mount.LoopDevice
		recs       []layout.StageRecord
		unreadable bool
		want       []string
		closed     bool
	}{
		{"nothing recorded", []mount.LoopDevice{ours, elsewhere, hung}, nil, false, nil, false},
		{"by identity", []mount.LoopDevice{ours, oursRO, samePoolOther, elsewhere, hung}, []layout.StageRecord{rw, ro}, false, []string{"/dev/loop1", "/dev/loop2"}, false},
		{"renumbered", []mount.LoopDevice{{Device: "/dev/loop9", Dev: poolFS, Ino: 7}, elsewhere}, []layout.StageRecord{rw}, false, []string{"/dev/loop9"}, false},
		{"unidentified, named by the record", []mount.LoopDevice{{Device: "/dev/loop1", Err: mount.ErrNotIdentified}, elsewhere, hung}, []layout.StageRecord{rw}, false, []string{"/dev/loop1"}, false},
		{"fenced already", []mount.LoopDevice{{Device: "/dev/loop1", Dev: poolFS, Ino: 7, Fenced: true}}, []layout.StageRecord{rw}, false, nil, false},
		{"read-write record unmatched", []mount.LoopDevice{oursRO, samePoolOther, elsewhere, hung}, []layout.StageRecord{rw, ro}, false, []string{"/dev/loop2", "/dev/loop3", "/dev/loop5"}, true},
		{"read-only record unmatched", []mount.LoopDevice{samePoolOther, elsewhere}, []layout.StageRecord{ro}, false, nil, false},
		{"records unreadable", []mount.LoopDevice{samePoolOther, elsewhere, hung}, nil, true, []string{"/dev/loop5"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plan := planFence(tc.devs, tc.recs, nil, tc.unreadable)
			if !slices.Equal(plan.devices, tc.want) || plan.failedClosed != tc.closed {
				t.Fatalf("fence takes %v (failed closed %t), want %v (%t)", plan.devices, plan.failedClosed, tc.want, tc.closed)
			}
		})
	}
	// The pool's filesystem as remembered counts when failing closed.
	plan := planFence([]mount.LoopDevice{samePoolOther, elsewhere}, nil, []uint64{poolFS}, true)
	if !slices.Equal(plan.devices, []string{"/dev/loop3"}) {
		t.Fatalf("failing closed with the pool's filesystem remembered: %v", plan.devices)
	}
}
