package pool

import (
	"context"
	"fmt"
	"os"
	"syscall"
)

// MaxIOLimit bounds one I/O limit: far above any device, and small enough
// that no arithmetic on it overflows.
const MaxIOLimit = int64(1) << 50

// IOLimits are what the kernel's block throttling holds a volume's pods to
// (a VolumeAttributesClass's readBytesPerSecond, writeBytesPerSecond,
// readIOPS, writeIOPS); 0 is no limit.
type IOLimits struct {
	ReadBytesPerSecond  int64 `json:"readBytesPerSecond,omitempty"`
	WriteBytesPerSecond int64 `json:"writeBytesPerSecond,omitempty"`
	ReadIOPS            int64 `json:"readIOPS,omitempty"`
	WriteIOPS           int64 `json:"writeIOPS,omitempty"`
}

// IsZero tells whether no limit is set.
func (l IOLimits) IsZero() bool { return l == IOLimits{} }

func (l IOLimits) validate() error {
	for _, x := range []int64{l.ReadBytesPerSecond, l.WriteBytesPerSecond, l.ReadIOPS, l.WriteIOPS} {
		if x < 0 || x > MaxIOLimit {
			return fmt.Errorf("ioLimits: %d is outside 0..%d", x, MaxIOLimit)
		}
	}
	return nil
}

// Allocator allocates the byte range [off, off+length) of f (fallocate
// mode 0, within f's size) and makes the allocation durable. The driver passes
// its kernel seam's, so the fake kernel can fail it.
type Allocator func(f *os.File, off, length int64) error

// Allocate makes every block of an image volume's file allocated, so a
// full pool can no longer fail its writes with ENOSPC. The bytes to allocate
// must fit now (admitAllocation), decided under the pool lock; a file already
// fully allocated costs one fstat. The caller holds the volume's lock. A
// failing allocate leaves the image as it was in size and content (blocks it
// did allocate read as zeros, as holes do), so the volume stays usable.
func (im Images) Allocate(ctx context.Context, v *Volume, allocate Allocator) error {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return err
	}
	h, err := im.p.OpenImage(id)
	if err != nil {
		return fmt.Errorf("volume %s: image: %w", id, err)
	}
	defer h.Close()
	fi, err := h.f.Stat()
	if err != nil {
		return fmt.Errorf("volume %s: image: %w", id, err)
	}
	if fi.Size() < v.CapacityBytes {
		return fmt.Errorf("%w: volume %s: image is %d bytes, %d recorded", ErrCorrupt, id, fi.Size(), v.CapacityBytes)
	}
	var allocated int64
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		allocated = st.Blocks * 512
	}
	need := fi.Size() - allocated
	if need <= 0 {
		return nil
	}
	tx, end, err := im.p.Ledger().begin(ctx)
	if err != nil {
		return err
	}
	defer end()
	if err := tx.admitAllocation(need, need, fmt.Sprintf("preallocating volume %s (%d bytes, %d allocated)", id, fi.Size(), allocated)); err != nil {
		return err
	}
	if err := allocateFile(h, 0, fi.Size(), allocate); err != nil {
		return fmt.Errorf("preallocate volume %s: %w", id, err)
	}
	return nil
}

// allocateFile opens the image a handle holds for writing (the handle is
// O_PATH, already checked a regular file reached without links) and
// allocates a range of it.
func allocateFile(h *Handle, off, length int64, allocate Allocator) error {
	f, err := os.OpenFile(h.Path(), os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open image: %w", err)
	}
	defer f.Close()
	return allocate(f, off, length)
}

// Modify applies change to a ready volume's record under its lock and, when
// the record then asks for preallocation, allocates the image (before the
// record is saved: a refusal or a failure leaves the record as it was).
// change may refuse; nothing is then changed.
func (p *Pool) Modify(ctx context.Context, id VolumeID, change func(v *Volume) error, allocate Allocator) (*Volume, error) {
	unlock, err := p.LockVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := p.Load(id)
	if err != nil {
		return nil, err
	}
	if v.State != StateReady {
		return nil, fmt.Errorf("%w: volume %s is %s", ErrNotReady, id, v.State)
	}
	before := *v
	if err := change(v); err != nil {
		return nil, err
	}
	if err := v.validate(); err != nil {
		return nil, fmt.Errorf("%w: volume %s: %w", ErrBadRange, id, err)
	}
	if v.Preallocate && v.Layout == LayoutImage {
		// Even when the record already said so: a filesystem's discards
		// (fstrim) punch holes through the loop device, and this fills them.
		if err := p.Images().Allocate(ctx, v, allocate); err != nil {
			return nil, err
		}
	}
	if before.IOLimits == v.IOLimits && before.Preallocate == v.Preallocate {
		return v, nil
	}
	if err := p.save(v, true); err != nil {
		return nil, err
	}
	return v, nil
}
