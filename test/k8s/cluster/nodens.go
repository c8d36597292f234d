package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// What makes one machine several nodes: each node's processes in a mount namespace of its
// own, under a cgroup root of its own, with a bridge and a pod range of its own; and the
// two ways a node fails that the tests need apart: powered off, and partitioned.

func (n *Node) bridge() string { return fmt.Sprintf("%s%d", cniBridgePrefix, n.Config.Index) }

func (n *Node) podCIDR() string { return fmt.Sprintf("10.244.%d.0/24", n.Config.Index) }

// cgroupRootLine is the KubeletConfiguration line of the node's cgroup root, if it has one
// (kubelet's default is /).
func (n *Node) cgroupRootLine() string {
	if n.Config.CgroupRoot == "" {
		return ""
	}
	return fmt.Sprintf("cgroupRoot: %q\n", n.Config.CgroupRoot)
}

// start runs one of the node's processes, in the node's mount namespace if it has one; its
// log is named after the node when the cluster has several.
func (n *Node) start(t testing.TB, name, bin string, args ...string) *Proc {
	t.Helper()
	name, bin, args = n.procArgs(name, bin, args)
	return n.c.Start(t, name, bin, nil, args...)
}

// restart starts a process in place of one start started: the node's cleanup stops
// whichever is current (see startKubelet and startContainerd).
func (n *Node) restart(t testing.TB, name, bin string, args ...string) *Proc {
	t.Helper()
	name, bin, args = n.procArgs(name, bin, args)
	return n.c.launch(t, name, bin, nil, args...)
}

func (n *Node) procArgs(name, bin string, args []string) (string, string, []string) {
	if n.Config.Name != "" {
		name += "@" + n.Name
	}
	if n.ns != nil {
		args = append([]string{"--mount=" + n.nsPath(), "--", bin}, args...)
		bin = "nsenter"
	}
	return name, bin, args
}

func (n *Node) nsPath() string { return fmt.Sprintf("/proc/%d/ns/mnt", n.ns.cmd.Process.Pid) }

// Command is name with args, run in the node's mount namespace.
func (n *Node) Command(name string, args ...string) *exec.Cmd {
	if n == nil || n.ns == nil {
		return exec.Command(name, args...)
	}
	return exec.Command("nsenter", append([]string{"--mount=" + n.nsPath(), "--", name}, args...)...)
}

// Run runs a command in the node's mount namespace (as a shell on that node would) and
// fails the test if it fails.
func (n *Node) Run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := n.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("on node %s: %s %q: %v\n%s", n.Name, name, args, err, out)
	}
	return string(out)
}

// MountsUnder lists the node's mount points under any of dirs, deepest first, as the
// node sees them.
func (n *Node) MountsUnder(dirs ...string) []string {
	if n.ns == nil {
		return MountsUnder(dirs...)
	}
	return mountsUnderIn(fmt.Sprintf("/proc/%d/mountinfo", n.ns.cmd.Process.Pid), dirs...)
}

// HostPath is where a path of the node's own (kubelet's root, pod logs) is on this
// machine's file system.
func (n *Node) HostPath(p string) string {
	if !n.Config.OwnMounts {
		return p
	}
	for _, own := range ownDirs {
		if p == own || strings.HasPrefix(p, own+"/") {
			return filepath.Join(n.Dir, "own", own, strings.TrimPrefix(p, own))
		}
	}
	return p
}

// ownDirs are the directories a node with OwnMounts has to itself: kubelet's root and the
// two kubelet writes pod logs to whatever --root-dir says (its log garbage collection
// removes the directories of pods it does not know, which would be the other node's).
var ownDirs = []string{KubeletDir, "/var/log/pods", "/var/log/containers"}

