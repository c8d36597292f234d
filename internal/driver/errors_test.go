package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func TestGRPCErrorTable(t *testing.T) {
	want := map[error]codes.Code{
		pool.ErrInvalidID:   codes.InvalidArgument,
		pool.ErrBadRange:    codes.InvalidArgument,
		pool.ErrOutOfRange:  codes.OutOfRange,
		pool.ErrNoSpace:     codes.ResourceExhausted,
		pool.ErrExists:      codes.AlreadyExists,
		pool.ErrNotReady:    codes.NotFound,
		pool.ErrCorrupt:     codes.Internal,
		pool.ErrUnavailable: codes.Unavailable,
		pool.ErrNotFound:    codes.NotFound,
		pool.ErrBusy:        codes.Aborted,
	}
	for _, s := range pool.Sentinels {
		if _, ok := want[s]; !ok {
			t.Errorf("sentinel %q has no expected code in this test: add it here and to errorCodes", s)
		}
	}
	cases := []struct {
		name string
		err  error
		code codes.Code
	}{
		{"cancelled", fmt.Errorf("mkfs: %w", context.Canceled), codes.Canceled},
		{"deadline", fmt.Errorf("lock: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{"os deadline", fmt.Errorf("read: %w", os.ErrDeadlineExceeded), codes.DeadlineExceeded},
		{"not found", fmt.Errorf("read volume.json: %w: %w", pool.ErrNotFound, os.ErrNotExist), codes.NotFound},
		{"ENOENT alone is no missing volume", fmt.Errorf("open /dev/loop-control: %w", os.ErrNotExist), codes.Internal},
		{"unavailable beats not found", fmt.Errorf("%w: %w", pool.ErrUnavailable, pool.ErrNotFound), codes.Unavailable},
		{"busy beats not found", fmt.Errorf("%w: %w", pool.ErrBusy, pool.ErrNotFound), codes.Aborted},
		{"cancelled beats unavailable", fmt.Errorf("%w: %w", pool.ErrUnavailable, context.Canceled), codes.Canceled},
		{"plain", errors.New("EIO"), codes.Internal},
		{"status passes", status.Error(codes.FailedPrecondition, "x"), codes.FailedPrecondition},
	}
	for s, c := range want {
		cases = append(cases, struct {
			name string
			err  error
			code codes.Code
		}{s.Error(), fmt.Errorf("volume x: %w", s), c})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := grpcError(tc.err)
			if status.Code(got) != tc.code {
				t.Errorf("grpcError(%v) = %v, want %v", tc.err, status.Code(got), tc.code)
			}
			if tc.code != codes.OK && status.Convert(got).Message() == "" {
				t.Error("message lost")
			}
		})
	}
	if grpcError(nil) != nil {
		t.Error("grpcError(nil) is not nil")
	}
}

// A shared pool whose directory is missing, or never initialised, is
// UNAVAILABLE for CreateVolume, with one "pool unavailable" in the message.
func TestUnavailablePoolCodes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(dir string)
	}{
		{"missing", func(string) {}},
		{"uninitialised", func(dir string) { _ = os.Mkdir(dir, 0o750) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "share")
			tc.setup(dir)
			p, err := pool.Open(pool.Config{Name: "shared", Path: dir, Shared: true})
			if err != nil {
				t.Fatal(err)
			}
			_, err = p.Reserve(context.Background(), pool.Spec{Name: "v", Layout: pool.LayoutImage, AccessType: pool.AccessBlock, CapacityBytes: pool.MiB})
			got := grpcError(err)
			if status.Code(got) != codes.Unavailable {
				t.Fatalf("code %v, want Unavailable: %v", status.Code(got), got)
			}
			if msg := status.Convert(got).Message(); strings.Count(msg, "pool unavailable") != 1 {
				t.Errorf("message repeats or lacks its cause: %q", msg)
			}
		})
	}
}
