package health

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// PoolSpace is the pool filesystem's size as statfs reports it now.
type PoolSpace struct {
	Pool  string
	Path  string
	Total int64
	Free  int64 // what an unprivileged writer (the loop driver) can still use
	Err   error // statfs failed: pool missing or its filesystem gone
}

// UsedFraction is the share of the pool filesystem in use.
func (s PoolSpace) UsedFraction() float64 {
	if s.Total <= 0 {
		return 0
	}
	return 1 - float64(s.Free)/float64(s.Total)
}

// StatPool measures the pool's filesystem: one statfs.
func StatPool(p *pool.Pool) PoolSpace {
	s := PoolSpace{Pool: p.Name(), Path: p.Path()}
	var st unix.Statfs_t
	if err := unix.Statfs(p.Path(), &st); err != nil {
		s.Err = fmt.Errorf("statfs %s: %w", p.Path(), err)
		return s
	}
	s.Total = int64(st.Blocks) * st.Bsize
	s.Free = int64(st.Bavail) * st.Bsize
	return s
}

// VolumeReport is the controller-side health of one volume of a pool.
type VolumeReport struct {
	ID pool.VolumeID
	// Volume is nil when volume.json could not be read.
	Volume *pool.Volume
	// AllocatedBytes is what the image holds on the pool's filesystem.
	AllocatedBytes int64
	Issues         []Issue
	// Gone is set when the volume was deleted while it was being checked (its
	// image or data vanished with its directory): a delete, maybe on another
	// node, not data loss. Issues is empty then.
	Gone bool
}

// PoolScan is the health of every volume of one pool, for listing and metrics.
type PoolScan struct {
	Space   PoolSpace
	Volumes []VolumeReport
}

// ScanPool checks every volume of p that is not still being created, damaged
// ones included: a volume whose metadata cannot be read is exactly the one an
// operator must hear about. It lists the pool once and stats each image once.
func ScanPool(p *pool.Pool, o Options) (PoolScan, error) {
	scan := PoolScan{Space: StatPool(p)}
	entries, err := p.List()
	if err != nil {
		return scan, err
	}
	for _, e := range entries {
		if e.Err == nil && e.Volume.State != pool.StateReady {
			continue
		}
		if r := CheckVolume(p, e, scan.Space, o); !r.Gone {
			scan.Volumes = append(scan.Volumes, r)
		}
	}
	return scan, nil
}

// CheckVolume runs the controller-side checks of one volume: metadata readable,
// image present and as large as recorded, and room in the pool for the image to
// grow into. space is the pool's StatPool, shared by every volume of one scan.
func CheckVolume(p *pool.Pool, e pool.Entry, space PoolSpace, o Options) VolumeReport {
	r := checkVolume(p, e, space, o)
	for _, is := range r.Issues {
		// A DeleteVolume renames the volume's directory away, so a volume
		// read a moment ago loses its image and data directory at once: on a
		// shared pool another node's delete is seen here at any point.
		if (is.Reason == ReasonImageMissing || is.Reason == ReasonDataMissing) && !p.VolumeExists(e.ID) {
			return VolumeReport{ID: e.ID, Volume: e.Volume, Gone: true}
		}
	}
	return r
}

func checkVolume(p *pool.Pool, e pool.Entry, space PoolSpace, o Options) VolumeReport {
	r := VolumeReport{ID: e.ID, Volume: e.Volume}
	if e.Err != nil {
		meta := p.MetadataPath(e.ID)
		r.Issues = append(r.Issues, Issue{Status: Inaccessible, Reason: ReasonMetadataUnreadable, Message: fmt.Sprintf(
			"metadata of volume %s (%s) cannot be read: %v. The driver cannot stage, expand or account for this volume until it is fixed; "+
				"the data in %s is untouched. Restore volume.json from a backup (or rewrite it with the volume's id, size and fsType) and the condition clears on the next check",
			e.ID, meta, e.Err, p.ImagePath(e.ID))})
		return r
	}
	v := e.Volume
	if v.Layout != pool.LayoutImage {
		return checkData(p, e.ID, r)
	}
	image := p.ImagePath(e.ID)
	size, allocated, err := p.Images().EntryStat(e)
	if err != nil {
		switch {
		case errors.Is(err, pool.ErrCorrupt):
			r.Issues = append(r.Issues, Issue{Status: Inaccessible, Reason: ReasonUnsafeEntry, Message: fmt.Sprintf(
				"volume %s: %v. poolcsi will not stage, copy or grow it. Put the volume's own image back at %s (or delete the PVC); "+
					"anyone who can write pool %s can do this, so check who did", e.ID, err, image, p.Name())})
		case errors.Is(err, pool.ErrNotFound):
			r.Issues = append(r.Issues, Issue{Status: DataLoss, Reason: ReasonImageMissing, Message: fmt.Sprintf(
				"image file %s of volume %s is missing: the volume's data is gone from pool %s. "+
					"Restore the image from a backup to that path, or delete the PVC and provision a new volume",
				image, e.ID, p.Name())})
		default:
			r.Issues = append(r.Issues, Issue{Status: Inaccessible, Reason: ReasonImageUnreadable, Message: fmt.Sprintf(
				"image file %s of volume %s cannot be examined: %v. Check the pool's filesystem (%s) and the file's permissions",
				image, e.ID, err, p.Path())})
		}
		return r
	}
	r.AllocatedBytes = allocated
	if size < v.CapacityBytes {
		r.Issues = append(r.Issues, Issue{Status: DataLoss, Reason: ReasonImageTruncated, Message: fmt.Sprintf(
			"image file %s of volume %s is %d bytes but the volume is recorded as %d bytes: the end of its filesystem is cut off. "+
				"Stop the pods using it, restore the image from a backup, or grow it back (truncate -s %d %s) and run %s before use",
			image, e.ID, size, v.CapacityBytes, v.CapacityBytes, image, repairCommand(v.FSType, image))})
	}
	r.Issues = append(r.Issues, poolRoom(p, e.ID, v, r.AllocatedBytes, space, o)...)
	return r
}

