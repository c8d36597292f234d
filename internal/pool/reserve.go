package pool

import (
	"errors"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// The reserve keeps a full pool emptiable through the driver. Pods fill sparse
// images (and anyone may write a shared pool), so a pool can be full whatever
// admission decided; a delete must still rename the volume into trash/ and
// write the ledger, and an unstage or unpublish must still write volume.json,
// and each of those writes needs a block or two. <pool>/reserve holds
// reserveBytes allocated for them: a write that gives room back (a delete, a
// record that does not grow) and fails for lack of space frees the reserve and
// is tried once more. Nothing else uses it: a create, a growth or a claim on
// a full pool fails as before. The next ledger transaction (any create,
// delete, growth or snapshot) allocates it again once there is room.

const (
	reserveFile  = "reserve"
	reserveBytes = 4 << 20
)

// reserveState says what this process knows of the pool's reserve file.
type reserveState struct {
	// held: the reserve was allocated whole when last looked at, so a
	// transaction need not look again. Cleared when it is spent.
	held atomic.Bool
}

// noSpace tells whether err is a lack of space (or of quota) for a write.
func noSpace(err error) bool {
	return errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT)
}

// keepReserve allocates the reserve file if it is not whole (best effort: on a
// full pool it stays as it is, and a later transaction tries again).
func (lg Ledger) keepReserve() {
	if lg.p.reserve.held.Load() {
		return
	}
	f, err := fsx.OpenRegular(lg.p.cfg.Path, reserveFile, unix.O_RDWR|unix.O_CREAT, 0o600)
	if err != nil {
		return // a link or a FIFO in its place: pool check names it
	}
	defer f.Close()
	if err := unix.Fallocate(int(f.Fd()), 0, 0, reserveBytes); err != nil {
		return
	}
	if f.Sync() == nil {
		lg.p.reserve.held.Store(true)
	}
}

// spendReserve gives the reserve's blocks back to the filesystem, and tells
// whether it held any.
func (lg Ledger) spendReserve() bool {
	lg.p.reserve.held.Store(false)
	f, err := fsx.OpenRegular(lg.p.cfg.Path, reserveFile, unix.O_RDWR, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Blocks == 0 {
		return false
	}
	return unix.Ftruncate(int(f.Fd()), 0) == nil
}

// freeing runs a write that gives room back (or takes none for good): if it
// fails for lack of space, the reserve is spent and the write tried once more.
func (lg Ledger) freeing(write func() error) error {
	err := write()
	if noSpace(err) && lg.spendReserve() {
		err = write()
	}
	return err
}
