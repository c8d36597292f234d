package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
)

// ErrNotReady marks a volume that cannot be changed because it is still being
// created.
var ErrNotReady = errors.New("volume is not ready")

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
// Locks: the volume's lock, then the pool's lock around the capacity decision;
// callers hold no pool lock.
func (p *Pool) Grow(ctx context.Context, id VolumeID, size, limit int64) (*Volume, error) {
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
	if v.Layout != LayoutImage {
		return nil, fmt.Errorf("volume %s has layout %s: only image volumes grow here", id, v.Layout)
	}
	image := p.ImagePath(id)
	fi, err := os.Stat(image)
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

	unlockPool, err := p.LockPool(ctx)
	if err != nil {
		return nil, err
	}
	defer unlockPool()
	u, err := p.Usage()
	if err != nil {
		return nil, err
	}
	growth := target - v.CapacityBytes
	if avail := p.AvailableBytes(u); growth > avail {
		return nil, fmt.Errorf("%w: pool %s can back %d more bytes (free %d, already promised to sparse volumes %d, overcommit %.2f); growing volume %s from %d to %d bytes needs %d",
			ErrNoSpace, p.Name, avail, u.FreeBytes, u.UnbackedBytes, p.Overcommit, id, v.CapacityBytes, target, growth)
	}
	if fi.Size() < target {
		if err := growFile(image, target); err != nil {
			return nil, err
		}
	}
	v.CapacityBytes = target
	if err := p.Save(v); err != nil {
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
