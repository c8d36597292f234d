package pool

import "errors"

// The errors this package returns are classified by these sentinels (test with
// errors.Is); the driver maps each to one gRPC code in one table
// (internal/driver/errors.go). A missing volume or snapshot wraps os.ErrNotExist.
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
	// ErrBusy marks a lock another process or node holds past the caller's
	// patience; the call may be retried.
	ErrBusy = errors.New("busy")
)

// Sentinels lists every error above.
var Sentinels = []error{ErrInvalidID, ErrBadRange, ErrOutOfRange, ErrNoSpace, ErrExists, ErrNotReady, ErrCorrupt, ErrUnavailable, ErrBusy}
