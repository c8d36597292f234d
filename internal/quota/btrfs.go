package quota

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// Btrfs makes each volume a subvolume whose qgroup (0/<subvolume id>) carries a
// referenced-bytes limit. Quota must be enabled on the filesystem by the admin
// (btrfs quota enable): it is a filesystem-wide choice with a write cost that a
// storage driver should not make behind the admin's back.
type Btrfs struct {
	sysfs string // /sys/fs/btrfs/<fsid>/qgroups
}

func (Btrfs) Kind() string   { return KindBtrfs }
func (Btrfs) Enforced() bool { return true }
func (Btrfs) Reason() string { return "" }

// ioctl numbers from linux/btrfs.h.
const (
	btrfsIocFSInfo    = 0x8400941f // _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)
	btrfsIocInoLookup = 0xd0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
	btrfsFirstFreeObj = 256
)

type btrfsFSInfo struct {
	MaxID      uint64
	NumDevices uint64
	FSID       [16]byte
	_          [1024 - 32]byte
}

type btrfsInoLookup struct {
	TreeID   uint64
	ObjectID uint64
	Name     [4080]byte
}

func ioctlPtr(path string, req uintptr, arg unsafe.Pointer) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); e != 0 {
		return e
	}
	return nil
}

func btrfsFSID(path string) (string, error) {
	var info btrfsFSInfo
	if err := ioctlPtr(path, btrfsIocFSInfo, unsafe.Pointer(&info)); err != nil {
		return "", fmt.Errorf("BTRFS_IOC_FS_INFO %s: %w", path, err)
	}
	h := hex.EncodeToString(info.FSID[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:], nil
}

// subvolumeID is the ID of the subvolume holding path (its qgroup is 0/ID).
func subvolumeID(path string) (uint64, error) {
	args := btrfsInoLookup{ObjectID: btrfsFirstFreeObj}
	if err := ioctlPtr(path, btrfsIocInoLookup, unsafe.Pointer(&args)); err != nil {
		return 0, fmt.Errorf("BTRFS_IOC_INO_LOOKUP %s: %w", path, err)
	}
	return args.TreeID, nil
}

func detectBtrfs(path string) Backend {
	fsid, err := btrfsFSID(path)
	if err != nil {
		return None{Why: fmt.Sprintf("btrfs: %v", err)}
	}
	if _, err := exec.LookPath("btrfs"); err != nil {
		return None{Why: "btrfs: the btrfs command (btrfs-progs) is not installed"}
	}
	sysfs := filepath.Join("/sys/fs/btrfs", fsid, "qgroups")
	// The qgroups directory exists exactly while quota is enabled.
	if _, err := os.Stat(sysfs); err != nil {
		return None{Why: fmt.Sprintf("btrfs quota is not enabled on the pool's filesystem (run: btrfs quota enable <mount point>) [%v]", err)}
	}
	return Btrfs{sysfs: sysfs}
}

// The command lines, kept apart so tests can check them without a filesystem.
func btrfsCreateArgs(dir string) []string { return []string{"subvolume", "create", dir} }
func btrfsLimitArgs(dir string, limit int64) []string {
	return []string{"qgroup", "limit", strconv.FormatInt(limit, 10), dir}
}
func btrfsDeleteArgs(dir string) []string { return []string{"subvolume", "delete", dir} }
func btrfsDestroyArgs(id uint64, mnt string) []string {
	return []string{"qgroup", "destroy", "0/" + strconv.FormatUint(id, 10), mnt}
}

func runBtrfs(ctx context.Context, args []string) error {
	out, err := exec.CommandContext(ctx, "btrfs", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("btrfs %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func (b Btrfs) Create(ctx context.Context, dir string, limit int64, _ func(uint64) (bool, error)) (uint64, error) {
	if err := runBtrfs(ctx, btrfsCreateArgs(dir)); err != nil {
		return 0, err
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		return 0, fmt.Errorf("chmod %s: %w", dir, err)
	}
	id, err := subvolumeID(dir)
	if err != nil {
		return 0, err
	}
	return id, b.SetLimit(ctx, dir, id, limit)
}

func (b Btrfs) SetLimit(ctx context.Context, dir string, _ uint64, limit int64) error {
	return runBtrfs(ctx, btrfsLimitArgs(dir, limit))
}

// Usage reads the qgroup's counters from sysfs: no process, a few small reads,
// cheap enough for NodeGetVolumeStats.
func (b Btrfs) Usage(_ context.Context, _ string, id uint64) (Usage, error) {
	qg := filepath.Join(b.sysfs, "0_"+strconv.FormatUint(id, 10))
	used, err := readInt(filepath.Join(qg, "referenced"))
	if err != nil {
		return Usage{}, err
	}
	limit, err := readInt(filepath.Join(qg, "max_referenced"))
	if err != nil {
		return Usage{}, err
	}
	return Usage{UsedBytes: used, LimitBytes: limit}, nil
}

func readInt(path string) (int64, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", path, err)
	}
	return v, nil
}

// Remove deletes the subvolume, which drops its data in one step, then its
// qgroup. If the subvolume cannot be deleted (it holds nested subvolumes a pod
// made), the caller's recursive removal still takes the content: root may rmdir
// empty subvolumes.
func (b Btrfs) Remove(ctx context.Context, dir string, id uint64) error {
	fi, err := os.Lstat(dir)
	if os.IsNotExist(err) {
		return nil
	}
	if err == nil && fi.Mode()&os.ModeSymlink != 0 {
		// btrfs subvolume delete would resolve the link and delete whatever
		// subvolume it names: a link put in a pool is never followed.
		return fmt.Errorf("%s is a symbolic link, not the volume's subvolume: not deleting through it", dir)
	}
	if err := runBtrfs(ctx, btrfsDeleteArgs(dir)); err != nil {
		klog.FromContext(ctx).Info("Deleting the subvolume failed; removing its files instead", "dir", dir, "err", err)
		return nil
	}
	if id != 0 {
		// The qgroup may still be referenced until the cleaner thread runs; a stale
		// qgroup costs nothing but a line in btrfs qgroup show.
		if err := runBtrfs(ctx, btrfsDestroyArgs(id, filepath.Dir(dir))); err != nil {
			klog.FromContext(ctx).V(2).Info("Qgroup not destroyed", "qgroup", id, "err", err)
		}
	}
	return nil
}
