package health

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/mount"
)

// Node is what the node-side checks read of the node: its mount table,
// statfs, loop device state and ext4's error counters. The driver's host
// provides it, the kernel's through internal/mount or internal/mount/fake's,
// so every check runs in unit tests without root. The image file and the
// mounted directories are read directly: they are files either way.
type Node interface {
	Table() ([]mount.MountEntry, error)
	Statfs(path string, st *unix.Statfs_t) error
	Status(device string) (mount.LoopStatus, error)
	Ext4Errors(device string) (count int64, firstFunc string, err error)
}

// NodeVolume is what the node side knows of a volume when it is asked about it.
type NodeVolume struct {
	ID     string
	Image  string // the image file backing the volume
	FSType string // empty for block volumes
	Block  bool
	// StagingPath and PublishPath are the paths the CO asks about; either may be
	// empty. With neither, the volume is checked wherever it is attached.
	StagingPath string
	PublishPath string
	// Device is the loop device the image is attached to on this node, "" if none.
	Device string
}

// CheckNode runs the node-side checks: mounts still there, loop device still
// attached to a file that still exists, filesystem writable and error-free, and
// usage under the threshold. It reads the mount table, sysfs and statfs through
// n, nothing else, so kubelet can call it for every volume every minute.
func CheckNode(n Node, v NodeVolume, o Options) []Issue {
	mounts, err := n.Table()
	if err != nil {
		return []Issue{{Status: Inaccessible, Reason: ReasonWrongMount, Message: fmt.Sprintf("cannot read this node's mount table to check volume %s: %v", v.ID, err)}}
	}
	var issues []Issue
	var mine []*mount.MountEntry // mounts at the asked paths that show the volume
	check := func(path, reason, what string) {
		if path == "" {
			return
		}
		m := topMount(mounts, path)
		if m == nil {
			issues = append(issues, Issue{Status: Inaccessible, Reason: reason, Message: missingMountMessage(v, path, what)})
			return
		}
		mine = append(mine, m)
	}
	check(staging(v), ReasonStagingMountMissing, "staging")
	check(v.PublishPath, ReasonPublishMountMissing, "publish")

	device := v.Device
	for _, m := range mine {
		if strings.HasPrefix(m.Source, "/dev/loop") {
			device = m.Source // what the mount really uses, even if the image was replaced since
			break
		}
	}
	if device == "" {
		if v.Block && (v.StagingPath != "" || v.PublishPath != "") {
			issues = append(issues, Issue{Status: Inaccessible, Reason: ReasonLoopDeviceDetached, Message: fmt.Sprintf(
				"no loop device is attached to %s, so block volume %s is not available on this node although it is staged here (someone ran losetup -d?). "+
					"Pods using it get I/O errors; delete them so kubelet unstages the volume, and the next pod stages it again", v.Image, v.ID)})
		}
		if _, err := os.Stat(v.Image); errors.Is(err, os.ErrNotExist) {
			issues = append(issues, Issue{Status: DataLoss, Reason: ReasonImageMissing, Message: fmt.Sprintf(
				"image file %s of volume %s is missing: the volume's data is gone. Restore the image from a backup to that path, or delete the PVC and provision a new volume",
				v.Image, v.ID)})
		}
		return issues
	}
	issues = append(issues, checkLoop(n, v, device)...)
	if v.Block {
		return issues
	}
	if len(mine) == 0 && v.StagingPath == "" && v.PublishPath == "" {
		// Asked about the volume as a whole: look at wherever its device is mounted.
		for i := range mounts {
			if mounts[i].Source == device {
				mine = append(mine, &mounts[i])
			}
		}
	}
	if len(mine) == 0 {
		return issues
	}
	issues = append(issues, checkFilesystem(n, v, device, mine[0], mounts, o.VolumeFullThreshold)...)
	return issues
}

// staging is the staging path for a filesystem volume; block volumes are only
// attached at stage time, nothing is mounted at their staging path.
func staging(v NodeVolume) string {
	if v.Block {
		return ""
	}
	return v.StagingPath
}

