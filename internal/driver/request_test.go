package driver

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// TestResolveLockTable: each row of the lock table does what it says. A call
// whose row locks finds a busy volume ABORTED and takes nothing; one whose
// row does not lock resolves the volume beside the holder; a loading row
// returns the record; and every row releases what it took.
func TestResolveLockTable(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for call, r := range routes {
		t.Run(string(call), func(t *testing.T) {
			release, err := td.locks.acquire(vid.String(), "test")
			if err != nil {
				t.Fatal(err)
			}
			rq, err := td.resolve(ctx, call, id, poolset.Access{}, nil)
			release()
			if r.lock {
				if !errors.Is(err, pool.ErrBusy) {
					t.Fatalf("resolve on a busy volume = %v, want busy", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("resolve = %v", err)
			}
			rq.release()
			rq, err = td.resolve(ctx, call, id, poolset.Access{}, nil)
			if err != nil {
				t.Fatalf("resolve = %v", err)
			}
			defer rq.release()
			if rq.id != vid || rq.pool == nil || (rq.vol != nil) != r.load {
				t.Fatalf("resolve = %+v, want %s in its pool, record loaded: %t", rq, vid, r.load)
			}
		})
	}
	// Released: every row takes the lock again.
	release, err := td.locks.acquire(vid.String(), "test")
	if err != nil {
		t.Fatalf("a row left the volume locked: %v", err)
	}
	release()
}

// TestResolveOrder: the ID is checked before the call's own checks, which
// run before anything is locked; a foreign ID is NOT_FOUND only where the
// table says so; a missing pool passes only where it means "nothing to do".
func TestResolveOrder(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	ctx := context.Background()
	checked := errors.New("checked")
	check := func() error { return status.Error(codes.InvalidArgument, checked.Error()) }
	missing := pool.NewVolumeID("nowhere", "v").String()
	tests := []struct {
		name  string
		call  holder
		id    string
		check func() error
		want  codes.Code
		nilOK bool
	}{
		{"empty ID", rpcNodeStageVolume, "", check, codes.InvalidArgument, false},
		{"bad ID before the checks", rpcControllerExpandVolume, "x", nil, codes.InvalidArgument, false},
		{"checks before the pool", rpcControllerExpandVolume, missing, check, codes.InvalidArgument, false},
		{"missing pool", rpcControllerExpandVolume, missing, nil, codes.NotFound, false},
		{"foreign ID is not found", rpcControllerModifyVolume, "foreign-volume-1", nil, codes.NotFound, false},
		{"hostile ID is invalid", rpcControllerModifyVolume, "../../etc", nil, codes.InvalidArgument, false},
		{"missing pool is gone", rpcDeleteVolume, missing, nil, codes.OK, true},
		{"missing pool, served only", rpcNodeUnpublishVolume, missing, nil, codes.OK, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rq, err := td.resolve(ctx, tt.call, tt.id, poolset.Access{}, tt.check)
			csierr.ToStatus(&err)
			if got := status.Code(err); got != tt.want {
				t.Fatalf("resolve(%s, %q) = %v, want %s", tt.call, tt.id, err, tt.want)
			}
			if err == nil {
				defer rq.release()
				if tt.nilOK != (rq.pool == nil) {
					t.Fatalf("resolve(%s, %q) pool = %v", tt.call, tt.id, rq.pool)
				}
			}
		})
	}
	if _, err := td.resolve(ctx, "NoSuchCall", missing, poolset.Access{}, nil); status.Code(err) != codes.Internal {
		t.Fatalf("a call with no row = %v, want INTERNAL", err)
	}
}