// poolRoom tells whether a sparse image can still get the blocks it was promised.
// A fully allocated image cannot fail for lack of pool space, so only images
// that can still grow are flagged.
func poolRoom(p *pool.Pool, id pool.VolumeID, v *pool.Volume, allocated int64, space PoolSpace, o Options) []Issue {
	unbacked := v.CapacityBytes - allocated
	if unbacked <= 0 || space.Err != nil || space.Total <= 0 {
		return nil
	}
	used := space.UsedFraction()
	switch {
	case used >= o.PoolFullThreshold:
		return []Issue{{Status: Degraded, Reason: ReasonPoolNearlyFull, Message: fmt.Sprintf(
			"pool %s is %s full (%s free of %s, threshold %s) and volume %s's sparse image can still grow by %s: "+
				"writes inside the volume fail with I/O errors once the pool fills. Free space in %s, grow the pool's filesystem, or move volumes to another pool",
			p.Name(), percent(used), bytesIEC(space.Free), bytesIEC(space.Total), percent(o.PoolFullThreshold), id, bytesIEC(unbacked), p.Path())}}
	case space.Free < unbacked:
		return []Issue{{Status: Degraded, Reason: ReasonPoolNearlyFull, Message: fmt.Sprintf(
			"pool %s has %s free but volume %s's sparse image can still grow by %s (the pool is overcommitted): "+
				"writes inside the volume fail with I/O errors once the pool fills. Free space in %s, grow the pool's filesystem, or lower the pool's overcommit",
			p.Name(), bytesIEC(space.Free), id, bytesIEC(unbacked), p.Path())}}
	}
	return nil
}

// minFreeBytes is what a pool needs free to be ready: below it no volume can be
// created and every sparse image's next block allocation fails.
const minFreeBytes = 4 << 20

// CheckPoolReady is Probe's check of one pool: present, writable and not out of
// space. It costs a few system calls, and returns the space it measured so a
// caller needs no second statfs.
func CheckPoolReady(p *pool.Pool) (PoolSpace, error) {
	if err := p.Check(); err != nil {
		return PoolSpace{}, err
	}
	s := StatPool(p)
	if s.Err != nil {
		return s, fmt.Errorf("pool %s: %w", p.Name(), s.Err)
	}
	if s.Free < minFreeBytes {
		return s, fmt.Errorf("pool %s: filesystem at %s is out of space (%s free of %s): volumes cannot be created and sparse images cannot grow; free space or grow the filesystem",
			p.Name(), p.Path(), bytesIEC(s.Free), bytesIEC(s.Total))
	}
	return s, nil
}

// PoolFullMessage describes a pool over the full threshold, for storage health.
func PoolFullMessage(s PoolSpace, o Options) string {
	return fmt.Sprintf("pool %s is %s full (%s free of %s, threshold %s): sparse volume images in it can fail writes once it fills. Free space in %s or grow its filesystem",
		s.Pool, percent(s.UsedFraction()), bytesIEC(s.Free), bytesIEC(s.Total), percent(o.PoolFullThreshold), s.Path)
}

// checkData checks a dir volume's data directory: there, a real directory.
func checkData(p *pool.Pool, id pool.VolumeID, r VolumeReport) VolumeReport {
	h, err := p.OpenData(id)
	switch {
	case err == nil:
		_ = h.Close()
	case errors.Is(err, pool.ErrCorrupt):
		r.Issues = append(r.Issues, Issue{Status: Inaccessible, Reason: ReasonUnsafeEntry, Message: fmt.Sprintf(
			"volume %s: %v. poolcsi will not stage or copy it. Put the volume's own directory back at %s (or delete the PVC)", id, err, p.DataPath(id))})
	case errors.Is(err, pool.ErrNotFound):
		r.Issues = append(r.Issues, Issue{Status: DataLoss, Reason: ReasonDataMissing, Message: fmt.Sprintf(
			"data directory %s of volume %s is missing: the volume's data is gone from pool %s. Restore it from a backup, or delete the PVC", p.DataPath(id), id, p.Name())})
	default:
		r.Issues = append(r.Issues, Issue{Status: Inaccessible, Reason: ReasonImageUnreadable, Message: fmt.Sprintf(
			"data directory %s of volume %s cannot be examined: %v", p.DataPath(id), id, err)})
	}
	return r
}