func missingMountMessage(v NodeVolume, path, what string) string {
	if what == "staging" {
		return fmt.Sprintf("volume %s is not mounted at its staging path %s any more (unmounted behind the driver's back); new pods cannot use it on this node. "+
			"Delete the pods using it on this node: kubelet then unstages it and stages it again for the next pod", v.ID, path)
	}
	return fmt.Sprintf("volume %s is not mounted at %s any more (unmounted behind the driver's back): the pod sees an empty directory and its writes do not reach the volume. "+
		"Delete the pod; its replacement gets the volume published again", v.ID, path)
}

// topMount is the mount a path shows (the last one stacked on it), or nil.
func topMount(mounts []mount.MountEntry, path string) *mount.MountEntry {
	p := filepath.Clean(path)
	if r, err := filepath.EvalSymlinks(p); err == nil {
		p = r
	}
	var top *mount.MountEntry
	for i := range mounts {
		if mounts[i].Mountpoint == p {
			top = &mounts[i]
		}
	}
	return top
}

func checkLoop(n Node, v NodeVolume, device string) []Issue {
	st, err := n.Status(device)
	if err != nil {
		return []Issue{{Status: Inaccessible, Reason: ReasonLoopDeviceDetached, Message: fmt.Sprintf(
			"loop device %s of volume %s is no longer attached to its image (%v): pods get I/O errors. "+
				"Delete the pods using the volume on this node so kubelet unstages it, and the next pod stages it again", device, v.ID, err)}}
	}
	if st.BackingDeleted {
		return []Issue{{Status: DataLoss, Reason: ReasonBackingFileDeleted, Message: fmt.Sprintf(
			"image file %s of volume %s was deleted while attached as %s: the data now lives only in the open device and is lost when the volume is unstaged. "+
				"Copy it out now (dd if=%s of=%s.recovered bs=1M), then stop the pods, and after the volume is unstaged move the copy to %s and stage it again",
			st.BackingFile, v.ID, device, device, v.Image, v.Image)}}
	}
	return nil
}

func checkFilesystem(n Node, v NodeVolume, device string, m *mount.MountEntry, mounts []mount.MountEntry, threshold float64) []Issue {
	var issues []Issue
	var st unix.Statfs_t
	if err := n.Statfs(m.Mountpoint, &st); err != nil {
		return append(issues, Issue{Status: Inaccessible, Reason: ReasonFilesystemIOError, Message: fmt.Sprintf(
			"the filesystem of volume %s (%s on %s) fails: %v (an xfs shutdown or a dead device). "+
				"Check dmesg for %s, stop the pods, unstage the volume and run the filesystem's repair tool on %s before staging it again",
			v.ID, v.FSType, device, err, device, v.Image)})
	}
	if _, err := os.ReadDir(m.Mountpoint); errors.Is(err, unix.EIO) {
		issues = append(issues, Issue{Status: Inaccessible, Reason: ReasonFilesystemIOError, Message: fmt.Sprintf(
			"the filesystem of volume %s (%s on %s) returns I/O errors (%v), as after an xfs shutdown or a failed device. "+
				"Check dmesg for %s, stop the pods, unstage the volume and run the filesystem's repair tool on %s before staging it again",
			v.ID, v.FSType, device, err, device, v.Image)})
	}
	if superReadOnly(m) && anyWritable(mounts, m) {
		issues = append(issues, Issue{Status: Degraded, Reason: ReasonFilesystemReadOnly, Message: fmt.Sprintf(
			"the %s filesystem of volume %s (%s) is read-only although the volume is published read-write: writes from pods fail (the kernel does this after errors with errors=remount-ro, or someone remounted it). "+
				"Check dmesg for %s; if it was an error, stop the pods, unstage, run %s and stage again; if it was a manual remount, remount it read-write",
			v.FSType, v.ID, device, device, repairCommand(v.FSType, v.Image))})
	}
	if count, first := fsErrors(n, v.FSType, device); count > 0 {
		issues = append(issues, Issue{Status: Degraded, Reason: ReasonFilesystemErrors, Message: fmt.Sprintf(
			"the %s filesystem of volume %s (%s) has recorded %d errors%s: data may be damaged. "+
				"Stop the pods, unstage the volume and run %s; the count clears when the repair succeeds",
			v.FSType, v.ID, device, count, first, repairCommand(v.FSType, v.Image))})
	}
	issues = append(issues, usage(v, st, threshold)...)
	return issues
}

