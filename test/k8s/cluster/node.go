package cluster

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/tools"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Node is a real Kubernetes node on this machine: Debian's containerd and runc, a CNI
// bridge from Debian's containernetworking-plugins, kube-proxy and kubelet v1.36, registered
// with the Cluster. Every fact this needed about the machine is in a comment next to the
// setting it explains, and in docs/testing.md.
type Node struct {
	Name       string
	IP         string
	Dir        string // short path: unix sockets must stay under 108 bytes
	Containerd string // containerd's socket
	KubeletDir string
	// KubeletPort serves kubelet's API and /metrics (client certificates of the cluster CA).
	KubeletPort int
	// Config is what sets this node apart from the others of its cluster.
	Config NodeConfig

	c *Cluster
	// ns holds the node's own mount namespace (NodeConfig.OwnMounts) while the node lives.
	ns          *Proc
	restarts    int
	kubeletBin  string
	kubeletArgs []string
	kubelet     *Proc
	containerd  *Proc
}

// NodeConfig is what sets a node apart when a cluster has more than one on this machine.
// The zero value is the one-node cluster: this machine's host name and address, its mount
// table, kubelet's default cgroup root, and the node runs the cluster's kube-proxy and
// kube-scheduler.
type NodeConfig struct {
	// Name is the node's name; "" is this machine's host name.
	Name string
	// Index numbers the node: its CNI bridge is pkcni<Index>, its pods' range
	// 10.244.<Index>.0/24. The nodes share this machine's network namespace (so one
	// kube-proxy's rules serve them all) and route to each other's pods through it.
	Index int
	// OwnMounts runs containerd, kubelet and so every pod of the node in a mount namespace
	// of its own, a slave of this machine's: /var/lib/kubelet, /var/log/pods and
	// /var/log/containers are the node's own directories there, so two nodes use the
	// chart's one kubeletDir as two machines would. Prepare mounts the node's own pools.
	OwnMounts bool
	// Prepare, with OwnMounts, runs once the namespace exists and before containerd starts.
	Prepare func(t testing.TB, n *Node)
	// CgroupRoot is kubelet's cgroupRoot ("" is kubelet's default, /): two kubelets under
	// one root would each remove the other's pod cgroups as orphans.
	CgroupRoot string
	// Secondary: the cluster's kube-proxy and kube-scheduler run on another node.
	Secondary bool
}

// nodeCgroupPrefix starts the cgroup root of every node given one: the reclaim of a killed
// environment finds their processes by it.
const nodeCgroupPrefix = "/poolcsi-test-"

const (
	// KubeletDir is kubelet's real default root: the chart's kubeletDir value and the
	// driver's --allowed-path-prefix assume it, so the node uses it rather than a temp dir.
	KubeletDir = "/var/lib/kubelet"
	// clusterCIDR holds every node's pod range (NodeConfig.Index).
	clusterCIDR     = "10.244.0.0/16"
	cniBridgePrefix = "pkcni"
	// LocalImagePrefix names every image the tests build; nothing is ever pulled.
	LocalImagePrefix = "poolcsi.test/"
	pauseImage       = LocalImagePrefix + "pause:1"
)

// NodeIP is this machine's first non-loopback IPv4 address: kubelet refuses a loopback
// node IP ("nodeIP can't be loopback address").
func NodeIP(t testing.TB) string {
	t.Helper()
	ips := hostIPs()
	if len(ips) == 0 {
		Missing(t, "needs a non-loopback IPv4 address for the node (kubelet refuses 127.0.0.1)")
	}
	return ips[0].String()
}

func requireNode(t testing.TB) {
	t.Helper()
	RequireRoot(t)
	RequireCommands(t, "containerd", "ctr", "runc", "iptables", "iptables-restore", "ip")
	for _, p := range []string{"/usr/lib/cni/bridge", "/usr/lib/cni/host-local", "/usr/lib/cni/loopback"} {
		if !FileExists(p) {
			Missing(t, "needs "+p+" (Debian package containernetworking-plugins; hack/install-deps.sh installs it)")
		}
	}
	if entries, err := os.ReadDir(KubeletDir); err == nil && len(entries) > 0 {
		t.Fatalf("%s exists and is not empty: another kubelet, or a run that did not clean up; remove it first", KubeletDir)
	}
	if pids, _ := exec.Command("pgrep", "-x", "kubelet").Output(); len(pids) > 0 {
		t.Fatalf("a kubelet already runs on this machine (pids %s)", strings.Fields(string(pids)))
	}
}

