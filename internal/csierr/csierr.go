// Package csierr holds the driver's error classes and the one ordered table that
// turns them into gRPC codes, applied once per handler (ToStatus).
package csierr

import (
	"context"
	"errors"
	"fmt"
	"os"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Inside the driver an error is a domain error: one of the pool's sentinels or
// one of these, wrapped with context (%w). It becomes a gRPC status once, when
// the RPC handler returns (toStatus), through errorCodes. A status is made
// directly only for a request that is malformed (INVALID_ARGUMENT) and for the
// few codes CSI mandates that mean nothing inside (an unknown starting_token).
var (
	// errInvalid: a request field that is malformed, or asks what this driver
	// cannot do, found by a helper whose answer a caller may re-word (a
	// path, an access mode, a share option). The handlers' own checks of a
	// request make INVALID_ARGUMENT statuses directly.
	ErrInvalid = errors.New("invalid argument")
	// errNoPool: the pool an ID names is not one of this driver's (not
	// configured, or a share that holds no pool), so nothing of it is here.
	ErrNoPool = errors.New("no such pool")
	// errNoNode: the node a call names cannot reach the volume's pool.
	ErrNoNode = errors.New("node cannot reach the pool")
	// errNotAtPath: the volume is not staged or published at the path a node
	// call names (NodeGetVolumeStats, NodeExpandVolume).
	ErrNotAtPath = errors.New("volume is not at that path")
	// errNotStaged: a call that needs the volume staged on this node first.
	ErrNotStaged = errors.New("volume is not staged here")
	// errInUse: the volume is staged, published or mounted where the call
	// would have to take it away (delete, a second writer), or is written
	// where a group snapshot cannot freeze it.
	ErrInUse = errors.New("volume is in use")
	// errFenced: the volume, or this node, is fenced off (docs/fencing.md).
	ErrFenced = errors.New("fenced")
	// errPathTaken: a staging or target path holds something else, or this
	// volume with other attributes.
	ErrPathTaken = errors.New("path holds another mount")
	// errState: the volume is in a state the call must not act on (its
	// metadata damaged, its image truncated, another filesystem on it, a size
	// the controller has not granted yet).
	ErrState = errors.New("volume is not in a state for this call")
	// errShareUnknown: a share this node never mounted, named by an ID that
	// carries no tag to prove a StorageClass named it: nothing is mounted.
	ErrShareUnknown = errors.New("share is not known here")
	// errNodeFull: the node has as many volumes published as it may hold.
	ErrNodeFull = errors.New("node is at its volume limit")
	// errTopology: the volume cannot be made where the request's topology
	// asks.
	ErrTopology = errors.New("topology cannot be satisfied")
	// ErrForeignMount: an unmount refused because what is mounted at the
	// path is not this volume.
	ErrForeignMount = errors.New("refusing to unmount what is not this volume")
)

// errorCodes is the one table from an error's class to its gRPC code, in order:
// the first class an error belongs to (errors.Is) decides, unless the driver
// gave the error its class itself (failf): then that class decides, whatever
// causes it wraps. A pool that cannot serve is UNAVAILABLE, and one that is
// busy ABORTED, whatever volume the call was looking for, so ErrUnavailable and
// ErrBusy come before ErrNotFound; the caller's own context ending decides
// before anything it interrupted. An ENOENT alone has no class: only the pool
// says that a volume is not there.
var errorCodes = []struct {
	class error
	code  codes.Code
}{
	{context.Canceled, codes.Canceled},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{os.ErrDeadlineExceeded, codes.DeadlineExceeded},
	{pool.ErrUnavailable, codes.Unavailable},
	{pool.ErrBusy, codes.Aborted},
	{mount.ErrGrowUnderWay, codes.Aborted},
	{pool.ErrInvalidID, codes.InvalidArgument},
	{pool.ErrBadRange, codes.InvalidArgument},
	{ErrInvalid, codes.InvalidArgument},
	{pool.ErrOutOfRange, codes.OutOfRange},
	{pool.ErrNoSpace, codes.ResourceExhausted},
	{ErrNodeFull, codes.ResourceExhausted},
	{ErrTopology, codes.ResourceExhausted},
	{pool.ErrExists, codes.AlreadyExists},
	{ErrPathTaken, codes.AlreadyExists},
	{pool.ErrNotReady, codes.NotFound},
	{pool.ErrNotFound, codes.NotFound},
	{ErrNoPool, codes.NotFound},
	{ErrNoNode, codes.NotFound},
	{ErrNotAtPath, codes.NotFound},
	{pool.ErrCorrupt, codes.Internal},
	{ErrForeignMount, codes.FailedPrecondition},
	{ErrNotStaged, codes.FailedPrecondition},
	{ErrInUse, codes.FailedPrecondition},
	{ErrFenced, codes.FailedPrecondition},
	{ErrState, codes.FailedPrecondition},
	{ErrShareUnknown, codes.FailedPrecondition},
}

// Sentinels lists the driver's own classes, for the table test.
var Sentinels = []error{ErrInvalid, ErrForeignMount, ErrNoPool, ErrNoNode, ErrNotAtPath, ErrNotStaged, ErrInUse, ErrFenced, ErrPathTaken, ErrState, ErrShareUnknown, ErrNodeFull, ErrTopology}

// classed is an error the driver gave a class: its message is exactly the
// format's (what the caller is told), and its class decides its code.
type classed struct {
	class error
	err   error
}

func (e *classed) Error() string   { return e.err.Error() }
func (e *classed) Unwrap() []error { return []error{e.class, e.err} }

// Failf is fmt.Errorf with a class: errors.Is(err, class) holds, the message
// is the format's alone, and the class decides the code even when a cause
// wrapped with %w belongs to another.
func Failf(class error, format string, args ...any) error {
	return &classed{class: class, err: fmt.Errorf(format, args...)}
}

// ToStatus is deferred by every RPC handler: the error it returns becomes the
// status its caller gets, here and nowhere else.
func ToStatus(err *error) { *err = GRPCError(*err) }

// GRPCError turns an error into a gRPC status. A status passes through
// unchanged; anything else gets the code of its class, INTERNAL when it has
// none, and keeps its message, which says what to do.
func GRPCError(err error) error {
	if err == nil {
		return nil
	}
	var c *classed
	if errors.As(err, &c) {
		return status.Error(CodeOf(c.class), err.Error())
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(CodeOf(err), err.Error())
}

func CodeOf(err error) codes.Code {
	for _, c := range errorCodes {
		if errors.Is(err, c.class) {
			return c.code
		}
	}
	return codes.Internal
}

// ClassOf is the class that decides what err means: the one the driver gave it
// (failf), else the first class of errorCodes it belongs to; nil for none.
// A handler that must tell "gone" from "failed" asks this, not errors.Is, so
// that it agrees with the code its caller would see: a volume that cannot be
// looked up because the pool is unavailable or busy is not gone.
func ClassOf(err error) error {
	var c *classed
	if errors.As(err, &c) {
		return c.class
	}
	for _, c := range errorCodes {
		if errors.Is(err, c.class) {
			return c.class
		}
	}
	return nil
}

// Gone tells whether err says that the volume is not there (or not made
// yet): what an idempotent delete or unpublish takes as done.
func Gone(err error) bool {
	c := ClassOf(err)
	return errors.Is(c, pool.ErrNotFound) || errors.Is(c, pool.ErrNotReady) // c is a bare class
}
