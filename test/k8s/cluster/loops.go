package cluster

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// OurLoops maps each loop device a node with kubelet's root at kubeletDir and the given
// pools may have attached to its losetup -a line: those backed by a volume image of one of
// the pools, and kubelet's own for block volumes (backed by a device file under its
// directory). Other tests on this machine have loop devices of their own, which are not
// ours to judge or detach. poolcsi attaches images through /proc/<pid>/fd paths inside its
// container, and once the container is gone the name is relative to the pool's
// filesystem, so the backing file's name does not show the pool: its device and inode
// numbers do (on btrfs each volume is a subvolume, with a device number of its own).
func OurLoops(kubeletDir string, pools ...string) map[string]string {
	images := map[string]bool{}
	for _, p := range pools {
		hits, _ := filepath.Glob(filepath.Join(p, "volumes", "*", "*.img"))
		for _, h := range hits {
			var st syscall.Stat_t
			if err := syscall.Stat(h, &st); err == nil {
				images[losetupFile(st.Dev, st.Ino)] = true
			}
		}
	}
	out, _ := exec.Command("losetup", "-a").Output()
	type loop struct{ dev, file, backing, line string }
	var loops []loop
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if dev, rest, ok := strings.Cut(line, ":"); ok {
			rest = strings.TrimSpace(rest)
			file, _, _ := strings.Cut(rest, " ")
			loops = append(loops, loop{dev, file, rest, line})
		}
	}
	m := map[string]string{}
	for _, l := range loops {
		mine := images[l.file]
		if kubeletDir != "" {
			mine = mine || strings.Contains(l.backing, "("+kubeletDir+"/")
		}
		if mine {
			m[l.dev] = l.line
		}
	}
	// Kubelet holds every block volume it maps with a loop device of its own over the
	// volume's device node. Once kubelet's bind mount of that node is gone, losetup shows
	// its backing file as "/" on /dev's filesystem: it is known by the device and inode of
	// one of ours.
	held := map[string]bool{}
	for dev := range m {
		var st syscall.Stat_t
		if err := syscall.Stat(dev, &st); err == nil {
			held[losetupFile(st.Dev, st.Ino)] = true
		}
	}
	for _, l := range loops {
		if held[l.file] {
			m[l.dev] = l.line
		}
	}
	return m
}

// losetupFile is how losetup -a names a backing file's filesystem device (the old way:
// major<<8 | minor) and, if ino is not 0, the file: "[0006]:99".
func losetupFile(dev, ino uint64) string {
	s := fmt.Sprintf("[%04d]:", unix.Major(dev)<<8|unix.Minor(dev))
	if ino != 0 {
		s += strconv.FormatUint(ino, 10)
	}
	return s
}