// StartNode starts containerd, kube-proxy, kube-scheduler and kubelet for c (started with
// ClusterOptions.NodeIP = ip), imports images, and waits until the node is Ready. Everything
// is stopped, unmounted and removed when the test ends, in the reverse order.
func StartNode(t testing.TB, c *Cluster, ip string, images []Image) *Node {
	t.Helper()
	requireNode(t)
	return StartNodeWith(t, c, ip, NodeConfig{}, images)
}

// StartNodeWith is StartNode for one of several nodes (requireNode is the caller's, once).
func StartNodeWith(t testing.TB, c *Cluster, ip string, cfg NodeConfig, images []Image) *Node {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "pk")
	if err != nil {
		t.Fatal(err)
	}
	if c.OnHostPath != nil {
		c.OnHostPath("node", dir)
	}
	name := cfg.Name
	if name == "" {
		host, _ := os.Hostname()
		name = strings.ToLower(strings.SplitN(host, ".", 2)[0])
	}
	n := &Node{Name: name, IP: ip, Dir: dir, KubeletDir: KubeletDir, Config: cfg, c: c}
	// Runs last: whatever the graceful steps left behind.
	t.Cleanup(func() { n.sweep(t) })
	if cfg.CgroupRoot != "" {
		n.makeCgroupRoot(t)
	}
	if cfg.OwnMounts {
		n.enterOwnMounts(t)
	}

	n.startContainerd(t)
	n.Import(t, images)
	if !cfg.Secondary {
		n.startProxy(t)
		n.startScheduler(t)
	}
	n.startKubelet(t)
	WaitFor(t, 120*time.Second, "node "+n.Name+" Ready", func() error {
		n.kubelet.MustRun(t)
		return n.ready()
	})
	return n
}

