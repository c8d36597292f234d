// Package quota limits the size of dir-layout volumes with what the pool's
// filesystem offers: btrfs subvolumes with qgroup limits, or XFS/ext4 project
// quota. Where neither works a volume is still a plain directory, and the package
// says plainly that its size is not enforced.
package quota

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Mechanism names, recorded in volume.json.
const (
	KindBtrfs = "btrfs-qgroup"
	KindXFS   = "xfs-project"
	KindExt4  = "ext4-project"
	KindNone  = "none"
)

// Usage of one volume's data directory.
type Usage struct {
	UsedBytes  int64
	LimitBytes int64 // 0: no limit
}

// Backend makes, limits, measures and removes volume data directories on one
// filesystem.
type Backend interface {
	// Kind is one of the Kind* names.
	Kind() string
	// Enforced tells whether limits are really applied; Reason says why not.
	Enforced() bool
	Reason() string
	// Create makes dir (it must not exist) with the given limit and returns the
	// quota ID to record (subvolume or project ID; 0 when there is none). A
	// backend that picks IDs itself takes each through claim, which tells
	// whether the ID is now this volume's (false: another volume holds it).
	// claim may be nil where no other volume can hold one (tests).
	Create(ctx context.Context, dir string, limit int64, claim func(id uint64) (bool, error)) (uint64, error)
	// SetLimit changes the limit of a directory made by Create.
	SetLimit(ctx context.Context, dir string, id uint64, limit int64) error
	// Usage measures a directory made by Create.
	Usage(ctx context.Context, dir string, id uint64) (Usage, error)
	// Remove deletes what Create made, if it needs more than removing files
	// (a btrfs subvolume). It never touches anything but dir.
	Remove(ctx context.Context, dir string, id uint64) error
}

// Detect picks the backend for the filesystem holding path. It never fails: a
// filesystem without usable quota gets the None backend with the reason.
func Detect(ctx context.Context, path string) Backend {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return None{Why: fmt.Sprintf("cannot inspect the pool's filesystem: %v", err)}
	}
	switch st.Type {
	case unix.BTRFS_SUPER_MAGIC:
		return detectBtrfs(path)
	case unix.XFS_SUPER_MAGIC:
		return detectProject(path, KindXFS, "xfs", "mount the filesystem with -o prjquota")
	case unix.EXT4_SUPER_MAGIC:
		return detectProject(path, KindExt4, "ext4", "make it with mkfs.ext4 -O quota,project and mount it with -o prjquota")
	}
	return None{Why: fmt.Sprintf("the pool's filesystem (type 0x%x) has no quota poolcsi can use; use btrfs, or XFS/ext4 with project quota", st.Type)}
}

// None makes plain directories and enforces nothing.
type None struct{ Why string }

func (None) Kind() string     { return KindNone }
func (None) Enforced() bool   { return false }
func (n None) Reason() string { return n.Why }
func (None) Create(_ context.Context, dir string, _ int64, _ func(uint64) (bool, error)) (uint64, error) {
	if err := os.Mkdir(dir, 0o777); err != nil {
		return 0, fmt.Errorf("create %s: %w", dir, err)
	}
	// Mode 0777 like an NFS subdir: pods run as any UID and the directory is theirs.
	return 0, os.Chmod(dir, 0o777)
}
func (None) SetLimit(context.Context, string, uint64, int64) error { return nil }
func (None) Usage(context.Context, string, uint64) (Usage, error) {
	return Usage{}, errors.ErrUnsupported
}
func (None) Remove(context.Context, string, uint64) error { return nil }