// enterOwnMounts makes the node's mount namespace: a slave of this machine's (a pool
// mounted here before stays visible there; nothing mounted there comes back), where each
// of ownDirs is a shared bind mount of a directory of the node's.
func (n *Node) enterOwnMounts(t testing.TB) {
	t.Helper()
	for _, d := range ownDirs {
		// The mount points, on this machine; they stay empty here.
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(n.HostPath(d), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	self, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		t.Fatal(err)
	}
	n.ns = n.c.Start(t, "mountns@"+n.Name, "unshare", nil, "--mount", "--propagation", "slave", "sleep", "infinity")
	WaitFor(t, 10*time.Second, "node "+n.Name+"'s mount namespace", func() error {
		n.ns.MustRun(t)
		ns, err := os.Readlink(n.nsPath())
		if err != nil {
			return err
		}
		if ns == self {
			return fmt.Errorf("not entered yet")
		}
		return nil
	})
	// Runs before the namespace's holder stops: what the node's graceful steps left.
	t.Cleanup(func() { n.sweepOwnMounts(t) })
	for _, d := range ownDirs {
		n.Run(t, "mount", "--bind", n.HostPath(d), d)
		// Bidirectional propagation of the node plugin's mounts (see startKubelet).
		n.Run(t, "mount", "--make-rshared", d)
	}
	if n.Config.Prepare != nil {
		n.Config.Prepare(t, n)
	}
}

// sweepOwnMounts kills what is left of the node's containers and takes down every mount in
// the node's namespace under its own directories, so that nothing there outlives the node.
func (n *Node) sweepOwnMounts(t testing.TB) {
	n.killShims()
	n.killCgroup(t)
	for _, m := range n.MountsUnder(append([]string{n.Dir, "/run/netns", "/var/run/netns"}, ownDirs...)...) {
		if slices.Contains(ownDirs, m) {
			continue // the node's own bind mounts go with the namespace
		}
		if out, err := n.Command("umount", "-l", m).CombinedOutput(); err != nil {
			t.Logf("node %s: umount -l %s: %v %s", n.Name, m, err, out)
		} else {
			t.Logf("node %s: swept a leftover mount: %s", n.Name, m)
		}
	}
}

// killShims kills the node's containerd-shims: whose containerd is gone keep their
// containers' mounts busy.
func (n *Node) killShims() {
	if n.Containerd == "" {
		return
	}
	shims, _ := exec.Command("pgrep", "-f", "containerd-shim.*"+n.Containerd).Output()
	for _, f := range strings.Fields(string(shims)) {
		if pid, err := strconv.Atoi(f); err == nil {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if len(shims) > 0 {
		time.Sleep(300 * time.Millisecond)
	}
}

// cgroupDirs are the node's cgroup root in every cgroup v1 hierarchy of this machine (and
// the v2 one of a hybrid setup).
func (n *Node) cgroupDirs() []string {
	if n.Config.CgroupRoot == "" {
		return nil
	}
	hier, _ := filepath.Glob("/sys/fs/cgroup/*")
	var dirs []string
	for _, h := range hier {
		if fi, err := os.Lstat(h); err != nil || !fi.IsDir() {
			continue // cpu,cpuacct links
		}
		dirs = append(dirs, filepath.Join(h, n.Config.CgroupRoot))
	}
	return dirs
}

// makeCgroupRoot makes the node's cgroup root, which kubelet requires to exist, and
// removes it, and what kubelet left under it, when the test ends.
func (n *Node) makeCgroupRoot(t testing.TB) {
	t.Helper()
	if !strings.HasPrefix(n.Config.CgroupRoot, nodeCgroupPrefix) {
		t.Fatalf("node %s: cgroup root %q does not start with %s", n.Name, n.Config.CgroupRoot, nodeCgroupPrefix)
	}
	for _, d := range n.cgroupDirs() {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		// A new cpuset has no CPUs and no memory nodes: its tasks could not run.
		if strings.Contains(d, "/cpuset/") {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, _ := os.ReadFile(filepath.Join(filepath.Dir(d), f))
				_ = os.WriteFile(filepath.Join(d, f), b, 0o644)
			}
		}
	}
	t.Cleanup(func() {
		n.killCgroup(t)
		for _, d := range n.cgroupDirs() {
			removeCgroup(t, d)
		}
	})
}

// removeCgroup removes a cgroup and every one below it, deepest first.
func removeCgroup(t testing.TB, dir string) {
	var all []string
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			all = append(all, p)
		}
		return nil
	})
	for i := len(all) - 1; i >= 0; i-- {
		var err error
		for try := 0; try < 20; try++ {
			if err = syscall.Rmdir(all[i]); err == nil || os.IsNotExist(err) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil && !os.IsNotExist(err) {
			t.Errorf("rmdir %s: %v", all[i], err)
		}
	}
}

// cgroupPids lists every process in the node's cgroup root: its pods' containers.
func (n *Node) cgroupPids() []int {
	var pids []int
	for _, d := range n.cgroupDirs() {
		if !strings.Contains(d, "/pids/") {
			continue
		}
		_ = filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
			if err != nil || e.IsDir() || e.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					pids = append(pids, pid)
				}
			}
			return nil
		})
	}
	return pids
}

func (n *Node) killCgroup(t testing.TB) {
	pids := n.cgroupPids()
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	if len(pids) > 0 {
		t.Logf("node %s: killed %d processes of its pods", n.Name, len(pids))
		time.Sleep(300 * time.Millisecond)
	}
}

