package poolset

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

var testKey = []byte("0123456789abcdef0123456789abcdef-test")

func newSet(t *testing.T) (*Set, *fake.Shares, *int) {
	t.Helper()
	root := t.TempDir()
	p, err := pool.Open(pool.Config{Name: "local", Path: filepath.Join(root, "pool")})
	if err != nil {
		t.Fatal(err)
	}
	fs := fake.NewShares(filepath.Join(root, "shares"))
	joined := 0
	s, err := New(Deps{NodeID: "node-1", Shares: fs, ShareKeys: [][]byte{testKey}, Joined: func(context.Context) { joined++ }}, []*pool.Pool{p})
	if err != nil {
		t.Fatal(err)
	}
	return s, fs, &joined
}

// TestLookupNeverMounts: Lookup answers from the pools served here, whatever
// the ID says; Ensure mounts only a share a StorageClass names, this node
// mounted before, or whose ID carries a verified tag.
func TestLookupNeverMounts(t *testing.T) {
	ctx := context.Background()
	r := pool.ShareRef{Type: "nfs", Source: "nfs.example.com:/export"}
	tagged := VolumeRef(mustID(t, pool.NewShareVolumeID(r, "v").String()+"."+Tag(testKey, r)))
	untagged := VolumeRef(pool.NewShareVolumeID(r, "v"))
	forged := VolumeRef(mustID(t, pool.NewShareVolumeID(r, "v").String()+"."+Tag([]byte("another key, not this cluster's ....."), r)))

	s, fs, joined := newSet(t)
	if p, err := s.Lookup(context.Background(), VolumeRef(mustID(t, "local.0123456789abcdef0123456789abcdef"))); err != nil || p.Name() != "local" {
		t.Fatalf("Lookup of a configured pool: %v, %v", p, err)
	}
	if _, err := s.Lookup(context.Background(), VolumeRef(mustID(t, "nope.0123456789abcdef0123456789abcdef"))); !errors.Is(err, csierr.ErrNoPool) {
		t.Fatalf("Lookup of a pool not configured: %v, want ErrNoPool", err)
	}
	if _, err := s.Lookup(context.Background(), tagged); !errors.Is(err, pool.ErrUnavailable) || fs.MountCount() != 0 {
		t.Fatalf("Lookup of a share not served: %v (mounts %d), want UNAVAILABLE and no mount", err, fs.MountCount())
	}
	if _, err := s.Ensure(ctx, untagged, Access{}); !errors.Is(err, csierr.ErrShareUnknown) || fs.MountCount() != 0 {
		t.Fatalf("Ensure of an untagged unknown share: %v (mounts %d)", err, fs.MountCount())
	}
	if _, err := s.Ensure(ctx, forged, Access{}); status.Code(err) != codes.InvalidArgument || fs.MountCount() != 0 {
		t.Fatalf("Ensure with a tag of another key: %v (mounts %d)", err, fs.MountCount())
	}
	// A tagged ID of a share that holds no pool: mounted, found empty, let go.
	if _, err := s.Ensure(ctx, tagged, Access{}); !errors.Is(err, csierr.ErrNoPool) || len(fs.Released) != 1 || s.Pool(r.PoolName()) != nil {
		t.Fatalf("Ensure of a share without a pool: %v (released %v)", err, fs.Released)
	}
	// A StorageClass's share is laid out and joins the set, once.
	p, err := s.Ensure(ctx, ShareRef(r), Access{fromStorageClass: true})
	if err != nil || p.Name() != r.PoolName() || s.Pool(r.PoolName()) != p || *joined != 1 {
		t.Fatalf("Ensure from a StorageClass: %v, %v (joined %d)", p, err, *joined)
	}
	if got, err := s.Lookup(context.Background(), untagged); err != nil || got != p {
		t.Fatalf("Lookup of a served share: %v, %v", got, err)
	}
	if got, err := s.Ensure(ctx, tagged, Access{}); err != nil || got != p || *joined != 1 {
		t.Fatalf("Ensure of a served share: %v, %v (joined %d)", got, err, *joined)
	}
	if w := s.WireID(p, "x"); w != "x."+Tag(testKey, r) {
		t.Fatalf("WireID = %q, want the share's tag", w)
	}
}