// repairCommand is the command that checks and repairs a volume's filesystem in its
// image, unstaged: fsck means e2fsck for ext4 only (fsck.xfs does nothing, by design, and
// btrfs has its own checker, whose --repair its manual says to use only when advised).
func repairCommand(fsType, image string) string {
	switch fsType {
	case "xfs":
		return "xfs_repair " + image
	case "btrfs":
		return "btrfs check " + image + " (and btrfs check --repair only when advised)"
	case "ext4", "ext3", "ext2":
		return "e2fsck -f " + image
	}
	return "the filesystem's repair tool on " + image
}

// superReadOnly tells whether the filesystem itself (not just this mount) is
// read-only: the superblock options carry "ro".
func superReadOnly(m *mount.MountEntry) bool {
	return slices.Contains(strings.Split(m.VFSOptions, ","), "ro")
}

// anyWritable tells whether some mount of the same filesystem was made
// read-write: the volume was meant to be writable. A volume staged and
// published read-only has read-only mounts only, and is not flagged.
func anyWritable(mounts []mount.MountEntry, of *mount.MountEntry) bool {
	for _, m := range mounts {
		if m.Major == of.Major && m.Minor == of.Minor && slices.Contains(strings.Split(m.Options, ","), "rw") {
			return true
		}
	}
	return false
}

// fsErrors reads the error count the filesystem keeps. ext4 exposes it in
// sysfs (it persists in the superblock until fsck clears it); xfs shuts down
// instead of counting (caught as I/O errors above), and btrfs keeps per-device
// counters that need an ioctl on the mount, not read here. A count that cannot
// be read is no finding.
func fsErrors(n Node, fsType, device string) (int64, string) {
	if fsType != "ext4" {
		return 0, ""
	}
	count, fn, err := n.Ext4Errors(device)
	if err != nil || count == 0 {
		return 0, ""
	}
	first := ""
	if fn != "" {
		first = " (first in " + fn + ")"
	}
	return count, first
}

func usage(v NodeVolume, st unix.Statfs_t, threshold float64) []Issue {
	var issues []Issue
	if st.Blocks > 0 {
		// Used as df counts it: blocks not free, over what a writer can reach.
		used := st.Blocks - st.Bfree
		reach := used + st.Bavail
		if reach > 0 {
			frac := float64(used) / float64(reach)
			if frac >= threshold {
				issues = append(issues, Issue{Status: Degraded, Reason: ReasonVolumeNearlyFull, Message: fmt.Sprintf(
					"volume %s is %s full (%s of %s used, threshold %s): writes will fail with 'no space left on device' soon. "+
						"Expand the PVC (raise spec.resources.requests.storage) or delete data from it",
					v.ID, percent(frac), bytesIEC(int64(used)*st.Bsize), bytesIEC(int64(reach)*st.Bsize), percent(threshold))})
			}
		}
	}
	if st.Files > 0 && v.FSType != "btrfs" && v.FSType != "xfs" { // those allocate inodes dynamically
		frac := float64(st.Files-st.Ffree) / float64(st.Files)
		if frac >= threshold {
			issues = append(issues, Issue{Status: Degraded, Reason: ReasonInodesNearlyFull, Message: fmt.Sprintf(
				"volume %s has used %s of its inodes (%d of %d, threshold %s): creating files will fail soon although bytes are free. "+
					"Delete small files or expand the PVC (a larger ext4 gets more inodes)",
				v.ID, percent(frac), st.Files-st.Ffree, st.Files, percent(threshold))})
		}
	}
	return issues
}
