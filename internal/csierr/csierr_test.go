package csierr

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

	"github.com/poolcsi/poolcsi/internal/mount"
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
		// A growth the kernel still runs: the caller retries (the chaos
		// test's kill during NodeExpandVolume answered INTERNAL).
		mount.ErrGrowUnderWay: codes.Aborted,
	}
	// The driver's own classes, with the codes the statuses they replace had.
	for s, c := range map[error]codes.Code{
		ErrInvalid:      codes.InvalidArgument,
		ErrForeignMount: codes.FailedPrecondition,
		ErrNoPool:       codes.NotFound,
		ErrNoNode:       codes.NotFound,
		ErrNotAtPath:    codes.NotFound,
		ErrNotStaged:    codes.FailedPrecondition,
		ErrInUse:        codes.FailedPrecondition,
		ErrFenced:       codes.FailedPrecondition,
		ErrPathTaken:    codes.AlreadyExists,
		ErrState:        codes.FailedPrecondition,
		ErrShareUnknown: codes.FailedPrecondition,
		ErrNodeFull:     codes.ResourceExhausted,
		ErrTopology:     codes.ResourceExhausted,
	} {
		want[s] = c
	}
	for _, s := range append(append([]error(nil), pool.Sentinels...), Sentinels...) {
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
		{"wrapped status passes", fmt.Errorf("stage: %w", status.Error(codes.InvalidArgument, "x")), codes.InvalidArgument},
		// The class the driver gave decides, whatever its causes are: a
		// refusal that says why with an interrupted or unavailable cause is
		// still that refusal, as the status it replaces was.
		{"failf class decides", Failf(ErrInUse, "in use: %w", context.Canceled), codes.FailedPrecondition},
		{"failf over a pool class", Failf(ErrState, "damaged: %w", fmt.Errorf("%w: x", pool.ErrUnavailable)), codes.FailedPrecondition},
		{"outer failf decides", Failf(ErrInUse, "refusing: %w", Failf(pool.ErrNotFound, "gone")), codes.FailedPrecondition},
		{"failf wrapped", fmt.Errorf("publish: %w", Failf(ErrNotStaged, "stage first")), codes.FailedPrecondition},
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
			got := GRPCError(tc.err)
			if status.Code(got) != tc.code {
				t.Errorf("grpcError(%v) = %v, want %v", tc.err, status.Code(got), tc.code)
			}
			if tc.code != codes.OK && status.Convert(got).Message() == "" {
				t.Error("message lost")
			}
		})
	}
	if GRPCError(nil) != nil {
		t.Error("grpcError(nil) is not nil")
	}
	// failf's message is the format's alone: what the caller reads.
	err := fmt.Errorf("ctx: %w", Failf(pool.ErrNotFound, "volume %s does not exist", "v"))
	if msg := status.Convert(GRPCError(err)).Message(); msg != "ctx: volume v does not exist" {
		t.Errorf("message %q", msg)
	}
	if !errors.Is(err, pool.ErrNotFound) {
		t.Error("failf lost its class for errors.Is")
	}
}

// gone is what an idempotent delete or unpublish takes as done: it agrees
// with the code the caller would see (NOT_FOUND), never with a cause hidden
// under a busy or unavailable pool or under another class the driver gave.
func TestGone(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("load: %w", pool.ErrNotFound), true},
		{Failf(pool.ErrNotReady, "still being created"), true},
		{fmt.Errorf("lock: %w: %w", pool.ErrBusy, pool.ErrNotFound), false},
		{fmt.Errorf("%w: %w", context.Canceled, pool.ErrNotFound), false},
		{Failf(ErrInUse, "refusing: %w", pool.ErrNotFound), false},
		{fmt.Errorf("open /dev/loop-control: %w", os.ErrNotExist), false},
		{errors.New("EIO"), false},
	} {
		if got := Gone(tc.err); got != tc.want {
			t.Errorf("gone(%v) = %v, want %v", tc.err, got, tc.want)
		}
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
			got := GRPCError(err)
			if status.Code(got) != codes.Unavailable {
				t.Fatalf("code %v, want Unavailable: %v", status.Code(got), got)
			}
			if msg := status.Convert(got).Message(); strings.Count(msg, "pool unavailable") != 1 {
				t.Errorf("message repeats or lacks its cause: %q", msg)
			}
		})
	}
}
