package pool

import (
	"context"
	"testing"
)

// TestCountPublishedInFlight: an index entry whose volume has no publish record
// is stale, unless the volume's lock is held, which is a publish between its
// entry and its record; that one counts, and is not removed.
func TestCountPublishedInFlight(t *testing.T) {
	p := openTemp(t)
	ctx := context.Background()
	v, err := p.Reserve(ctx, Spec{Name: "in-flight", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: 8 * MiB})
	if err != nil {
		t.Fatal(err)
	}
	id, _ := ParseVolumeID(v.ID)
	if err := p.Publications().Mark("node-1", id); err != nil {
		t.Fatal(err)
	}
	unlock, err := p.LockVolume(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := p.Publications().Count("node-1", VolumeID{}, true); err != nil || n != 1 {
		t.Fatalf("count with a publish in flight = %d, %v; want 1", n, err)
	}
	unlock()
	if n, err := p.Publications().Count("node-1", VolumeID{}, false); err != nil || n != 1 {
		t.Fatalf("unverified count = %d, %v; want 1", n, err)
	}
	if n, err := p.Publications().Count("node-1", VolumeID{}, true); err != nil || n != 0 {
		t.Fatalf("verified count of a stale entry = %d, %v; want 0", n, err)
	}
	if n, err := p.Publications().Count("node-1", VolumeID{}, false); err != nil || n != 0 {
		t.Fatalf("the stale entry was not removed: count %d, %v", n, err)
	}
	if n, err := p.Publications().Count("never-seen", VolumeID{}, true); err != nil || n != 0 {
		t.Fatalf("count of a node without an index = %d, %v", n, err)
	}
}
