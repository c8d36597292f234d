package pool

import (
	"context"
	"fmt"
	"os"
)

// Grow raises an image volume's capacity to size bytes and returns the volume as
// recorded afterwards. A size at or below the recorded capacity changes nothing:
// volumes never shrink.
//
// The image file is grown (and fsynced) before volume.json records the new size,
// so the recorded capacity is never larger than the file. A crash in between
// leaves a file larger than its record; the next Grow adopts that larger size
// rather than truncating the file back, because a node may already have exposed
// those bytes to a filesystem (the loop device takes its size from the file).
// limit (0: none) bounds that adopted size.
//
// A preallocated volume's new range is allocated too (allocate), and must fit
// now; a failing allocate leaves the volume at its recorded size, usable.
//
// Locks: the volume's lock, then the pool's lock around the capacity decision;
// callers hold no pool lock.
func (p *Pool) Grow(ctx context.Context, id VolumeID, size, limit int64, allocate Allocator) (*Volume, error) {
	v, unlock, err := p.lockForGrowth(ctx, id, LayoutImage)
	if err != nil {
		return nil, err
	}
	defer unlock()
	h, err := p.OpenImage(id)
	if err != nil {
		return nil, fmt.Errorf("%w: volume %s: image: %w", ErrCorrupt, id, err)
	}
	defer h.Close()
	fi, err := h.f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%w: volume %s: image: %w", ErrCorrupt, id, err)
	}
	if fi.Size() < v.CapacityBytes {
		// Grow never leaves this state; something truncated the image, and
		// growing it would paper over lost data.
		return nil, fmt.Errorf("%w: volume %s: image is %d bytes, %d recorded", ErrCorrupt, id, fi.Size(), v.CapacityBytes)
	}
	target := max(size, fi.Size())
	if target <= v.CapacityBytes {
		return v, nil
	}
	if limit > 0 && target > limit {
		return nil, fmt.Errorf("%w: an interrupted expansion already grew volume %s's image to %d bytes, above limit_bytes %d; ask for at least that size", ErrOutOfRange, id, target, limit)
	}

	tx, end, err := p.Ledger().begin(ctx)
	if err != nil {
		return nil, err
	}
	defer end()
	if err := tx.admit(target-v.CapacityBytes, fmt.Sprintf("growing volume %s from %d to %d bytes", id, v.CapacityBytes, target)); err != nil {
		return nil, err
	}
	prealloc := v.Preallocate && allocate != nil
	if prealloc {
		if err := tx.admitAllocation(target-fi.Size(), 0, fmt.Sprintf("growing preallocated volume %s from %d to %d bytes", id, fi.Size(), target)); err != nil {
			return nil, err
		}
	}
	if err := tx.countGrowth(id, v.CapacityBytes, target); err != nil {
		return nil, err
	}
	if fi.Size() < target {
		if err := growFile(h.Path(), target); err != nil {
			return nil, err
		}
	}
	if prealloc {
		// From the recorded size: an interrupted growth's range is allocated too.
		if err := allocateFile(h, v.CapacityBytes, target-v.CapacityBytes, allocate); err != nil {
			return nil, fmt.Errorf("preallocate the growth of volume %s: %w", id, err)
		}
	}
	v.CapacityBytes = target
	if err := p.save(v, true); err != nil {
		return nil, err
	}
	return v, nil
}

// growFile extends a sparse file to size and makes the new length durable.
func growFile(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("grow image: %w", err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("grow image %s to %d bytes: %w", path, size, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("grow image %s: fsync: %w", path, err)
	}
	return nil
}

// GrowDir raises a dir volume's capacity to size bytes, admitted by the same
// capacity decision as every other growth, and returns the volume as recorded
// afterwards. setLimit raises the limit the pool's filesystem enforces (a
// quota), if any, before volume.json records the new size, so the record never
// promises more than the limit allows. A size at or below the recorded one
// changes nothing. Locks as Grow.
func (p *Pool) GrowDir(ctx context.Context, id VolumeID, size int64, setLimit func(v *Volume, size int64) error) (*Volume, error) {
	v, unlock, err := p.lockForGrowth(ctx, id, LayoutDir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if size <= v.CapacityBytes {
		return v, nil
	}
	tx, end, err := p.Ledger().begin(ctx)
	if err != nil {
		return nil, err
	}
	defer end()
	if err := tx.admit(size-v.CapacityBytes, fmt.Sprintf("growing volume %s from %d to %d bytes", id, v.CapacityBytes, size)); err != nil {
		return nil, err
	}
	if err := tx.countGrowth(id, v.CapacityBytes, size); err != nil {
		return nil, err
	}
	if setLimit != nil {
		if err := setLimit(v, size); err != nil {
			return nil, err
		}
	}
	v.CapacityBytes = size
	if err := p.save(v, true); err != nil {
		return nil, fmt.Errorf("volume %s: limit raised to %d but not recorded: %w", id, size, err)
	}
	return v, nil
}

// lockForGrowth takes a volume's lock and loads it, refusing one that is not
// ready or not of layout; the caller defers unlock.
func (p *Pool) lockForGrowth(ctx context.Context, id VolumeID, layout Layout) (*Volume, func(), error) {
	unlock, err := p.LockVolume(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	v, err := p.Load(id)
	switch {
	case err != nil:
	case v.State != StateReady:
		err = fmt.Errorf("%w: volume %s is %s", ErrNotReady, id, v.State)
	case v.Layout != layout:
		err = fmt.Errorf("volume %s has layout %s: only %s volumes grow here", id, v.Layout, layout)
	}
	if err != nil {
		unlock()
		return nil, nil, err
	}
	return v, unlock, nil
}

// countGrowth counts a volume's growth from size from to size to in the ledger
// before the volume's record says so (its pending entry): a crash between the
// two is settled back to what the record holds.
func (tx *ledgerTx) countGrowth(id VolumeID, from, to int64) error {
	return tx.apply(func(l *ledger) {
		l.ProvisionedBytes += to - from
		l.Pending = pending{Kind: pendingVolume, Key: id.Key, Bytes: to}
	})
}