func mustID(t *testing.T, s string) pool.VolumeID {
	t.Helper()
	id, err := pool.ParseVolumeID(s)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestHeldPoolAnswersUnavailable: a pool held for its start-up passes is
// found by no call (UNAVAILABLE, ErrStarting), stays listed for the driver's
// own passes, and is found again once released.
func TestHeldPoolAnswersUnavailable(t *testing.T) {
	s, _, _ := newSet(t)
	p := s.Pool("local")
	vid := p.NewID("v")
	s.Hold("local")
	if got := s.Served(); len(got) != 0 {
		t.Errorf("Served while held: %v", got)
	}
	if s.Pool("local") != p {
		t.Error("a held pool is not listed for the driver's own passes")
	}
	for name, find := range map[string]func() (*pool.Pool, error){
		"Lookup": func() (*pool.Pool, error) { return s.Lookup(context.Background(), VolumeRef(vid)) },
		"Ensure": func() (*pool.Pool, error) { return s.Ensure(context.Background(), VolumeRef(vid), Access{}) },
	} {
		got, err := find()
		if got != nil || !errors.Is(err, ErrStarting) || status.Code(csierr.GRPCError(err)) != codes.Unavailable {
			t.Errorf("%s of a held pool: %v, %v; want UNAVAILABLE (ErrStarting)", name, got, err)
		}
	}
	// Kubelet's teardown needs none of the passes: it gets the pool at once.
	if got, err := s.LookupHeld(context.Background(), VolumeRef(vid)); got != p || err != nil {
		t.Errorf("LookupHeld of a held pool: %v, %v; want the pool", got, err)
	}
	s.Release("local")
	if got, err := s.Lookup(context.Background(), VolumeRef(vid)); got != p || err != nil {
		t.Errorf("Lookup once released: %v, %v", got, err)
	}
}

// TestHeldPoolWaitsAtMostHeldWait: a call that finds its pool held waits for
// the pool's start-up passes, at most HeldWait or until its own context
// ends, whichever comes first, then answers UNAVAILABLE; a pool released
// meanwhile serves the call; a call on another pool never waits. Before, a
// held pool answered UNAVAILABLE at once, and a CephFS pool only slow to
// open refused the first calls it used to serve after a wait. The bounds are
// an hour against a few seconds: a call that waited the hour would time the
// test out.
func TestHeldPoolWaitsAtMostHeldWait(t *testing.T) {
	root := t.TempDir()
	var pools []*pool.Pool
	failed := filepath.Join(root, "failed") // a shared pool without pool.json
	if err := os.Mkdir(failed, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"held", "other", "failed"} {
		p, err := pool.Open(pool.Config{Name: name, Path: filepath.Join(root, name), Shared: name == "failed"})
		if err != nil {
			t.Fatal(err)
		}
		pools = append(pools, p)
	}
	const never, soon = time.Hour, 20 * time.Millisecond
	for _, tc := range []struct {
		name     string
		wait     time.Duration
		pool     string
		deadline time.Duration // the call's own, 0: none
		release  bool          // Release while the call waits
		want     error         // nil: the pool
	}{
		{name: "released while the call waits", wait: never, pool: "held", release: true},
		{name: "not released within the wait", wait: soon, pool: "held", want: ErrStarting},
		{name: "the call's context ends first", wait: never, pool: "held", deadline: soon, want: ErrStarting},
		{name: "another pool", wait: never, pool: "other"},
		{name: "no wait", wait: 0, pool: "held", want: ErrStarting},
		{name: "its open failed", wait: never, pool: "failed", want: ErrStarting},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := New(Deps{NodeID: "node-1", HeldWait: tc.wait}, pools)
			if err != nil {
				t.Fatal(err)
			}
			s.Hold("held")
			s.Hold("failed")
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if tc.deadline > 0 {
				ctx, cancel = context.WithTimeout(ctx, tc.deadline)
				defer cancel()
			}
			if tc.release {
				go func() {
					time.Sleep(soon)
					s.Release("held")
				}()
			}
			vid := s.Pool(tc.pool).NewID("v")
			for name, find := range map[string]func() (*pool.Pool, error){
				"Lookup": func() (*pool.Pool, error) { return s.Lookup(ctx, VolumeRef(vid)) },
				"Ensure": func() (*pool.Pool, error) { return s.Ensure(ctx, VolumeRef(vid), Access{}) },
				"ForCreate": func() (*pool.Pool, error) {
					return s.ForCreate(ctx, params.Create{Pool: tc.pool}, nil, Access{})
				},
			} {
				done := make(chan struct{})
				var got *pool.Pool
				go func() {
					defer close(done)
					got, err = find()
				}()
				select {
				case <-done:
				case <-time.After(30 * time.Second):
					t.Fatalf("%s still waits after 30 s", name)
				}
				switch {
				case tc.want == nil && (err != nil || got != s.Pool(tc.pool)):
					t.Errorf("%s: %v, %v; want pool %s", name, got, err, tc.pool)
				case tc.want != nil && (got != nil || !errors.Is(err, tc.want) || status.Code(csierr.GRPCError(err)) != codes.Unavailable):
					t.Errorf("%s: %v, %v; want UNAVAILABLE (%v)", name, got, err, tc.want)
				}
			}
		})
	}
}
