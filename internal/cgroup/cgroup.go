// Package cgroup holds a pod's block I/O to limits through the kernel's block
// throttling: cgroup v1's blkio.throttle.* files or cgroup v2's io.max, on the
// pod-level cgroup kubelet made (throttling is hierarchical, so every
// container of the pod is held to it), for both kubelet cgroup drivers.
package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Limits are per-device limits; 0 is none.
type Limits struct {
	ReadBPS, WriteBPS, ReadIOPS, WriteIOPS int64
}

// IsZero tells whether no limit is set.
func (l Limits) IsZero() bool { return l == Limits{} }

var (
	// ErrNoPodCgroup: no cgroup of the pod exists under the root (not
	// created yet, already gone, or another cgroup layout).
	ErrNoPodCgroup = errors.New("no cgroup of the pod")
	// ErrBadPodUID: a pod UID that is not a UUID; no path is built from it.
	ErrBadPodUID = errors.New("pod UID is not a UUID")
)

// uidRE is a Kubernetes pod UID: a lowercase UUID.
var uidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// ValidatePodUID accepts a lowercase UUID only.
func ValidatePodUID(uid string) error {
	if !uidRE.MatchString(uid) {
		return fmt.Errorf("%w: %q", ErrBadPodUID, uid)
	}
	return nil
}

// PodDirs are where kubelet puts a pod's cgroup, relative to a hierarchy's
// root, for the cgroupfs driver (guaranteed, burstable, best-effort) and then
// the systemd driver.
func PodDirs(uid string) []string {
	u := strings.ReplaceAll(uid, "-", "_")
	return []string{
		"kubepods/pod" + uid,
		"kubepods/burstable/pod" + uid,
		"kubepods/besteffort/pod" + uid,
		"kubepods.slice/kubepods-pod" + u + ".slice",
		"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + u + ".slice",
		"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + u + ".slice",
	}
}

// FS is the real cgroup filesystem under Root (/sys/fs/cgroup): v2 when Root
// is the unified hierarchy (it has cgroup.controllers), else v1's blkio.
type FS struct{ Root string }

// v2 tells whether the root is a cgroup v2 unified hierarchy.
func (c FS) v2() bool {
	_, err := os.Stat(filepath.Join(c.Root, "cgroup.controllers"))
	return err == nil
}

// PodCgroup returns the pod's cgroup directory, or ErrNoPodCgroup.
func (c FS) PodCgroup(uid string) (string, error) {
	if err := ValidatePodUID(uid); err != nil {
		return "", err
	}
	base := c.Root
	if !c.v2() {
		base = filepath.Join(c.Root, "blkio")
	}
	for _, r := range kubeletRoots(base) {
		for _, rel := range PodDirs(uid) {
			dir := filepath.Join(r, rel)
			if fi, err := os.Lstat(dir); err == nil && fi.IsDir() {
				return dir, nil
			}
		}
	}
	return "", fmt.Errorf("%w %s under %s", ErrNoPodCgroup, uid, base)
}

// kubeletRoots are where kubelet's pod cgroups may hang: the hierarchy's
// root (kubelet's default cgroupRoot, /) and each cgroup one level down that
// holds kubepods — a kubelet run with cgroupRoot /<name>, as two kubelets on
// one host are. Only names read from the kernel's cgroup filesystem are
// joined, never one from a request.
func kubeletRoots(base string) []string {
	out := []string{base}
	ents, err := os.ReadDir(base)
	if err != nil {
		return out
	}
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), "kubepods") {
			continue
		}
		for _, k := range []string{"kubepods", "kubepods.slice"} {
			if fi, err := os.Lstat(filepath.Join(base, e.Name(), k)); err == nil && fi.IsDir() {
				out = append(out, filepath.Join(base, e.Name()))
				break
			}
		}
	}
	return out
}

// Apply holds pod uid's I/O on the block device at device to l (0 clears a
// limit) and returns the cgroup it wrote.
func (c FS) Apply(uid, device string, l Limits) (string, error) {
	dir, err := c.PodCgroup(uid)
	if err != nil {
		return "", err
	}
	major, minor, err := deviceNumber(device)
	if err != nil {
		return dir, err
	}
	return dir, writePod(dir, c.v2(), major, minor, l)
}

// writePod writes l into a pod's cgroup dir. cgroup v1's block throttling is
// not hierarchical: a limit on the pod's cgroup does not hold the containers
// in the cgroups below it, where the pod's processes are, so each is written
// too; one started later (a restart) is found by the next reconcile, through
// Held.
func writePod(dir string, v2 bool, major, minor uint32, l Limits) error {
	if err := WriteLimits(dir, v2, major, minor, l); err != nil || v2 {
		return err
	}
	for _, child := range childCgroups(dir) {
		if err := WriteLimits(child, false, major, minor, l); err != nil {
			return err
		}
	}
	return nil
}

// childCgroups are the cgroups directly below dir (v1: a pod's containers),
// read from the kernel's cgroup filesystem, never through a link.
func childCgroups(dir string) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() && e.Type()&os.ModeSymlink == 0 {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out
}

