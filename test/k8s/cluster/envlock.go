package cluster

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// kubeletEnvLock is held while a kubelet environment exists on this machine.
const kubeletEnvLock = "/run/lock/poolcsi-kubelet-env.lock"

// EnvLog is the lock of the kubelet environment and, in the lock's file, the record of
// every host path the environment takes, written before it takes it. A run that ends
// cleans up and empties the record before it unlocks; a run that is killed (SIGKILL, a CI
// job cancelled, the machine's session ending) leaves the record behind, and the next
// environment to take the lock undoes what it names before it starts: otherwise one
// killed run fails every later one on this machine ("/var/lib/kubelet exists").
type EnvLog struct {
	f *os.File
}

// Record kinds, one "kind path" per line.
const (
	recKubelet = "kubelet" // kubelet's root directory
	recNode    = "node"    // the node's directory: containerd's root, state and socket
	recTmp     = "tmp"     // the test's temporary directory (pool images, PKI, etcd)
	recMount   = "mount"   // a mount point the environment mounted (a pool, the shares dir)
	recMade    = "made"    // a directory the environment created on the host
)

// LockKubeletEnv waits until no other kubelet environment exists on this machine and holds
// it off until this one is gone: each takes /var/lib/kubelet, the chart's pool paths,
// kubelet's ports and the KUBE-* iptables chains, so two at once (a second go test, or
// make conformance beside make test) would break each other. The lock is released last,
// after every cleanup of the environment.
func LockKubeletEnv(t testing.TB) *EnvLog {
	t.Helper()
	return lockKubeletEnvAt(t, kubeletEnvLock)
}

func lockKubeletEnvAt(t testing.TB, path string) *EnvLog {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	l := &EnvLog{f: f}
	// Registered first, so it runs last: the record is emptied only once every other
	// cleanup of the environment has run, and only if it is this environment's: a reclaim
	// that failed leaves the killed environment's record for the next attempt.
	owned := false
	t.Cleanup(func() {
		if owned {
			_ = f.Truncate(0)
		}
		f.Close()
	})
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		b, _ := io.ReadAll(f)
		owner, _, _ := strings.Cut(string(b), "\n")
		t.Logf("waiting for the kubelet environment of %s to finish (%s)", strings.TrimSpace(owner), path)
		start := time.Now()
		for {
			if err = unix.Flock(int(f.Fd()), unix.LOCK_EX); err != unix.EINTR {
				break
			}
		}
		if err != nil {
			t.Fatalf("lock %s: %v", path, err)
		}
		t.Logf("waited %s for the other kubelet environment", time.Since(start).Round(time.Second))
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if k := parseEnvRecord(b); !k.empty() {
		k.reclaim(t)
	}
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	owned = true
	if _, err := f.WriteAt([]byte(fmt.Sprintf("env pid %d (%s)\n", os.Getpid(), t.Name())), 0); err != nil {
		t.Fatal(err)
	}
	return l
}

// note records that the environment is about to take path.
func (l *EnvLog) note(t testing.TB, kind, path string) {
	t.Helper()
	if _, err := l.f.Seek(0, io.SeekEnd); err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprintf(l.f, "%s %s\n", kind, path); err != nil {
		t.Fatal(err)
	}
	if err := l.f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// NoteMount records path as a mount point to be, and every directory up to it that does
// not exist yet as made by the environment.
func (l *EnvLog) NoteMount(t testing.TB, path string) {
	t.Helper()
	l.noteMade(t, path)
	l.note(t, recMount, path)
}

// noteMade notes path and each of its parents that does not exist yet, before they are
// made, and returns them, deepest first.
func (l *EnvLog) noteMade(t testing.TB, path string) []string {
	t.Helper()
	var made []string
	for p := path; p != "/" && p != "."; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil {
			break
		}
		made = append(made, p)
	}
	for i := len(made) - 1; i >= 0; i-- {
		l.note(t, recMade, made[i])
	}
	return made
}

// killedEnv is what the record of an environment that did not clean up names.
type killedEnv struct {
	owner             string
	kubelet           string
	nodes             []string // a cluster of several nodes notes each node's directory
	tmp, mounts, made []string
	ignored           []string
}

func (k killedEnv) empty() bool {
	return k.kubelet == "" && len(k.nodes)+len(k.tmp)+len(k.mounts)+len(k.made) == 0
}

// parseEnvRecord reads a record. Only absolute, clean paths other than / are taken: the
// reclaim removes what the record names.
func parseEnvRecord(b []byte) killedEnv {
	var k killedEnv
	for _, line := range strings.Split(string(b), "\n") {
		kind, path, _ := strings.Cut(strings.TrimSpace(line), " ")
		if kind == "env" {
			k.owner = path
			continue
		}
		if kind == "" {
			continue
		}
		if !filepath.IsAbs(path) || filepath.Clean(path) != path || path == "/" {
			k.ignored = append(k.ignored, line)
			continue
		}
		switch kind {
		case recKubelet:
			k.kubelet = path
		case recNode:
			k.nodes = append(k.nodes, path)
		case recTmp:
			k.tmp = append(k.tmp, path)
		case recMount:
			k.mounts = append(k.mounts, path)
		case recMade:
			k.made = append(k.made, path)
		default:
			k.ignored = append(k.ignored, line)
		}
	}
	return k
}

