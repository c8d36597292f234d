package pool

import (
	"errors"
	"fmt"
	"io/fs"
)

// The errors this package returns are classified by these sentinels (test with
// errors.Is); the driver maps each to one gRPC code in one table
// (internal/driver/errors.go). Causes from the kernel are wrapped too (%w), so
// an ENOENT in a chain means nothing by itself: a volume or snapshot that is
// not there is ErrNotFound, a pool that cannot serve is ErrUnavailable.
// Every sentinel is listed in Sentinels, so that table is tested against all.
var (
	// ErrInvalidID marks an ID or name that must never be turned into a path.
	ErrInvalidID = errors.New("invalid identifier")
	// ErrBadRange marks a capacity range that contradicts itself.
	ErrBadRange = errors.New("invalid capacity range")
	// ErrOutOfRange marks a size this driver will not make.
	ErrOutOfRange = errors.New("capacity out of range")
	// ErrNoSpace marks a pool that cannot back what was asked.
	ErrNoSpace = errors.New("pool has no room")
	// ErrExists marks a request that names an existing volume with other attributes.
	ErrExists = errors.New("volume exists with other attributes")
	// ErrNotReady marks a volume that cannot be changed because it is still being
	// created.
	ErrNotReady = errors.New("volume is not ready")
	// ErrCorrupt marks metadata or data that exists but cannot be trusted.
	ErrCorrupt = errors.New("volume metadata is damaged")
	// ErrUnavailable marks a pool that cannot serve now: missing, not mounted,
	// not initialised, not writable. Every error of Check wraps it.
	ErrUnavailable = errors.New("pool unavailable")
	// ErrNotFound marks a volume or snapshot (its metadata, image or data
	// directory) that is not there. Only the pool says this: an ENOENT from
	// anything else (a missing /dev/loop-control, a staging parent, the pool's
	// own directory) is not a missing volume.
	ErrNotFound = errors.New("not found")
	// ErrBusy marks a lock another process or node holds past the caller's
	// patience; the call may be retried.
	ErrBusy = errors.New("busy")
)

// Sentinels lists every error above.
var Sentinels = []error{ErrInvalidID, ErrBadRange, ErrOutOfRange, ErrNoSpace, ErrExists, ErrNotReady, ErrCorrupt, ErrUnavailable, ErrNotFound, ErrBusy}

// missing tells whether err says that a file or directory of the pool is not
// there. An unavailable pool is not that, even when its cause is an ENOENT (its
// directory is gone, its share not mounted).
func missing(err error) bool {
	return errors.Is(err, fs.ErrNotExist) && !errors.Is(err, ErrUnavailable)
}

// notFound classifies err as ErrNotFound when it says that what was looked for
// is missing, and returns it unchanged otherwise.
func notFound(err error) error {
	if missing(err) && !errors.Is(err, ErrNotFound) {
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	return err
}
