package pool

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// This file holds what the driver and the health checks need to know about a
// volume's or snapshot's data without knowing the names of its files:
// existence, a dir volume's data directory, an image's size. Nothing outside
// this package builds a path inside a pool.

// MetadataPath is a volume's volume.json, for messages that tell an operator
// which file to repair.
func (p *Pool) MetadataPath(id VolumeID) string { return filepath.Join(p.Dir(id), metadataFile) }

// VolumeExists tells whether the volume's directory exists, metadata or not.
func (p *Pool) VolumeExists(id VolumeID) bool {
	if p.awaitOpen() != nil {
		// Not answering since Open: what a dead pool answers, after a
		// bounded wait instead of the hang (OpenPending).
		return false
	}
	_, err := os.Lstat(p.Dir(id))
	return err == nil
}

// Exists tells whether the snapshot's directory exists, ready or not.
func (ss Snapshots) Exists(id SnapshotID) bool {
	_, err := os.Lstat(ss.Dir(id))
	return err == nil
}

// MakeData makes the data directory of a dir volume still in state creating.
// A half-made data directory from an interrupted attempt holds no user data
// and is removed first. create makes the directory (a plain directory, a btrfs
// subvolume, a project-quota directory) with its limit and returns the quota
// ID it took; claim takes a quota ID of kind for this volume through the
// pool's quota ID index (quotaids.go), or tells that another volume holds it.
// The caller holds the volume's lock (Finish); no pool-wide lock is taken and
// no other volume is read.
func (p *Pool) MakeData(ctx context.Context, v *Volume, kind string, create func(data string, claim func(qid uint64) (bool, error)) (uint64, error)) (uint64, error) {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return 0, err
	}
	if v.State != StateCreating {
		return 0, fmt.Errorf("volume %s is %s, not creating: refusing to remake its data", id, v.State)
	}
	if err := p.files().checkDir(volumeRel(id)); err != nil {
		return 0, err
	}
	data := p.DataPath(id)
	if err := os.RemoveAll(data); err != nil {
		return 0, fmt.Errorf("remove half-made data of volume %s: %w", id, err)
	}
	return create(data, func(qid uint64) (bool, error) { return p.QuotaIDs().Claim(ctx, kind, id, qid) })
}

// DataExists tells whether a dir volume's data directory is there.
func (p *Pool) DataExists(id VolumeID) bool {
	h, err := p.OpenData(id)
	if err != nil {
		return false
	}
	_ = h.Close()
	return true
}

// Images is the image files of a pool's image volumes: made sparse or as a
// copy while the volume is creating, preallocated, made durable, discarded,
// and measured. Pool keeps where they are (ImagePath, OpenImage) and the
// volume lifecycle around them (Reserve, Finish, MarkReady, Delete).
type Images struct{ p *Pool }

// Images is the pool's volume images.
func (p *Pool) Images() Images { return Images{p} }

// Size is the size of a volume's image file. A missing image is
// ErrNotFound; a link or anything but a regular file is ErrCorrupt and is
// never followed.
func (im Images) Size(id VolumeID) (int64, error) {
	h, err := im.p.OpenImage(id)
	if err != nil {
		return 0, fmt.Errorf("volume %s: image: %w", id, err)
	}
	defer h.Close()
	fi, err := h.f.Stat()
	if err != nil {
		return 0, fmt.Errorf("volume %s: image: %w", id, err)
	}
	return fi.Size(), nil
}

// Stat is the size of a volume's image file and the bytes it holds on the
// pool's filesystem, from a descriptor opened without following links (errors
// as Size).
func (im Images) Stat(id VolumeID) (size, allocated int64, err error) {
	st, err := im.fstat(id)
	if err != nil {
		return 0, 0, err
	}
	return st.Size, st.Blocks * 512, nil
}

// Identity is the (st_dev, st_ino) of volume id's image as the pool's path
// resolves it now, reached below the pool's root without following a link
// and never opened for I/O: what a loop device attached from it reports
// (lo_device, lo_inode) while the path shows the filesystem it writes to.
// A missing image is ErrNotFound; a pool's root that does not open,
// ErrUnavailable.
func (im Images) Identity(id VolumeID) (dev, ino uint64, err error) {
	st, err := im.fstat(id)
	if err != nil {
		return 0, 0, err
	}
	return st.Dev, st.Ino, nil
}

// fstat is the stat of volume id's image through a descriptor opened below
// the pool's root without following links.
func (im Images) fstat(id VolumeID) (unix.Stat_t, error) {
	var st unix.Stat_t
	h, err := im.p.OpenImage(id)
	if err != nil {
		return st, fmt.Errorf("volume %s: image: %w", id, err)
	}
	defer h.Close()
	if err := unix.Fstat(int(h.f.Fd()), &st); err != nil {
		return st, fmt.Errorf("volume %s: image: %w", id, err)
	}
	return st, nil
}