// PowerOff stops the node as a power cut would: kubelet, containerd, the shims and every
// process of its pods (its driver among them) are killed at once; its mounts and loop
// devices stay as they were. PowerOn starts it again.
func (n *Node) PowerOff(t testing.TB) {
	t.Helper()
	_ = syscall.Kill(-n.kubelet.cmd.Process.Pid, syscall.SIGKILL)
	_ = syscall.Kill(-n.containerd.cmd.Process.Pid, syscall.SIGKILL)
	n.killShims()
	n.killCgroup(t)
	<-n.kubelet.done
	<-n.containerd.done
}

// PowerOn starts containerd and kubelet of a powered-off node again, on the state they
// left, and waits until the node is Ready.
func (n *Node) PowerOn(t testing.TB) {
	t.Helper()
	n.restarts++
	n.containerd = n.restart(t, fmt.Sprintf("containerd-%d", n.restarts+1), "containerd", "--config", filepath.Join(n.Dir, "containerd.toml"))
	n.waitContainerd(t)
	n.kubelet = n.restart(t, fmt.Sprintf("kubelet-%d", n.restarts+1), n.kubeletBin, n.kubeletArgs...)
	WaitFor(t, 120*time.Second, "node "+n.Name+" Ready after power-on", func() error {
		n.kubelet.MustRun(t)
		return n.ready()
	})
}