// reclaim undoes, in the order of the graceful teardown, what a killed environment took:
// its containers, its mounts under kubelet's root and the node's directory, the loop
// devices of its volumes, its pools, and the directories it made.
func (k killedEnv) reclaim(t testing.TB) {
	t.Helper()
	if pids, _ := exec.Command("pgrep", "-x", "kubelet").Output(); len(pids) > 0 {
		t.Fatalf("the kubelet environment of %s was killed before it cleaned up, and a kubelet still runs (pids %s): stop it first",
			k.owner, strings.Fields(string(pids)))
	}
	t.Logf("the kubelet environment of %s was killed before it cleaned up: reclaiming kubelet %q, nodes %q, mounts %q, temp %q, made %q",
		k.owner, k.kubelet, k.nodes, k.mounts, k.tmp, k.made)
	for _, line := range k.ignored {
		t.Logf("reclaim: ignoring record line %q", line)
	}
	killKubepods(t)
	// A node of its own mount namespace lost its mounts with the namespace, once its
	// processes were gone; kubelet's root and the pod logs are swept once, here.
	nodes := append([]string(nil), k.nodes...)
	if len(nodes) == 0 {
		nodes = []string{""}
	}
	for _, d := range nodes {
		n := &Node{Dir: d, KubeletDir: k.kubelet}
		if d != "" {
			n.Containerd = filepath.Join(d, "c.sock")
		}
		n.sweep(t)
	}
	// The cgroup roots of the nodes given one.
	roots, _ := filepath.Glob("/sys/fs/cgroup/*" + nodeCgroupPrefix + "*")
	for _, r := range roots {
		removeCgroup(t, r)
	}
	// The pools must still be mounted: that is how their volumes' loop devices are known.
	for dev, line := range OurLoops(k.kubelet, k.mounts...) {
		t.Logf("reclaim: detaching %s", line)
		if out, err := detachLoop(dev); err != nil {
			t.Logf("losetup -d %s: %v %s", dev, err, out)
		}
	}
	for _, dev := range nestedLoops(k.tmp...) {
		t.Logf("reclaim: detaching %s, a volume of a pool image under %q", dev, k.tmp)
		if out, err := detachLoop(dev); err != nil {
			t.Logf("losetup -d %s: %v %s", dev, err, out)
		}
	}
	mounts := append([]string(nil), k.mounts...)
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i]) > len(mounts[j]) })
	for _, m := range mounts {
		if len(MountsUnder(m)) == 0 {
			continue
		}
		if out, err := exec.Command("umount", "-R", m).CombinedOutput(); err != nil {
			t.Logf("umount -R %s: %v %s; detaching it", m, err, out)
			_ = exec.Command("umount", "-R", "-l", m).Run()
		}
	}
	remove := append(append([]string(nil), k.tmp...), k.made...)
	sort.Slice(remove, func(i, j int) bool { return len(remove[i]) > len(remove[j]) })
	for _, d := range remove {
		if left := MountsUnder(d); len(left) > 0 {
			// Removing files under a mount would delete what is mounted there.
			t.Fatalf("reclaim: not removing %s: still mounted under it: %v", d, left)
		}
		if err := os.RemoveAll(d); err != nil {
			t.Fatalf("reclaim: %v", err)
		}
	}
}

// killKubepods kills what is left of the pods' containers: a shim killed with its
// environment leaves them running, holding their mounts and the volumes' devices. Kubelet
// puts every pod under the kubepods cgroup; nothing else on the machine is there.
func killKubepods(t testing.TB) {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*/cgroup")
	killed := 0
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.SplitN(line, ":", 3)
			if len(f) == 3 && (f[2] == "/kubepods" || strings.HasPrefix(f[2], "/kubepods/") || strings.HasPrefix(f[2], "/kubepods.slice") ||
				strings.HasPrefix(f[2], nodeCgroupPrefix)) {
				pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
				if pid > 0 && syscall.Kill(pid, syscall.SIGKILL) == nil {
					killed++
				}
				break
			}
		}
	}
	if killed > 0 {
		t.Logf("reclaim: killed %d processes of the pods' containers", killed)
		time.Sleep(500 * time.Millisecond)
	}
}

// nestedLoops lists the loop devices whose backing file is on a filesystem that is itself
// on a loop device backed by a file under one of dirs: the volumes of a pool image of a
// killed environment, which losetup names only relative to the pool (a node's own mount
// namespace, where the pool was mounted, is gone) and which keep that pool's filesystem,
// and so its image's device, alive.
func nestedLoops(dirs ...string) []string {
	out, _ := exec.Command("losetup", "-l", "-n", "-O", "NAME,MAJ:MIN,BACK-MAJ:MIN,BACK-FILE").Output()
	type loop struct{ name, majmin, back, file string }
	var loops []loop
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		loops = append(loops, loop{f[0], f[1], f[2], strings.Join(f[3:], " ")})
	}
	pools := map[string]bool{}
	for _, l := range loops {
		for _, d := range dirs {
			if d != "" && strings.HasPrefix(l.file, d+"/") {
				pools[l.majmin] = true
			}
		}
	}
	var nested []string
	for _, l := range loops {
		if pools[l.back] {
			nested = append(nested, l.name)
		}
	}
	return nested
}