func (n *Node) startContainerd(t testing.TB) {
	t.Helper()
	n.Containerd = filepath.Join(n.Dir, "c.sock")
	cniConf := filepath.Join(n.Dir, "cni")
	if err := os.MkdirAll(cniConf, 0o755); err != nil {
		t.Fatal(err)
	}
	// One bridge with a private range is all the networking one node needs.
	bridge := fmt.Sprintf(`{"cniVersion":"0.4.0","name":"poolcsi-test","plugins":[
 {"type":"bridge","bridge":%q,"isGateway":true,"ipMasq":false,"hairpinMode":true,
  "ipam":{"type":"host-local","ranges":[[{"subnet":%q}]],"routes":[{"dst":"0.0.0.0/0"}],"dataDir":%q}}]}`,
		n.bridge(), n.podCIDR(), filepath.Join(n.Dir, "ipam"))
	if err := os.WriteFile(filepath.Join(cniConf, "10-poolcsi-test.conflist"), []byte(bridge), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
# /opt/containerd is not ours to create.
disabled_plugins = ["io.containerd.internal.v1.opt"]
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  # No registry is reachable: the sandbox image is one the tests build and import.
  sandbox_image = %q
  # Without CAP_SYS_RESOURCE runc cannot set the oom_score_adj kubelet asks for (-998 for
  # the sandbox) and every sandbox fails with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
`, filepath.Join(n.Dir, "root"), filepath.Join(n.Dir, "state"), n.Containerd, pauseImage, cniConf)
	cfgPath := filepath.Join(n.Dir, "containerd.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	p := n.start(t, "containerd", "containerd", "--config", cfgPath)
	n.containerd = p
	// The containerd of the moment (a node powered on again has another), after the
	// containers are gone.
	t.Cleanup(func() { n.containerd.Stop() })
	// Runs before containerd stops: kill every container, or the shims outlive it.
	t.Cleanup(func() { n.killContainers(t) })
	n.waitContainerd(t)
}

// waitContainerd waits until the node's current containerd answers on its socket.
func (n *Node) waitContainerd(t testing.TB) {
	t.Helper()
	WaitFor(t, 30*time.Second, "containerd socket", func() error {
		n.containerd.MustRun(t)
		out, err := n.ctr("version")
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	})
}

// ctr runs Debian's ctr against this node's containerd, in kubelet's namespace.
func (n *Node) ctr(args ...string) ([]byte, error) {
	return exec.Command("ctr", append([]string{"--address", n.Containerd, "--namespace", "k8s.io"}, args...)...).CombinedOutput()
}

// KillContainer SIGKILLs the task of one of the node's containers (its CRI ID, a pod
// status's containerID without "containerd://"), as a crash or the OOM killer would:
// kubelet, while it runs, starts the container again.
func (n *Node) KillContainer(t testing.TB, id string) {
	t.Helper()
	if out, err := n.ctr("tasks", "kill", "-s", "SIGKILL", id); err != nil {
		t.Fatalf("node %s: kill container %s: %v %s", n.Name, id, err, out)
	}
}

func (n *Node) killContainers(t testing.TB) {
	out, err := n.ctr("tasks", "ls", "-q")
	if err != nil {
		t.Logf("ctr tasks ls: %v %s", err, out)
		return
	}
	for _, id := range strings.Fields(string(out)) {
		_, _ = n.ctr("tasks", "kill", "-s", "SIGKILL", id)
	}
	time.Sleep(500 * time.Millisecond)
	for _, id := range strings.Fields(string(out)) {
		_, _ = n.ctr("tasks", "rm", "-f", id)
	}
	// Network namespaces and sandboxes: let CRI tear down networking (CNI DEL).
	if out, err := exec.Command("ctr", "--address", n.Containerd, "-n", "k8s.io", "containers", "ls", "-q").Output(); err == nil {
		for _, id := range strings.Fields(string(out)) {
			_, _ = n.ctr("containers", "rm", id)
		}
	}
}

func (n *Node) startProxy(t testing.TB) {
	t.Helper()
	bin := tools.Proxy.Path(t)
	// iptables mode: the kubernetes Service (10.96.0.1:443) becomes NodeIP:port, which is
	// how the chart's pods, which use in-cluster config, reach the API server.
	n.c.Start(t, "kube-proxy", bin, nil,
		"--kubeconfig="+n.c.AdminKube, "--hostname-override="+n.Name,
		"--proxy-mode=iptables", "--cluster-cidr="+clusterCIDR,
		// conntrack sysctls are not writable here and not needed on one node.
		"--conntrack-max-per-core=0",
		"--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
		"--metrics-bind-address=127.0.0.1:"+strconv.Itoa(FreePort(t)),
		"--healthz-bind-address=127.0.0.1:"+strconv.Itoa(FreePort(t)),
		"--v=1")
	t.Cleanup(func() {
		if out, err := exec.Command(bin, "--cleanup").CombinedOutput(); err != nil {
			t.Logf("kube-proxy --cleanup: %v %s", err, Tail(string(out), 5))
		}
	})
}

func (n *Node) startScheduler(t testing.TB) {
	t.Helper()
	p := n.c.Start(t, "kube-scheduler", tools.Scheduler.Path(t), nil,
		"--kubeconfig="+n.c.AdminKube,
		"--authentication-kubeconfig="+n.c.AdminKube, "--authorization-kubeconfig="+n.c.AdminKube,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(FreePort(t)),
		"--leader-elect=false", "--v=1")
	time.Sleep(300 * time.Millisecond)
	p.MustRun(t)
}

func (n *Node) startKubelet(t testing.TB) {
	t.Helper()
	n.kubeletBin = tools.Kubelet.Path(t)
	n.KubeletPort = FreePort(t)
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has cgroup v1 only; kubelet v1.36 refuses it unless told, and the
# systemd cgroup driver needs systemd as PID 1, which is not here.
failCgroupV1: false
cgroupDriver: cgroupfs
%sfailSwapOn: false
containerRuntimeEndpoint: unix://%s
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization: {mode: AlwaysAllow}
# Online expansion and volume stats are acted on at kubelet's pod resync (1 min by
# default): 10 s keeps the tests' waits short.
syncFrequency: 10s
volumeStatsAggPeriod: 10s
# A small test disk must never evict the test's own pods or garbage-collect its images:
# nothing can pull them back.
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
featureGates:
  # Volume health from NodeGetVolumeStats: kubelet_volume_stats_health_status_abnormal
  # and Warning events on the pod (alpha in v1.36).
  CSIVolumeHealth: true
`, n.cgroupRootLine(), n.Containerd, n.IP, n.KubeletPort, FreePort(t), n.c.PKI.CACert)
	cfgPath := filepath.Join(n.Dir, "kubelet.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	if !n.Config.OwnMounts { // enterOwnMounts did the same in the node's namespace
		if err := os.MkdirAll(n.KubeletDir, 0o750); err != nil {
			t.Fatal(err)
		}
		// The node plugin mounts kubelet's directory with Bidirectional propagation (its
		// NodeStage/NodePublish mounts must reach kubelet and the pods), which needs a shared
		// mount. systemd makes / shared; this machine's init leaves it private, so kubelet's
		// directory becomes a shared mount of its own (as kind does for its nodes).
		if out, err := exec.Command("mount", "--bind", n.KubeletDir, n.KubeletDir).CombinedOutput(); err != nil {
			t.Fatalf("bind-mount %s: %v %s", n.KubeletDir, err, out)
		}
		if out, err := exec.Command("mount", "--make-rshared", n.KubeletDir).CombinedOutput(); err != nil {
			t.Fatalf("mount --make-rshared %s: %v %s", n.KubeletDir, err, out)
		}
	}
	n.kubeletArgs = []string{
		"--config=" + cfgPath,
		"--kubeconfig=" + n.c.AdminKube,
		"--hostname-override=" + n.Name,
		"--node-ip=" + n.IP,
		"--root-dir=" + n.KubeletDir,
		"--cert-dir=" + filepath.Join(n.Dir, "kubelet-pki"),
		"--v=2",
	}
	n.kubelet = n.start(t, "kubelet", n.kubeletBin, n.kubeletArgs...)
	// The kubelet of the moment (RestartKubelet and PowerOn start others), stopped where
	// the first one would be: after the graceful teardown registered later.
	t.Cleanup(func() { n.kubelet.Stop() })
}

