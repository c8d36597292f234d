package mount

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"k8s.io/klog/v2"
	mountutils "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/poolcsi/poolcsi/internal/mount/mkfsns"
)

// ErrAlreadyFormatted is returned by Format when the target carries any
// signature blkid recognises: formatting it could destroy data.
var ErrAlreadyFormatted = errors.New("target already has a signature")

const mib = 1 << 20

// SupportedFS reports whether Format and ResizeFS handle fsType.
func SupportedFS(fsType string) bool {
	switch fsType {
	case "ext4", "xfs", "btrfs":
		return true
	}
	return false
}

// MinSize is the smallest size Format accepts for fsType ("" = raw block);
// 0 for an unsupported type. The xfs and btrfs limits are mkfs's own.
func MinSize(fsType string) int64 {
	switch fsType {
	case "ext4":
		return 16 * mib
	case "xfs":
		return 300 * mib
	case "btrfs":
		return 128 * mib
	case "":
		return 1 * mib
	}
	return 0
}

// mkfsArgs are chosen for images that start sparse and may grow a lot:
// ext4 gets 4 KiB blocks (small filesystems would otherwise get 1 KiB blocks
// and a low growth ceiling), no root reserve (the pod owns the volume) and
// lazy table init so mkfs does not write the whole image. xfs and btrfs are
// not given -f: their own signature check is a second guard against
// reformatting.
func mkfsArgs(fsType, target string) (string, []string) {
	switch fsType {
	case "ext4":
		return "mkfs.ext4", []string{"-F", "-q", "-m", "0", "-b", "4096",
			"-E", "lazy_itable_init=1,lazy_journal_init=1", target}
	case "xfs":
		return "mkfs.xfs", []string{"-q", target}
	default:
		return "mkfs.btrfs", []string{"-q", target}
	}
}

// Format creates a filesystem on target, a regular file or a block device.
// It refuses a target with any existing signature.
func Format(ctx context.Context, target, fsType string) error {
	if !SupportedFS(fsType) {
		return fmt.Errorf("format %s: unsupported filesystem type %q", target, fsType)
	}
	existing, err := DiskFormat(ctx, target)
	if err != nil {
		return fmt.Errorf("format %s: %w", target, err)
	}
	if existing != "" {
		return fmt.Errorf("format %s as %s: found %q: %w", target, fsType, existing, ErrAlreadyFormatted)
	}
	size, err := DeviceSize(target)
	if err != nil {
		return fmt.Errorf("format %s: %w", target, err)
	}
	if min := MinSize(fsType); size < min {
		return fmt.Errorf("format %s as %s: size %d is below the minimum %d", target, fsType, size, min)
	}
	cmd, args := mkfsArgs(fsType, target)
	start := time.Now()
	// Without the host's unreachable mounts in view (a lost pool's), which
	// would fail mkfs.btrfs's mount check (mkfsns).
	out, err := mkfsns.Run(ctx, target, cmd, args...)
	if err != nil {
		return fmt.Errorf("format %s: %s %s: %w: %s", target, cmd, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	klog.FromContext(ctx).V(2).Info("Formatted", "target", target, "fsType", fsType, "duration", time.Since(start))
	return nil
}

// DiskFormat returns the filesystem type on target, "" if none. Partition
// tables and unrecognised mixtures come back non-empty too, so a caller that
// formats only on "" cannot destroy them. The in-process probe answers the
// cases it can prove (a checksummed ext4, xfs or btrfs superblock; a file
// holding no data at all); everything else is blkid's to answer (probe.go).
func DiskFormat(ctx context.Context, target string) (string, error) {
	if t, sure, err := probeFormat(target); err == nil && sure {
		return t, nil
	} else if err != nil {
		klog.FromContext(ctx).V(4).Info("In-process format probe failed; asking blkid", "target", target, "err", err)
	}
	sfm := &mountutils.SafeFormatAndMount{Exec: ctxExec{ctx: ctx, Interface: utilexec.New()}}
	t, err := sfm.GetDiskFormat(target)
	if err != nil {
		return "", fmt.Errorf("detect format of %s: %w", target, err)
	}
	return t, nil
}

// ctxExec binds a context to mount-utils helpers that call Command without
// one, so a cancelled request also kills blkid, resize2fs and friends.
type ctxExec struct {
	ctx context.Context
	utilexec.Interface
}

func (e ctxExec) Command(cmd string, args ...string) utilexec.Cmd {
	return e.CommandContext(e.ctx, cmd, args...)
}

func sleepContext(ctx context.Context) error {
	t := time.NewTimer(5 * time.Millisecond)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
