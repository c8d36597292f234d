package driver

import (
	"context"
	"errors"
	"os"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// errorCodes is the one table from an error's class to its gRPC code, in order:
// the first class an error belongs to (errors.Is) decides. A pool that cannot
// serve is UNAVAILABLE, and one that is busy ABORTED, whatever volume the call
// was looking for, so ErrUnavailable and ErrBusy come before ErrNotFound; the
// caller's own context ending decides before anything it interrupted. An ENOENT
// alone has no class: only the pool says that a volume is not there.
var errorCodes = []struct {
	class error
	code  codes.Code
}{
	{context.Canceled, codes.Canceled},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{os.ErrDeadlineExceeded, codes.DeadlineExceeded},
	{pool.ErrUnavailable, codes.Unavailable},
	{pool.ErrBusy, codes.Aborted},
	{pool.ErrInvalidID, codes.InvalidArgument},
	{pool.ErrBadRange, codes.InvalidArgument},
	{pool.ErrOutOfRange, codes.OutOfRange},
	{pool.ErrNoSpace, codes.ResourceExhausted},
	{pool.ErrExists, codes.AlreadyExists},
	{pool.ErrNotReady, codes.NotFound},
	{pool.ErrNotFound, codes.NotFound},
	{pool.ErrCorrupt, codes.Internal},
	{errForeignMount, codes.FailedPrecondition},
}

// grpcError turns an error into a gRPC status. A status passes through
// unchanged; anything else gets the code of its class in errorCodes, INTERNAL
// when it has none, and keeps its message, which says what to do.
func grpcError(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(codeOf(err), err.Error())
}

func codeOf(err error) codes.Code {
	for _, c := range errorCodes {
		if errors.Is(err, c.class) {
			return c.code
		}
	}
	return codes.Internal
}