// RestartKubelet stops kubelet (SIGTERM, as systemd would) and starts it again; the new
// kubelet lives as long as the test that started the node.
func (n *Node) RestartKubelet(t testing.TB) {
	t.Helper()
	n.kubelet.Stop()
	n.restarts++
	n.kubelet = n.restart(t, fmt.Sprintf("kubelet-%d", n.restarts+1), n.kubeletBin, n.kubeletArgs...)
	WaitFor(t, 60*time.Second, "node "+n.Name+" Ready after the kubelet restart", func() error {
		n.kubelet.MustRun(t)
		return n.ready()
	})
}

// ready is nil when the node's Ready condition is True and its status is fresh.
func (n *Node) ready() error {
	node, err := n.c.Client.CoreV1().Nodes().Get(context.Background(), n.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for _, cond := range node.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			if cond.Status == corev1.ConditionTrue {
				return nil
			}
			return fmt.Errorf("%s: %s", cond.Reason, cond.Message)
		}
	}
	return fmt.Errorf("no Ready condition yet")
}

// sweep releases what the graceful shutdown left: mounts under kubelet's root and the
// node's directory (deepest first), the CNI bridge, and the directories kubelet creates
// whatever --root-dir says. A field left empty names nothing.
func (n *Node) sweep(t testing.TB) {
	// containerd-shims whose containerd is gone keep their mounts busy. (A reclaim that
	// does not know the node's directory knows no shim to be ours.)
	n.killShims()
	// A node of its own mounts has had them swept in its namespace (sweepOwnMounts);
	// here, kubelet's root and the pod logs are the mount points of every such node.
	own := []string{n.KubeletDir, "/var/log/pods", "/var/log/containers"}
	if n.Config.OwnMounts {
		own = nil
	}
	var netnsLeft []string
	for _, m := range MountsUnder(append([]string{n.Dir, "/run/netns", "/var/run/netns"}, own...)...) {
		if strings.Contains(m, "/netns/cni-") {
			netnsLeft = append(netnsLeft, m)
		}
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil {
			t.Logf("unmount %s: %v", m, err)
		} else {
			t.Logf("swept a leftover mount: %s", m)
		}
	}
	for _, d := range append(own, n.Dir) {
		if d == "" {
			continue
		}
		if left := MountsUnder(d); len(left) > 0 {
			// Removing files under a mount would delete a volume's data.
			t.Errorf("not removing %s: still mounted under it: %v", d, left)
			continue
		}
		if err := os.RemoveAll(d); err != nil {
			t.Logf("remove %s: %v", d, err)
		}
	}
	for _, m := range netnsLeft {
		_ = os.Remove(m)
	}
	// kubelet's canary and firewall chains, and kube-proxy's if it never ran --cleanup (a
	// killed environment).
	for _, table := range []string{"filter", "nat", "mangle"} {
		out, _ := exec.Command("iptables", "-t", table, "-S").Output()
		var chains []string
		for _, line := range strings.Split(string(out), "\n") {
			f := iptablesFields(line)
			switch {
			case len(f) >= 4 && f[0] == "-A" && !strings.HasPrefix(f[1], "KUBE-") && strings.Contains(line, "-j KUBE-"):
				if out, err := exec.Command("iptables", append([]string{"-t", table, "-D"}, f[1:]...)...).CombinedOutput(); err != nil {
					t.Logf("iptables -t %s -D %q: %v %s", table, f[1:], err, out)
				}
			case len(f) == 2 && f[0] == "-N" && strings.HasPrefix(f[1], "KUBE-"):
				chains = append(chains, f[1])
			}
		}
		for _, c := range chains {
			_ = exec.Command("iptables", "-t", table, "-F", c).Run()
		}
		for _, c := range chains {
			_ = exec.Command("iptables", "-t", table, "-X", c).Run()
		}
	}
	// The node's CNI bridge; a reclaim, which does not know the node's index, every one
	// of the harness's.
	ifs, _ := net.Interfaces()
	for _, i := range ifs {
		if !strings.HasPrefix(i.Name, cniBridgePrefix) || (n.Name != "" && i.Name != n.bridge()) {
			continue
		}
		if out, err := exec.Command("ip", "link", "del", i.Name).CombinedOutput(); err != nil {
			t.Logf("ip link del %s: %v %s", i.Name, err, out)
		}
	}
}

// iptablesFields splits a rule as iptables -S prints it: an argument with spaces (a
// comment) is in double quotes, with \" and \\ escaped.
func iptablesFields(line string) []string {
	var f []string
	var cur strings.Builder
	in, quoted := false, false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case quoted && c == '\\' && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
		case c == '"':
			quoted = !quoted
			in = true
		case c == ' ' && !quoted:
			if in {
				f = append(f, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if in {
		f = append(f, cur.String())
	}
	return f
}

// MountsUnder lists the mount points under any of dirs, deepest first.
func MountsUnder(dirs ...string) []string { return mountsUnderIn("/proc/self/mountinfo", dirs...) }

// mountsUnderIn is MountsUnder in the mount table of a mountinfo file.
func mountsUnderIn(mountinfo string, dirs ...string) []string {
	f, err := os.Open(mountinfo)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		for _, d := range dirs {
			if d == "" {
				continue // not "/": an unset directory names nothing
			}
			if mp == d || strings.HasPrefix(mp, d+"/") {
				out = append(out, mp)
				break
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

func unescapeMount(s string) string {
	r := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	return r.Replace(s)
}