// deviceNumber is the major and minor number of a block device node.
func deviceNumber(device string) (uint32, uint32, error) {
	var st unix.Stat_t
	if err := unix.Stat(device, &st); err != nil {
		return 0, 0, fmt.Errorf("stat %s: %w", device, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, 0, fmt.Errorf("%s is not a block device", device)
	}
	return unix.Major(st.Rdev), unix.Minor(st.Rdev), nil
}

// WriteLimits writes l for device major:minor into the cgroup dir: io.max
// (v2), or the four blkio.throttle files (v1).
func WriteLimits(dir string, v2 bool, major, minor uint32, l Limits) error {
	dev := fmt.Sprintf("%d:%d", major, minor)
	if v2 {
		v := func(n int64) string {
			if n == 0 {
				return "max"
			}
			return strconv.FormatInt(n, 10)
		}
		line := fmt.Sprintf("%s rbps=%s wbps=%s riops=%s wiops=%s", dev, v(l.ReadBPS), v(l.WriteBPS), v(l.ReadIOPS), v(l.WriteIOPS))
		return writeFile(filepath.Join(dir, "io.max"), line)
	}
	for _, f := range []struct {
		name string
		n    int64
	}{
		{"blkio.throttle.read_bps_device", l.ReadBPS},
		{"blkio.throttle.write_bps_device", l.WriteBPS},
		{"blkio.throttle.read_iops_device", l.ReadIOPS},
		{"blkio.throttle.write_iops_device", l.WriteIOPS},
	} {
		if err := writeFile(filepath.Join(dir, f.name), dev+" "+strconv.FormatInt(f.n, 10)); err != nil {
			return err
		}
	}
	return nil
}

// writeFile writes one line to a cgroup control file, which must exist (a
// cgroup file is never created) and is never reached through a link.
func writeFile(path, line string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer f.Close()
	if _, err := f.WriteString(line + "\n"); err != nil {
		return fmt.Errorf("write %q to %s: %w", line, path, err)
	}
	return f.Close()
}

// ReadV1 reads the limit for dev ("MAJ:MIN") in a v1 blkio throttle file (0
// when it has none), for tests and status.
func ReadV1(dir, file, dev string) (int64, error) {
	raw, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == dev {
			return strconv.ParseInt(f[1], 10, 64)
		}
	}
	return 0, nil
}

// Held returns what pod uid's cgroup holds its I/O on the block device at
// device to (zero Limits when nothing is written for it), and the cgroup it
// read. A node plugin that restarted reads it so as not to write again what
// the kernel already holds.
func (c FS) Held(uid, device string) (Limits, string, error) {
	dir, err := c.PodCgroup(uid)
	if err != nil {
		return Limits{}, "", err
	}
	major, minor, err := deviceNumber(device)
	if err != nil {
		return Limits{}, dir, err
	}
	l, at, err := heldByPod(dir, c.v2(), major, minor)
	return l, at, err
}

// heldByPod reads what a pod's cgroup dir holds. Under v1 the pod holds the
// limits only if every container's cgroup does (writePod); the first that
// differs is what the pod holds, and where.
func heldByPod(dir string, v2 bool, major, minor uint32) (Limits, string, error) {
	l, err := ReadLimits(dir, v2, major, minor)
	if err != nil || v2 {
		return l, dir, err
	}
	for _, child := range childCgroups(dir) {
		cl, err := ReadLimits(child, false, major, minor)
		if err != nil {
			return Limits{}, child, err
		}
		if cl != l {
			return cl, child, nil
		}
	}
	return l, dir, nil
}

// ReadLimits reads the limits for device major:minor in the cgroup dir: its
// io.max line (v2), or its line in each of the four blkio.throttle files (v1).
func ReadLimits(dir string, v2 bool, major, minor uint32) (Limits, error) {
	dev := fmt.Sprintf("%d:%d", major, minor)
	if !v2 {
		var l Limits
		for _, f := range []struct {
			name string
			n    *int64
		}{
			{"blkio.throttle.read_bps_device", &l.ReadBPS},
			{"blkio.throttle.write_bps_device", &l.WriteBPS},
			{"blkio.throttle.read_iops_device", &l.ReadIOPS},
			{"blkio.throttle.write_iops_device", &l.WriteIOPS},
		} {
			n, err := ReadV1(dir, f.name, dev)
			if err != nil {
				return Limits{}, fmt.Errorf("read %s of %s: %w", f.name, dir, err)
			}
			*f.n = n
		}
		return l, nil
	}
	raw, err := os.ReadFile(filepath.Join(dir, "io.max"))
	if err != nil {
		return Limits{}, fmt.Errorf("read io.max of %s: %w", dir, err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != dev {
			continue
		}
		var l Limits
		for _, kv := range f[1:] {
			k, v, _ := strings.Cut(kv, "=")
			n := int64(0)
			if v != "max" {
				if n, err = strconv.ParseInt(v, 10, 64); err != nil {
					return Limits{}, fmt.Errorf("io.max of %s: %q: %w", dir, kv, err)
				}
			}
			switch k {
			case "rbps":
				l.ReadBPS = n
			case "wbps":
				l.WriteBPS = n
			case "riops":
				l.ReadIOPS = n
			case "wiops":
				l.WriteIOPS = n
			}
		}
		return l, nil
	}
	return Limits{}, nil
}
