package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
)

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
	RequireRoot(t)
	RequireCommands(t, "losetup", "mkfs.xfs", "mount", "umount", "iptables", "ip")
	// The reclaim sweeps machine-wide state (KUBE-* chains, CNI namespaces): no environment
	// may run beside it.
	LockKubeletEnv(t)

	root := t.TempDir()
	kubelet, node, tmp := filepath.Join(root, "kubelet"), filepath.Join(root, "pk"), filepath.Join(root, "tmp")
	made := filepath.Join(root, "var")
	pool := filepath.Join(made, "pools", "local")
	poolImg := filepath.Join(tmp, "pool.img")
	var volLoop string
	t.Cleanup(func() {
		// Whatever the reclaim did not undo.
		for _, m := range MountsUnder(root) {
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

	if left := MountsUnder(root); len(left) > 0 {
		t.Errorf("mounts left: %v", left)
	}
	if left := OurLoops("", pool); len(left) > 0 {
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
	RequireRoot(t)
	RequireCommands(t, "mount", "iptables", "ip")
	LockKubeletEnv(t) // the reclaim sweeps machine-wide state
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
