package mount

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// Mounting through mount(2) and umount2(2) instead of mount(8) and umount(8).
//
// k8s.io/mount-utils execs mount(8), which costs a process start and libmount's
// start-up (several ms on a busy node, a third of a whole stage) for what is one
// system call here. What mount(8) would add is not needed:
//
//   - option parsing: every option that reaches this package passed
//     CheckOptions' allow-list (options.go), a closed set of generic options,
//     each of which maps to one MS_* flag (mountFlags below), and of the
//     filesystem's own options, which mount(8) too passes to the kernel as the
//     data string. An option outside both lists is refused here as well.
//   - helpers (/sbin/mount.<type>): ext4, xfs and btrfs have none.
//   - /etc/mtab and libmount's utab: mtab is /proc/self/mounts on any system
//     kubelet runs on, and utab only records user-space options (x-*, user=,
//     helper=) that poolcsi never passes; the driver reads what is mounted
//     from /proc/self/mountinfo, which the kernel keeps, either way.
//   - sensitive options: mount-utils only keeps them out of its logs; these
//     mounts carry no secrets, and the driver logs the options it uses.
//
// mount-utils stays for what it does beyond a system call: filesystem resize
// and its checks, and recognising a corrupted (stale) mount point.

// flagOption is what a generic mount option does to the mount flags.
type flagOption struct {
	set, clear uintptr
}

// genericFlags maps each generic option CheckOptions allows to the flags
// mount(8) would give the kernel for it (util-linux libmount's optmap).
var genericFlags = map[string]flagOption{
	"defaults":    {},
	"ro":          {set: unix.MS_RDONLY},
	"rw":          {clear: unix.MS_RDONLY},
	"noatime":     {set: unix.MS_NOATIME},
	"atime":       {clear: unix.MS_NOATIME},
	"relatime":    {set: unix.MS_RELATIME},
	"strictatime": {set: unix.MS_STRICTATIME},
	"nodiratime":  {set: unix.MS_NODIRATIME},
	"diratime":    {clear: unix.MS_NODIRATIME},
	"lazytime":    {set: unix.MS_LAZYTIME},
	"nolazytime":  {clear: unix.MS_LAZYTIME},
	"nodev":       {set: unix.MS_NODEV},
	"nosuid":      {set: unix.MS_NOSUID},
	"noexec":      {set: unix.MS_NOEXEC},
	"exec":        {clear: unix.MS_NOEXEC},
	"sync":        {set: unix.MS_SYNCHRONOUS},
	"async":       {clear: unix.MS_SYNCHRONOUS},
	"dirsync":     {set: unix.MS_DIRSYNC},
}

// mountFlags splits options into mount flags and the filesystem's data string,
// applying them in order as mount(8) does (a later "rw" undoes an earlier "ro").
// cleared are the flags an option turned off. fsType "" (a bind mount) takes
// generic options only.
func mountFlags(fsType string, options []string) (flags, cleared uintptr, data string, err error) {
	var fsData []string
	for _, o := range options {
		if f, ok := genericFlags[o]; ok {
			flags = flags&^f.clear | f.set
			cleared = cleared&^f.set | f.clear
			continue
		}
		if fsType == "" || !optionAllowed(fsType, o) {
			return 0, 0, "", fmt.Errorf("%w: %q for %q", ErrOptionRefused, o, fsType)
		}
		fsData = append(fsData, o)
	}
	return flags, cleared, strings.Join(fsData, ","), nil
}

// sysMount mounts the filesystem on device source at target.
func sysMount(source, target, fsType string, options []string) error {
	flags, _, data, err := mountFlags(fsType, options)
	if err != nil {
		return err
	}
	if err := unix.Mount(source, target, fsType, flags, data); err != nil {
		return &os.PathError{Op: "mount", Path: target, Err: err}
	}
	return nil
}

// lockableFlags are the statfs flags a bind remount must set again: a remount
// replaces the mount's flags with those given, and in a user namespace the
// kernel refuses to clear these when they are locked. Those the mount has and
// no option turned off are carried over, as mount(8) does. (The atime flags
// need not be: a remount that names none keeps them.)
var lockableFlags = []struct {
	st int64
	ms uintptr
}{
	{unix.ST_NOSUID, unix.MS_NOSUID},
	{unix.ST_NODEV, unix.MS_NODEV},
	{unix.ST_NOEXEC, unix.MS_NOEXEC},
}

// sysBind bind-mounts source (a directory, or a device node onto a file) at
// target, not recursively (mount --bind), then applies options and ro with a
// bind remount, the second step mount(8) takes too. The bind is made on
// target; the remount and its checks act on after, the same place named so
// that the lookup of its last component lands on the new mount (a
// /proc/self/fd/N of the target directory names what is under the mount).
func sysBind(source, target, after string, readOnly bool, options []string) error {
	flags, cleared, _, err := mountFlags("", options)
	if err != nil {
		return err
	}
	if readOnly {
		flags |= unix.MS_RDONLY
	}
	if err := unix.Mount(source, target, "", unix.MS_BIND, ""); err != nil {
		return &os.PathError{Op: "bind mount", Path: target, Err: err}
	}
	if flags == 0 {
		return nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(after, &st); err != nil {
		_ = unix.Unmount(after, unix.UMOUNT_NOFOLLOW)
		return &os.PathError{Op: "statfs", Path: after, Err: err}
	}
	for _, f := range lockableFlags {
		if st.Flags&f.st != 0 && cleared&f.ms == 0 {
			flags |= f.ms
		}
	}
	if err := unix.Mount("", after, "", unix.MS_BIND|unix.MS_REMOUNT|flags, ""); err != nil {
		_ = unix.Unmount(after, unix.UMOUNT_NOFOLLOW)
		return &os.PathError{Op: "bind remount", Path: after, Err: err}
	}
	return nil
}

// sysUnmount unmounts the topmost mount at target.
func sysUnmount(target string) error {
	if err := unix.Unmount(target, 0); err != nil {
		return &os.PathError{Op: "umount", Path: target, Err: err}
	}
	return nil
}

// sysUnmountNoFollow unmounts the topmost mount at target, never through a
// symbolic link in its last component (the others are resolved by the caller).
func sysUnmountNoFollow(target string) error {
	if err := unix.Unmount(target, unix.UMOUNT_NOFOLLOW); err != nil {
		return &os.PathError{Op: "umount", Path: target, Err: err}
	}
	return nil
}

// readOnlyMount tells whether the mount at path refuses writes (the mount's
// or its filesystem's read-only flag), as the kernel reports it.
func readOnlyMount(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, &os.PathError{Op: "statfs", Path: path, Err: err}
	}
	return st.Flags&unix.ST_RDONLY != 0, nil
}
