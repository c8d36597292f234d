package cluster

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/hack/release/chart"
)

// The second node's address: kubelet refuses a loopback one, and the nodes share this
// machine's network namespace, so it is one more address of lo (not a loopback address
// to kubelet: it is outside 127.0.0.0/8).
const NodeBIP = "10.250.0.2"

// startNodes starts node-a and node-b, each with its own mount namespace (kubelet's root,
// pod logs, a local pool and a shares directory of its own), cgroup root, bridge and pod
// range; both mount the shared pool: the one this machine mounted at SharedPoolPath
// before, or, if sharedSrc is set, each node its own (sharedSrc[i], bound at
// SharedPoolPath in the node's namespace). The mount points they need are made here and
// removed once both nodes are gone.
func startNodes(t testing.TB, c *Cluster, log *EnvLog, ip string, images []Image, sharedSrc []string) []*Node {
	t.Helper()
	var made []string
	for _, d := range append([]string{LocalPoolPath, SharesDir, SharedPoolPath}, ownDirs...) {
		made = append(made, log.noteMade(t, d)...)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Runs after both nodes are gone: their mount points are empty here.
	t.Cleanup(func() {
		for _, d := range append(append([]string(nil), ownDirs...), LocalPoolPath, SharesDir) {
			if err := os.Remove(d); err != nil && !os.IsNotExist(err) {
				t.Errorf("removing the nodes' mount point %s: %v", d, err)
			}
		}
		for _, d := range made {
			_ = os.Remove(d)
		}
	})
	if out, err := exec.Command("ip", "addr", "replace", NodeBIP+"/32", "dev", "lo").CombinedOutput(); err != nil {
		t.Fatalf("ip addr replace %s dev lo: %v %s", NodeBIP, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "addr", "del", NodeBIP+"/32", "dev", "lo").CombinedOutput(); err != nil {
			t.Errorf("ip addr del %s dev lo: %v %s", NodeBIP, err, out)
		}
	})
	prepare := func(t testing.TB, n *Node) {
		MountPoolFS(t, n, LocalPoolPath, "xfs", 16<<30)
		if sharedSrc != nil {
			n.Run(t, "mount", "--bind", sharedSrc[n.Config.Index], SharedPoolPath)
			t.Cleanup(func() {
				if out, err := n.Command("umount", "-l", SharedPoolPath).CombinedOutput(); err != nil {
					t.Errorf("node %s: umount %s: %v %s", n.Name, SharedPoolPath, err, out)
				}
			})
		}
		// A slave of this machine's mount here (or the node's own); shared as well, for
		// the node plugin's Bidirectional propagation.
		n.Run(t, "mount", "--make-shared", SharedPoolPath)
		own := filepath.Join(n.Dir, "shares")
		if err := os.Mkdir(own, 0o755); err != nil {
			t.Fatal(err)
		}
		SharedBindMount(t, n, SharesDir, own)
	}
	var nodes []*Node
	for i, addr := range []string{ip, NodeBIP} {
		name := fmt.Sprintf("node-%c", 'a'+i)
		nodes = append(nodes, StartNodeWith(t, c, addr, NodeConfig{
			Name: name, Index: i, OwnMounts: true, Prepare: prepare,
			CgroupRoot: nodeCgroupPrefix + name, Secondary: i > 0,
		}, images))
	}
	return nodes
}

// startCephFS runs test/support/cephfs's one-node Ceph cluster (its command cephfs-up, of the main
// module: this module does not import it) until the test ends, and returns its two
// ceph-fuse mounts, one client per node.
func startCephFS(t testing.TB) [2]string {
	t.Helper()
	RequireCommands(t, "ceph", "monmaptool", "ceph-mon", "ceph-mgr", "ceph-osd", "ceph-mds", "ceph-fuse")
	if fi, err := os.Stat("/dev/fuse"); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		Missing(t, fmt.Sprintf("needs /dev/fuse for the ceph-fuse mounts (%v)", err))
	}
	began := time.Now()
	cmd := exec.Command(GoBin(), "run", "./test/support/cephfs/cmd/cephfs-up")
	cmd.Dir = chart.RepoRoot()
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	// Closing its input tears the cluster down.
	t.Cleanup(func() {
		_ = stdin.Close()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("cephfs-up: %v\n%s", err, Tail(stderr.String(), 20))
			}
		case <-time.After(2 * time.Minute):
			_ = cmd.Process.Kill()
			t.Errorf("cephfs-up did not stop within 2 min\n%s", Tail(stderr.String(), 20))
		}
	})
	ready := make(chan error, 1)
	var up struct {
		Mounts    [2]string `json:"mounts"`
		Bootstrap string    `json:"bootstrap"`
	}
	go func() { ready <- json.NewDecoder(stdout).Decode(&up) }()
	select {
	case err := <-ready:
		if err != nil {
			t.Fatalf("cephfs-up: %v\n%s", err, Tail(stderr.String(), 30))
		}
	case <-time.After(10 * time.Minute):
		t.Fatalf("cephfs-up: no cluster after 10 min\n%s", Tail(stderr.String(), 30))
	}
	t.Logf("CephFS up after %s (bootstrap %s): node-a's client at %s, node-b's at %s",
		time.Since(began).Round(time.Second), up.Bootstrap, up.Mounts[0], up.Mounts[1])
	return up.Mounts
}
