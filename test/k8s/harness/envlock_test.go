package harness

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
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

// envLog is the lock of the kubelet environment and, in the lock's file, the record of
// every host path the environment takes, written before it takes it. A run that ends
// cleans up and empties the record before it unlocks; a run that is killed (SIGKILL, a CI
// job cancelled, the machine's session ending) leaves the record behind, and the next
// environment to take the lock undoes what it names before it starts: otherwise one
// killed run fails every later one on this machine ("/var/lib/kubelet exists").
type envLog struct {
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

// lockKubeletEnv waits until no other kubelet environment exists on this machine and holds
// it off until this one is gone: each takes /var/lib/kubelet, the chart's pool paths,
// kubelet's ports and the KUBE-* iptables chains, so two at once (a second go test, or
// make conformance beside make test) would break each other. The lock is released last,
// after every cleanup of the environment.
func lockKubeletEnv(t testing.TB) *envLog {
	t.Helper()
	return lockKubeletEnvAt(t, kubeletEnvLock)
}

func lockKubeletEnvAt(t testing.TB, path string) *envLog {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	l := &envLog{f: f}
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
func (l *envLog) note(t testing.TB, kind, path string) {
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

// noteMount records path as a mount point to be, and every directory up to it that does
// not exist yet as made by the environment.
func (l *envLog) noteMount(t testing.TB, path string) {
	t.Helper()
	l.noteMade(t, path)
	l.note(t, recMount, path)
}

// noteMade notes path and each of its parents that does not exist yet, before they are
// made, and returns them, deepest first.
func (l *envLog) noteMade(t testing.TB, path string) []string {
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
	for dev, line := range ourLoops(k.kubelet, k.mounts...) {
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
		if len(mountsUnder(m)) == 0 {
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
		if left := mountsUnder(d); len(left) > 0 {
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

func TestParseEnvRecord(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     killedEnv
	}{
		{name: "empty"},
		{name: "a clean end", in: ""},
		{name: "owner only", in: "env pid 1 (TestKubelet)\n", want: killedEnv{owner: "pid 1 (TestKubelet)"}},
		{name: "the old lock file", in: "pid 23582 (TestKubelet)\n", want: killedEnv{ignored: []string{"pid 23582 (TestKubelet)"}}},
		{
			name: "a killed run",
			in:   "env pid 7 (TestKubelet)\nkubelet /var/lib/kubelet\ntmp /tmp/TestKubelet1\nmade /var/lib/poolcsi\nmount /var/lib/poolcsi/pools/local\nnode /tmp/pk1\n",
			want: killedEnv{owner: "pid 7 (TestKubelet)", kubelet: "/var/lib/kubelet", nodes: []string{"/tmp/pk1"},
				tmp: []string{"/tmp/TestKubelet1"}, made: []string{"/var/lib/poolcsi"}, mounts: []string{"/var/lib/poolcsi/pools/local"}},
		},
		{
			name: "paths it will not remove",
			in:   "made /\nmade relative\ntmp /tmp/../etc\nkubelet \nnode /tmp/pk1/\n",
			want: killedEnv{ignored: []string{"made /", "made relative", "tmp /tmp/../etc", "kubelet ", "node /tmp/pk1/"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := parseEnvRecord([]byte(tc.in))
			if fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", tc.want) {
				t.Errorf("got  %+v\nwant %+v", got, tc.want)
			}
			if wantEmpty := tc.want.kubelet == "" && tc.want.nodes == nil && tc.want.tmp == nil && tc.want.mounts == nil && tc.want.made == nil; got.empty() != wantEmpty {
				t.Errorf("empty() = %v", got.empty())
			}
		})
	}
}

// TestReclaimKilledEnv lays out, in a temporary directory, what a killed kubelet
// environment leaves (a loop-mounted pool with an attached volume image, mounts under
// kubelet's root and the node's directory, directories it made) with its record, and
// takes the lock over it: everything is gone, and the record is the new holder's.
func TestReclaimKilledEnv(t *testing.T) {
	requireRoot(t)
	requireCommands(t, "losetup", "mkfs.xfs", "mount", "umount", "iptables", "ip")
	// The reclaim sweeps machine-wide state (KUBE-* chains, CNI namespaces): no environment
	// may run beside it.
	lockKubeletEnv(t)

	root := t.TempDir()
	kubelet, node, tmp := filepath.Join(root, "kubelet"), filepath.Join(root, "pk"), filepath.Join(root, "tmp")
	made := filepath.Join(root, "var")
	pool := filepath.Join(made, "pools", "local")
	poolImg := filepath.Join(tmp, "pool.img")
	var volLoop string
	t.Cleanup(func() {
		// Whatever the reclaim did not undo.
		for _, m := range mountsUnder(root) {
			_ = syscall.Unmount(m, syscall.MNT_DETACH)
		}
		if volLoop != "" {
			_ = exec.Command("losetup", "-d", volLoop).Run()
		}
	})
	for _, d := range []string{tmp, pool, filepath.Join(kubelet, "pods", "p", "volumes", "v"), filepath.Join(node, "state", "shm")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	run := func(name string, args ...string) string {
		t.Helper()
		out, err := exec.Command(name, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	if err := os.WriteFile(poolImg, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(poolImg, 512<<20); err != nil {
		t.Fatal(err)
	}
	run("mkfs.xfs", "-q", poolImg)
	run("mount", "-o", "loop", poolImg, pool)
	vol := filepath.Join(pool, "volumes", "0123", "disk.img")
	if err := os.MkdirAll(filepath.Dir(vol), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(vol, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(vol, 64<<20); err != nil {
		t.Fatal(err)
	}
	volLoop = run("losetup", "-f", "--show", vol)
	run("mount", "-t", "tmpfs", "tmpfs", filepath.Join(kubelet, "pods", "p", "volumes", "v"))
	run("mount", "-t", "tmpfs", "tmpfs", filepath.Join(node, "state", "shm"))

	// A kube-proxy killed with its environment never ran --cleanup: its chains stay, jumped
	// to from the built-in chains by rules with quoted comments.
	const chain = "KUBE-POOLCSI-RECLAIM"
	rule := []string{"INPUT", "-m", "comment", "--comment", "poolcsi reclaim test", "-j", chain}
	t.Cleanup(func() {
		_ = exec.Command("iptables", append([]string{"-D"}, rule...)...).Run()
		_ = exec.Command("iptables", "-X", chain).Run()
	})
	run("iptables", "-N", chain)
	run("iptables", append([]string{"-A"}, rule...)...)

	lock := filepath.Join(root, "env.lock")
	record := strings.Join([]string{"env pid 1 (TestKilled)", recKubelet + " " + kubelet, recTmp + " " + tmp,
		recMade + " " + made, recMount + " " + pool, recNode + " " + node, ""}, "\n")
	if err := os.WriteFile(lock, []byte(record), 0o644); err != nil {
		t.Fatal(err)
	}

	t.Run("take the lock", func(t *testing.T) { lockKubeletEnvAt(t, lock) })

	if left := mountsUnder(root); len(left) > 0 {
		t.Errorf("mounts left: %v", left)
	}
	if left := ourLoops("", pool); len(left) > 0 {
		t.Errorf("loop devices left: %v", left)
	}
	if out, _ := exec.Command("losetup", "-j", poolImg).Output(); len(out) > 0 {
		t.Errorf("the pool's loop device is left: %s", out)
	}
	if out, _ := exec.Command("losetup", volLoop).CombinedOutput(); strings.Contains(string(out), "disk.img") {
		t.Errorf("the volume's loop device is left: %s", out)
	} else {
		volLoop = ""
	}
	if out, _ := exec.Command("iptables", "-S").Output(); strings.Contains(string(out), chain) {
		t.Errorf("iptables chain %s is left", chain)
	}
	for _, d := range []string{kubelet, node, tmp, made} {
		if _, err := os.Lstat(d); !os.IsNotExist(err) {
			t.Errorf("%s is left (%v)", d, err)
		}
	}
	// The subtest's cleanup emptied the record as a clean end does.
	if b, _ := os.ReadFile(lock); len(b) != 0 {
		t.Errorf("record after a clean end: %q", b)
	}
}

func TestIptablesFields(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"-N KUBE-SERVICES", []string{"-N", "KUBE-SERVICES"}},
		{`-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS`,
			[]string{"-A", "INPUT", "-m", "comment", "--comment", "kubernetes health check service ports", "-j", "KUBE-NODEPORTS"}},
		{`-A X -m comment --comment "a \"b\" c\\d" -j KUBE-Y`, []string{"-A", "X", "-m", "comment", "--comment", `a "b" c\d`, "-j", "KUBE-Y"}},
		{`-A X -m comment --comment "" -j Y`, []string{"-A", "X", "-m", "comment", "--comment", "", "-j", "Y"}},
		{"", nil},
	} {
		if got := iptablesFields(tc.in); fmt.Sprintf("%q", got) != fmt.Sprintf("%q", tc.want) {
			t.Errorf("iptablesFields(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// fatalTB records a Fatal instead of failing the test, and runs its cleanups when asked.
type fatalTB struct {
	testing.TB
	fatal    string
	cleanups []func()
}

func (f *fatalTB) Helper()                           {}
func (f *fatalTB) Cleanup(fn func())                 { f.cleanups = append(f.cleanups, fn) }
func (f *fatalTB) Fatal(args ...any)                 { f.fatal = fmt.Sprint(args...); runtime.Goexit() }
func (f *fatalTB) Fatalf(format string, args ...any) { f.Fatal(fmt.Sprintf(format, args...)) }

func (f *fatalTB) run(fn func(testing.TB)) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	for i := len(f.cleanups) - 1; i >= 0; i-- {
		f.cleanups[i]()
	}
}

// TestFailedReclaimKeepsRecord: a reclaim that cannot finish (here a mount under a temp
// directory the record names, which it will not delete files under) fails, and leaves
// the record for the next attempt rather than forgetting what is left.
func TestFailedReclaimKeepsRecord(t *testing.T) {
	requireRoot(t)
	requireCommands(t, "mount", "iptables", "ip")
	lockKubeletEnv(t) // the reclaim sweeps machine-wide state
	root := t.TempDir()
	tmp := filepath.Join(root, "tmp")
	busy := filepath.Join(tmp, "busy")
	if err := os.MkdirAll(busy, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "tmpfs", busy).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v %s", err, out)
	}
	t.Cleanup(func() { _ = syscall.Unmount(busy, syscall.MNT_DETACH) })
	lock := filepath.Join(root, "env.lock")
	record := "env pid 1 (TestKilled)\n" + recTmp + " " + tmp + "\n"
	if err := os.WriteFile(lock, []byte(record), 0o644); err != nil {
		t.Fatal(err)
	}

	f := &fatalTB{TB: t}
	f.run(func(tb testing.TB) { lockKubeletEnvAt(tb, lock) })

	if !strings.Contains(f.fatal, "still mounted under it") {
		t.Errorf("reclaim did not fail as expected: %q", f.fatal)
	}
	if b, _ := os.ReadFile(lock); string(b) != record {
		t.Errorf("record after a failed reclaim: %q, want it kept: %q", b, record)
	}
	if _, err := os.Stat(busy); err != nil {
		t.Errorf("what was mounted is gone: %v", err)
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