// Partition cuts the node off the API server and off path (a shared pool) while every
// process of it keeps running: kubelet is stopped (SIGSTOP: it neither reports nor acts,
// the node turns NotReady), its pods' packets to this machine and the other nodes are
// dropped, and an empty tmpfs covers path in the node's mount namespace
// (and so in its pods, which see it with HostToContainer or Bidirectional propagation):
// the pool's files are gone for the node, while the loop devices it holds still reach the
// pool's filesystem, as a client whose connection dropped keeps its open files. Heal
// undoes both.
//
// With path "", the node's mounts are left as they are (the pool lost some other way,
// Vanish).
func (n *Node) Partition(t testing.TB, path string) (heal func()) {
	t.Helper()
	if n.ns == nil {
		t.Fatalf("node %s: a partition needs the node's own mount namespace", n.Name)
	}
	var dev uint64
	if path != "" {
		n.Run(t, "mount", "-t", "tmpfs", "-o", "size=1m", "poolcsi-partition", path)
		d, err := strconv.ParseUint(strings.TrimSpace(n.Run(t, "stat", "-c", "%d", path)), 10, 64)
		if err != nil {
			t.Fatalf("node %s: the device of the tmpfs over %s: %v", n.Name, path, err)
		}
		dev = d
	}
	// The node's pods lose the API server and this machine (the nodes share its network
	// namespace: the API server, the other node's pods).
	drop := []string{"-s", n.podCIDR(), "-m", "comment", "--comment", "poolcsi-partition", "-j", "DROP"}
	for _, chain := range []string{"INPUT", "FORWARD"} {
		if out, err := exec.Command("iptables", append([]string{"-I", chain}, drop...)...).CombinedOutput(); err != nil {
			t.Fatalf("iptables -I %s: %v %s", chain, err, out)
		}
	}
	if err := syscall.Kill(n.kubelet.cmd.Process.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	healed := false
	heal = func() {
		if healed {
			return
		}
		healed = true
		_ = syscall.Kill(n.kubelet.cmd.Process.Pid, syscall.SIGCONT)
		for _, chain := range []string{"INPUT", "FORWARD"} {
			if out, err := exec.Command("iptables", append([]string{"-D", chain}, drop...)...).CombinedOutput(); err != nil {
				t.Errorf("iptables -D %s: %v %s", chain, err, out)
			}
		}
		if path == "" {
			return
		}
		if err := n.unmountCover(path, dev); err != nil {
			t.Errorf("node %s: healing the partition: %v", n.Name, err)
		}
	}
	t.Cleanup(heal)
	return heal
}

// unmountCover unmounts the tmpfs Partition laid over path, whose device number is dev.
// A file of it open anywhere (the node plugin or kubelet looking for the pool as the
// node comes back, in the node's namespace or a pod's copy of the mount) makes the
// unmount answer "target is busy" for as long as it stays open: the unmount is tried for
// 60 s, and what still holds the tmpfs then is named in the error.
func (n *Node) unmountCover(path string, dev uint64) error {
	var out []byte
	var err error
	_ = wait.PollUntilContextTimeout(context.Background(), time.Second, 60*time.Second, true, func(context.Context) (bool, error) {
		out, err = n.Command("umount", path).CombinedOutput()
		return err == nil || !strings.Contains(string(out), "busy"), nil
	})
	if err == nil {
		return nil
	}
	return fmt.Errorf("umount %s: %w %s; what holds it: %s", path, err, strings.TrimSpace(string(out)), strings.Join(holdersOf(dev), "; "))
}

// holdersOf names the processes with a file, a working directory or a root on the
// filesystem whose device number is dev, in any mount namespace (a descriptor's stat
// reaches the file itself, whatever path its namespace gives it).
func holdersOf(dev uint64) []string {
	var found []string
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, proc := range procs {
		links, _ := filepath.Glob(proc + "/fd/*")
		links = append(links, proc+"/cwd", proc+"/root")
		for _, l := range links {
			var st syscall.Stat_t
			if syscall.Stat(l, &st) != nil || st.Dev != dev {
				continue
			}
			comm, _ := os.ReadFile(proc + "/comm")
			target, _ := os.Readlink(l)
			found = append(found, fmt.Sprintf("%s (%s) %s -> %s", filepath.Base(proc), strings.TrimSpace(string(comm)), strings.TrimPrefix(l, proc+"/"), target))
		}
	}
	if len(found) == 0 {
		return []string{"no process (a mount below it?)"}
	}
	return found
}

// Vanish takes the mount at path away from the node as a lost pool goes (a lazy or forced
// unmount, a CephFS or NFS client torn down): it is lazily unmounted (umount -l) in the
// node's mount namespace and in every mount namespace of its pods' processes that has a
// mount there (a pod's hostPath of the pool is a mount of its own, which an unmount on
// the node does not reach). What holds a file of it open, a loop device its backing
// file, keeps it, under no path. The node's pods started after it see the empty
// directory below.
//
// Heal mounts it at path in the node's namespace again, shared as before (a new mount of
// the same filesystem, as a remount would be): the containers started since it vanished
// get it too, a container that lost it only when it starts again (KillContainer).
func (n *Node) Vanish(t testing.TB, path string) (heal func()) {
	t.Helper()
	if n.ns == nil {
		t.Fatalf("node %s: Vanish needs the node's own mount namespace", n.Name)
	}
	// The mount is kept, private, out of every pod's sight, to heal from: once unmounted
	// at path, it has no other name in the node's namespace.
	keep := filepath.Join(n.Dir, "vanished")
	if err := os.Mkdir(keep, 0o755); err != nil {
		t.Fatal(err)
	}
	var kept, gone, healed bool
	heal = func() {
		if healed {
			return
		}
		healed = true
		var steps [][]string
		if gone {
			// Over the placeholder, if there is one: a mount on a shared mount reaches
			// its peers, the mounts of it in the containers started since.
			steps = append(steps, []string{"mount", "--bind", keep, path}, []string{"mount", "--make-shared", path})
		}
		if kept {
			steps = append(steps, []string{"umount", keep})
		}
		for _, args := range steps {
			if out, err := n.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
				t.Errorf("node %s: healing a vanished %s: %q: %v %s", n.Name, path, args, err, out)
				return
			}
		}
		if err := os.Remove(keep); err != nil {
			t.Errorf("node %s: %v", n.Name, err)
		}
	}
	t.Cleanup(heal)
	n.Run(t, "mount", "--bind", path, keep)
	kept = true
	n.Run(t, "mount", "--make-private", keep)
	seen := map[string]bool{}
	for _, pid := range n.cgroupPids() {
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
		if err != nil || seen[ns] {
			continue
		}
		seen[ns] = true
		if !slices.Contains(mountsUnderIn(fmt.Sprintf("/proc/%d/mountinfo", pid), path), path) {
			continue
		}
		// The container's own umount, in its PID namespace too: its /proc is that
		// namespace's, where umount reads /proc/self/mountinfo.
		if out, err := exec.Command("nsenter", "-t", strconv.Itoa(pid), "-m", "-p", "--", "umount", "-l", path).CombinedOutput(); err != nil {
			t.Fatalf("node %s: umount -l %s in the mount namespace of process %d: %v %s", n.Name, path, pid, err, out)
		}
	}
	n.Run(t, "umount", "-l", path)
	gone = true
	// What is left is the directory below, on the node's root, which is shared on a
	// node run by systemd (here it is not): a container started from here on mounts it
	// with Bidirectional propagation, which needs a shared mount.
	n.Run(t, "mount", "--bind", path, path)
	n.Run(t, "mount", "--make-shared", path)
	return heal
}

// detachLoop detaches a loop device a test left behind. A device poolcsi fenced carries
// the kernel's read-only flag, which outlives the detach: the next user of that loop
// number (a pool image mounted with -o loop) would get a read-only device.
func detachLoop(dev string) ([]byte, error) {
	_ = exec.Command("blockdev", "--setrw", dev).Run()
	return exec.Command("losetup", "-d", dev).CombinedOutput()
}
