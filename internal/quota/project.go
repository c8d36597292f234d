package quota

import (
	"context"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Project limits a directory with XFS or ext4 project quota: the directory gets a
// project ID with the inherit flag (so everything created below it is charged to
// the project) and the project gets a hard block limit. It needs the filesystem
// mounted with project quota on (prjquota) and quotactl_fd(2) (Linux 5.14+); it
// uses system calls, no quota tools.
type Project struct {
	kind string
	pool string // any path on the filesystem, opened for quotactl_fd
}

func (p Project) Kind() string { return p.kind }
func (Project) Enforced() bool { return true }
func (Project) Reason() string { return "" }

// Kernel constants (linux/quota.h, linux/fs.h). x/sys/unix has none of them.
const (
	qGetInfo  = 0x800005
	qGetQuota = 0x800007
	qSetQuota = 0x800008
	prjQuota  = 2
	qifBLimit = 1 // QIF_BLIMITS
	qifBlock  = 1024

	fsIocGetXattr      = 0x801c581f // _IOR('X', 31, struct fsxattr)
	fsIocSetXattr      = 0x401c5820 // _IOW('X', 32, struct fsxattr)
	fsXflagProjInherit = 0x200
)

// qcmd is QCMD(cmd, PRJQUOTA) of linux/quota.h: every call here is about
// project quotas.
func qcmd(cmd uint32) uint32 { return cmd<<8 | prjQuota&0xff }

type ifDqblk struct {
	BHardLimit uint64
	BSoftLimit uint64
	CurSpace   uint64
	IHardLimit uint64
	ISoftLimit uint64
	CurInodes  uint64
	BTime      uint64
	ITime      uint64
	Valid      uint32
	_          uint32
}

type ifDqinfo struct {
	BGrace uint64
	IGrace uint64
	Flags  uint32
	Valid  uint32
}

type fsxattr struct {
	XFlags     uint32
	ExtSize    uint32
	NExtents   uint32
	ProjID     uint32
	CowExtSize uint32
	_          [8]byte
}

// limitBlock is the quotactl request that sets a hard limit of limit bytes,
// rounded up to the 1 KiB blocks quotactl counts in (rounding down would make the
// volume smaller than asked).
func limitBlock(limit int64) ifDqblk {
	return ifDqblk{BHardLimit: uint64((limit + qifBlock - 1) / qifBlock), Valid: qifBLimit}
}

// ProjectID derives a volume's project ID from its key. IDs below 2^16 are left to
// the admin's own projects; the rest of the 31-bit space is hashed into.
func ProjectID(key string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(key))
	return 1<<16 + h.Sum32()%(1<<31-1<<16)
}

func quotactlFD(path string, cmd uint32, id uint32, addr unsafe.Pointer) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if _, _, e := unix.Syscall6(unix.SYS_QUOTACTL_FD, uintptr(fd), uintptr(cmd), uintptr(id), uintptr(addr), 0, 0); e != 0 {
		return e
	}
	return nil
}

func detectProject(path, kind, fs, howto string) Backend {
	var info ifDqinfo
	if err := quotactlFD(path, qcmd(qGetInfo), 0, unsafe.Pointer(&info)); err != nil {
		return None{Why: fmt.Sprintf("%s project quota is not on for the pool's filesystem (%s) [quotactl Q_GETINFO: %v]", fs, howto, err)}
	}
	return Project{kind: kind, pool: path}
}

// SetProject gives dir a project ID that everything created below it inherits.
// XFS accepts it with quota off; ext4 needs the project feature.
func SetProject(dir string, id uint32) error {
	var fa fsxattr
	if err := ioctlPtr(dir, fsIocGetXattr, unsafe.Pointer(&fa)); err != nil {
		return fmt.Errorf("FS_IOC_FSGETXATTR %s: %w", dir, err)
	}
	fa.ProjID = id
	fa.XFlags |= fsXflagProjInherit
	if err := ioctlPtr(dir, fsIocSetXattr, unsafe.Pointer(&fa)); err != nil {
		return fmt.Errorf("FS_IOC_FSSETXATTR %s (project %d): %w", dir, id, err)
	}
	return nil
}

// GetProject reads dir's project ID and whether it is inherited.
func GetProject(dir string) (uint32, bool, error) {
	var fa fsxattr
	if err := ioctlPtr(dir, fsIocGetXattr, unsafe.Pointer(&fa)); err != nil {
		return 0, false, fmt.Errorf("FS_IOC_FSGETXATTR %s: %w", dir, err)
	}
	return fa.ProjID, fa.XFlags&fsXflagProjInherit != 0, nil
}

// maxProbes bounds the search for a free project ID: with IDs hashed into
// 2^31 - 2^16 values, 64 taken in a row means something is wrong (claims that
// cannot be read), not a full ID space.
const maxProbes = 64

func (p Project) Create(ctx context.Context, dir string, limit int64, claim func(id uint64) (bool, error)) (uint64, error) {
	if err := os.Mkdir(dir, 0o777); err != nil {
		return 0, fmt.Errorf("create %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		return 0, err
	}
	// The key (volumes/<key>/data) names the volume; hashing it keeps IDs stable,
	// and probing past claimed ones keeps two volumes from sharing one limit.
	id := ProjectID(filepath.Base(filepath.Dir(dir)))
	for probe := 0; claim != nil; probe++ {
		if probe == maxProbes {
			return 0, fmt.Errorf("no free project ID after %d probes from %d", maxProbes, ProjectID(filepath.Base(filepath.Dir(dir))))
		}
		ok, err := claim(uint64(id))
		if err != nil {
			return 0, err
		}
		if ok {
			break
		}
		id = ProjectID(strconv.FormatUint(uint64(id), 10))
	}
	if err := SetProject(dir, id); err != nil {
		return 0, err
	}
	return uint64(id), p.SetLimit(ctx, dir, uint64(id), limit)
}

func (p Project) SetLimit(_ context.Context, _ string, id uint64, limit int64) error {
	q := limitBlock(limit)
	if err := quotactlFD(p.pool, qcmd(qSetQuota), uint32(id), unsafe.Pointer(&q)); err != nil {
		return fmt.Errorf("set project %d limit to %d bytes: %w", id, limit, err)
	}
	return nil
}

func (p Project) Usage(_ context.Context, _ string, id uint64) (Usage, error) {
	var q ifDqblk
	if err := quotactlFD(p.pool, qcmd(qGetQuota), uint32(id), unsafe.Pointer(&q)); err != nil {
		return Usage{}, fmt.Errorf("project %d usage: %w", id, err)
	}
	return Usage{UsedBytes: int64(q.CurSpace), LimitBytes: int64(q.BHardLimit) * qifBlock}, nil
}

// Remove drops the project's limit so a reused ID starts clean; the files go with
// the caller's removal of the directory.
func (p Project) Remove(ctx context.Context, dir string, id uint64) error {
	if id == 0 {
		return nil
	}
	if fi, err := os.Lstat(dir); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("%s is a symbolic link, not the volume's directory: not changing its quota", dir)
	}
	return p.SetLimit(ctx, dir, id, 0)
}
