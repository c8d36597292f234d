package pool

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
)

// Volumes created and deleted between pages are listed or not, but no volume
// that exists throughout is missed or repeated, and a token from one
// controller is good at another (another Pool over the same directory).
func TestListPageConsistentAcrossChanges(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	a, err := Open(Config{Name: "t", Path: dir})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(Config{Name: "t", Path: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	mk := func(name string) {
		t.Helper()
		v, err := a.Reserve(ctx, Spec{Name: name, Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: MiB})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.MarkReady(v); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 40; i++ {
		mk(fmt.Sprintf("stable-%d", i))
	}
	ready := func(e Entry) bool { return e.Err == nil && e.Volume.State == StateReady }
	seen := map[string]int{}
	token := ""
	for page, pools := 0, []*Pool{a, b}; ; page++ {
		p := pools[page%2]
		entries, next, err := p.ListPage(token, 3, ready)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			seen[e.Volume.Name]++
		}
		// Churn between pages: a new volume, and one of the new ones deleted.
		mk(fmt.Sprintf("new-%d", page))
		if page%3 == 0 {
			if err := a.Delete(ctx, NewVolumeID("t", fmt.Sprintf("new-%d", page))); err != nil {
				t.Fatal(err)
			}
		}
		if next == "" {
			break
		}
		token = next
	}
	for i := 0; i < 40; i++ {
		if n := seen[fmt.Sprintf("stable-%d", i)]; n != 1 {
			t.Errorf("stable-%d listed %d times", i, n)
		}
	}
	for name, n := range seen {
		if n != 1 {
			t.Errorf("%s listed %d times", name, n)
		}
	}
}
