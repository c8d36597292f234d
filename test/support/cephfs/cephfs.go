// Package cephfs runs a one-node Ceph cluster for the tests: a monitor, a manager,
// one BlueStore OSD on a sparse file, a metadata server and a CephFS, all on
// 127.0.0.1 under one short temporary directory, with its own fsid, config and
// ports, and two ceph-fuse mounts of the same filesystem standing in for two nodes.
//
// A test package that uses it calls Shared from its tests (the cluster starts on
// first use, once per test binary) and Main from its TestMain (which tears it down
// after the tests, failed or not). Everything it starts is a child of the test
// process with a parent-death signal, so a killed test leaves no daemon behind;
// a mount or directory left by such a test is removed by the next Start.
package cephfs

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// Commands the cluster needs (hack/install-deps.sh installs them).
var Commands = []string{"ceph", "monmaptool", "ceph-mon", "ceph-mgr", "ceph-osd", "ceph-mds", "ceph-fuse", "umount"}

// EarlyReplyEnv, set to "false", turns off the MDS's early replies for a faster
// run. The default is Ceph's own (mds_early_reply = true): a create or rename on
// one client then stalls a lookup from the other for up to a journal flush
// (~5 s), as on real clusters, and that is what CI runs.
const EarlyReplyEnv = "POOLCSI_CEPH_MDS_EARLY_REPLY"

// SessionTimeout is the filesystem's session_timeout (Ceph's default: 60 s).
const SessionTimeout = 30 * time.Second

// dirPrefix names the cluster directories under the temp dir; stale ones (whose
// test process is gone) are cleaned up by the next Start.
const dirPrefix = "pcceph-"

// Cluster is a running one-node Ceph with a CephFS mounted twice.
type Cluster struct {
	Dir        string    // everything of the cluster lives here
	Conf       string    // ceph.conf
	Mon        string    // the monitor's address, as Ceph writes it (v2:127.0.0.1:<port>)
	Mounts     [2]string // the ceph-fuse mount points: node A and node B
	EarlyReply bool      // mds_early_reply as configured

	Bootstrap time.Duration // from nothing to both mounts ready
	RSS       int64         // bytes resident in the daemons and clients once ready

	mu      sync.Mutex
	daemons []*proc
	clients [2]*proc
}

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	log  *bytes.Buffer
}

// Options tunes Start.
type Options struct {
	// EarlyReply is the MDS's mds_early_reply; nil keeps Ceph's default (true)
	// unless EarlyReplyEnv says otherwise.
	EarlyReply *bool
}

var (
	sharedOnce sync.Once
	shared     *Cluster
	sharedErr  error
)

// Require stops a test that cannot run a cluster here: not root, no /dev/fuse,
// a Ceph command missing. Outside CI it skips with the reason; under CI it fails.
func Require(t testing.TB) {
	t.Helper()
	testutil.RequireRoot(t)
	for _, c := range Commands {
		if _, err := exec.LookPath(c); err != nil {
			missing(t, "needs the command "+c+" for the CephFS tests (hack/install-deps.sh installs ceph-common, ceph-base, ceph-mon, ceph-mgr, ceph-osd, ceph-mds, ceph-fuse)")
		}
	}
	if fi, err := os.Stat("/dev/fuse"); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		missing(t, fmt.Sprintf("needs /dev/fuse for the ceph-fuse mounts of the CephFS tests (%v)", err))
	}
}

func missing(t testing.TB, why string) {
	t.Helper()
	if testutil.InCI() {
		t.Fatalf("prerequisite missing in CI: %s", why)
	}
	t.Skipf("prerequisite missing: %s", why)
}

// Shared returns the test binary's cluster, starting it on the first call. A
// failed start fails every test that asks (it is not retried).
func Shared(t testing.TB) *Cluster {
	t.Helper()
	Require(t)
	sharedOnce.Do(func() {
		shared, sharedErr = Start(context.Background(), Options{})
		if sharedErr == nil {
			fmt.Fprintf(os.Stderr, "cephfs: one-node cluster ready in %s, %d MiB resident (mds_early_reply=%t) at %s\n",
				shared.Bootstrap.Round(10*time.Millisecond), shared.RSS>>20, shared.EarlyReply, shared.Dir)
		}
	})
	if sharedErr != nil {
		t.Fatalf("cephfs: %v", sharedErr)
	}
	return shared
}

// Main runs the package's tests and then stops the shared cluster if one was
// started. Use it as os.Exit(cephfs.Main(m)) in TestMain.
func Main(m *testing.M) int {
	code := m.Run()
	if shared != nil {
		if err := shared.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "cephfs: teardown: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}
	return code
}

// Start bootstraps a cluster from nothing. On error nothing it made is left.
func Start(ctx context.Context, o Options) (c *Cluster, err error) {
	began := time.Now()
	cleanStale()
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, err
	}
	c = &Cluster{Dir: dir, Conf: filepath.Join(dir, "ceph.conf"), EarlyReply: true}
	if v := os.Getenv(EarlyReplyEnv); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("%s=%q: %w", EarlyReplyEnv, v, err)
		}
		c.EarlyReply = b
	}
	if o.EarlyReply != nil {
		c.EarlyReply = *o.EarlyReply
	}
	defer func() {
		if err != nil {
			logs := c.tailLogs()
			if serr := c.Stop(); serr != nil {
				err = fmt.Errorf("%w (and teardown: %w)", err, serr)
			}
			err = fmt.Errorf("%w\n%s", err, logs)
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, "owner"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return c, err
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	if err := c.bootstrap(ctx); err != nil {
		return c, err
	}
	c.Bootstrap = time.Since(began)
	c.RSS = c.rss()
	return c, nil
}

func (c *Cluster) path(p ...string) string { return filepath.Join(append([]string{c.Dir}, p...)...) }

func (c *Cluster) bootstrap(ctx context.Context) error {
	for _, d := range []string{"run", "log", "crash", "mon/a", "mgr/x", "osd/0", "mds/a", "nodeA", "nodeB"} {
		if err := os.MkdirAll(c.path(d), 0o755); err != nil {
			return err
		}
	}
	c.Mounts = [2]string{c.path("nodeA"), c.path("nodeB")}
	port, err := freePort()
	if err != nil {
		return err
	}
	fsid := uuid()
	mon := fmt.Sprintf("v2:127.0.0.1:%d", port)
	c.Mon = mon
	if err := os.WriteFile(c.Conf, []byte(c.config(fsid, mon)), 0o644); err != nil {
		return err
	}
	// Monitor.
	if err := run(ctx, "monmaptool", "--create", "--fsid", fsid, "--addv", "a", "["+mon+"]", c.path("monmap")); err != nil {
		return err
	}
	if err := run(ctx, "ceph-mon", "-c", c.Conf, "-i", "a", "--mkfs", "--monmap", c.path("monmap")); err != nil {
		return err
	}
	if err := c.daemon("mon.a", "ceph-mon", "-c", c.Conf, "-i", "a", "-f"); err != nil {
		return err
	}
	// Manager (it reports pool usage, which CephFS's statfs reads) and OSD.
	if err := c.daemon("mgr.x", "ceph-mgr", "-c", c.Conf, "-i", "x", "-f"); err != nil {
		return err
	}
	osdUUID := uuid()
	out, err := c.Ceph(ctx, "osd", "new", osdUUID)
	if err != nil {
		return err
	}
	if id := strings.TrimSpace(out); id != "0" {
		return fmt.Errorf("ceph osd new gave osd %q, want 0", id)
	}
	if err := run(ctx, "ceph-osd", "-c", c.Conf, "-i", "0", "--mkfs", "--osd-uuid", osdUUID); err != nil {
		return err
	}
	if err := c.daemon("osd.0", "ceph-osd", "-c", c.Conf, "-i", "0", "-f"); err != nil {
		return err
	}
	// The filesystem and its metadata server.
	for _, p := range []string{"cephfs_metadata", "cephfs_data"} {
		if _, err := c.Ceph(ctx, "osd", "pool", "create", p, "8", "8"); err != nil {
			return err
		}
	}
	if _, err := c.Ceph(ctx, "fs", "new", "cephfs", "cephfs_metadata", "cephfs_data"); err != nil {
		return err
	}
	// A client that stops answering is marked stale, and its capabilities
	// taken back, after session_timeout: 30 s here (the least Ceph allows)
	// instead of 60, so the
	// tests of a dead node do not wait a minute. Eviction (its locks) is
	// left at the default.
	if _, err := c.Ceph(ctx, "fs", "set", "cephfs", "session_timeout", strconv.Itoa(int(SessionTimeout/time.Second))); err != nil {
		return err
	}
	if err := c.daemon("mds.a", "ceph-mds", "-c", c.Conf, "-i", "a", "-f"); err != nil {
		return err
	}
	if err := c.waitFor(ctx, "the OSD up and the MDS active", c.fsReady); err != nil {
		return err
	}
	// statfs on CephFS reports the usage the manager has collected: until it
	// has, a pool on it looks like a filesystem of size 0.
	if err := c.waitFor(ctx, "usage reported to the manager", c.usageReported); err != nil {
		return err
	}
	for i := range c.Mounts {
		if err := c.Mount(ctx, i); err != nil {
			return err
		}
	}
	return nil
}

// config is the cluster's ceph.conf: one of everything, no authentication,
// small memory, every path under the cluster's directory.
func (c *Cluster) config(fsid, mon string) string {
	d := c.Dir
	return fmt.Sprintf(`[global]
fsid = %[2]s
mon_host = [%[3]s]
public_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_msgr2 = true
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
auth_allow_insecure_global_id_reclaim = true
keyring = /dev/null
run_dir = %[1]s/run
admin_socket = %[1]s/run/$name.$pid.asok
log_file = %[1]s/log/$name.log
crash_dir = %[1]s/crash
pid_file =
err_to_stderr = true
log_to_stderr = false
mon_data = %[1]s/mon/$id
mgr_data = %[1]s/mgr/$id
osd_data = %[1]s/osd/$id
mds_data = %[1]s/mds/$id
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_allow_pool_delete = true
mon_data_avail_warn = 2
mon_data_avail_crit = 1
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
client_mount_timeout = 60
mgr_stats_period = 1

[mon]
mon_cluster_log_file = %[1]s/log/cluster.log

[osd]
osd_objectstore = bluestore
bluestore_block_path = %[1]s/osd/$id.block
bluestore_block_create = true
bluestore_block_size = 16G
bluestore_fsck_on_mkfs = false
bluestore_fsck_on_mount = false
bluestore_cache_autotune = false
bluestore_cache_size = 64M
osd_memory_target = 896M
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 1

[mds]
mds_early_reply = %[4]t
mds_cache_memory_limit = 128M
`, d, fsid, mon, c.EarlyReply)
}

// Mount mounts the filesystem with ceph-fuse at Mounts[i] (client.nodeA or
// client.nodeB) and waits until it is a mount point.
func (c *Cluster) Mount(ctx context.Context, i int) error {
	mnt := c.Mounts[i]
	name := "client.node" + string(rune('A'+i))
	p, err := c.start(name, "ceph-fuse", "-c", c.Conf, "-n", name, "-f", mnt)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.clients[i] = p
	c.mu.Unlock()
	return c.waitFor(ctx, "ceph-fuse mounted at "+mnt, func(context.Context) (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("ceph-fuse %s exited: %s", name, p.output())
		default:
		}
		ok, err := mountinfo.Mounted(mnt)
		return ok, err
	})
}

// KillClient SIGKILLs node i's ceph-fuse, as a node that dies does: the client
// never says goodbye, and the MDS keeps its session, caps and locks until it
// evicts it. The mount point is left disconnected; Stop unmounts it.
func (c *Cluster) KillClient(i int) {
	c.mu.Lock()
	p := c.clients[i]
	c.mu.Unlock()
	if p == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// PauseClient stops node i's ceph-fuse (SIGSTOP), as a node cut off from the
// cluster looks to it and to its own users: every operation on the mount
// hangs, and the MDS hears nothing until ResumeClient.
func (c *Cluster) PauseClient(i int) error { return c.signalClient(i, syscall.SIGSTOP) }

// ResumeClient lets a paused ceph-fuse run again (SIGCONT).
func (c *Cluster) ResumeClient(i int) error { return c.signalClient(i, syscall.SIGCONT) }

func (c *Cluster) signalClient(i int, sig syscall.Signal) error {
	c.mu.Lock()
	p := c.clients[i]
	c.mu.Unlock()
	if p == nil {
		return fmt.Errorf("node %c has no ceph-fuse", 'A'+i)
	}
	return p.cmd.Process.Signal(sig)
}

// EvictClient evicts node i's client sessions from the MDS, as an operator
// does for a dead node instead of waiting out mds_session_autoclose (300 s):
// its caps and locks are released at once. It returns how many it evicted.
func (c *Cluster) EvictClient(ctx context.Context, i int) (int, error) {
	out, err := c.Ceph(ctx, "tell", "mds.a", "session", "ls", "--format=json")
	if err != nil {
		return 0, err
	}
	var sessions []struct {
		ID       int64 `json:"id"`
		Metadata struct {
			Entity string `json:"entity_id"`
		} `json:"client_metadata"`
	}
	if err := json.Unmarshal([]byte(out[strings.Index(out, "["):]), &sessions); err != nil {
		return 0, fmt.Errorf("mds session ls: %w: %s", err, out)
	}
	n := 0
	for _, s := range sessions {
		if s.Metadata.Entity != "node"+string(rune('A'+i)) {
			continue
		}
		if _, err := c.Ceph(ctx, "tell", "mds.a", "client", "evict", "id="+strconv.FormatInt(s.ID, 10)); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// Remount replaces node i's ceph-fuse after KillClient: the dead mount is
// taken down and a new client mounts the filesystem at the same place.
func (c *Cluster) Remount(ctx context.Context, i int) error {
	c.KillClient(i)
	if err := unmount(c.Mounts[i]); err != nil {
		return err
	}
	return c.Mount(ctx, i)
}

// Ceph runs the ceph command line against the cluster and returns its output.
func (c *Cluster) Ceph(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ceph", append([]string{"-c", c.Conf, "--connect-timeout", "30"}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("ceph %s: %w\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String(), nil
}

func (c *Cluster) fsReady(ctx context.Context) (bool, error) {
	out, err := c.Ceph(ctx, "fs", "dump", "-f", "json")
	if err != nil {
		return false, err
	}
	var dump struct {
		Filesystems []struct {
			MDSMap struct {
				Info map[string]struct {
					State string `json:"state"`
				} `json:"info"`
			} `json:"mdsmap"`
		} `json:"filesystems"`
	}
	if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &dump); err != nil {
		return false, fmt.Errorf("ceph fs dump: %w: %s", err, out)
	}
	for _, fs := range dump.Filesystems {
		for _, i := range fs.MDSMap.Info {
			if i.State == "up:active" {
				return true, nil
			}
		}
	}
	return false, nil
}

func (c *Cluster) usageReported(ctx context.Context) (bool, error) {
	out, err := c.Ceph(ctx, "df", "-f", "json")
	if err != nil {
		return false, err
	}
	var df struct {
		Stats struct {
			Total int64 `json:"total_bytes"`
		} `json:"stats"`
	}
	if err := json.Unmarshal([]byte(out), &df); err != nil {
		return false, fmt.Errorf("ceph df: %w: %s", err, out)
	}
	return df.Stats.Total > 0, nil
}

func (c *Cluster) waitFor(ctx context.Context, what string, cond func(context.Context) (bool, error)) error {
	var last error
	for {
		ok, err := cond(ctx)
		if ok {
			return nil
		}
		last = err
		for _, p := range c.daemons {
			select {
			case <-p.done:
				return fmt.Errorf("waiting for %s: %s exited: %v\n%s", what, p.name, p.cmd.ProcessState, p.output())
			default:
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last error: %w)", what, ctx.Err(), last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Cluster) daemon(name, bin string, args ...string) error {
	p, err := c.start(name, bin, args...)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.daemons = append(c.daemons, p)
	c.mu.Unlock()
	return nil
}

func (c *Cluster) start(name, bin string, args ...string) (*proc, error) {
	p := &proc{name: name, cmd: exec.Command(bin, args...), done: make(chan struct{}), log: &bytes.Buffer{}}
	p.cmd.Stdout = &lockedWriter{w: p.log}
	p.cmd.Stderr = p.cmd.Stdout
	// Its own process group (a terminal's ^C reaches the test, which tears
	// down in order), and it dies with the test process.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	return p, nil
}

func (p *proc) output() string {
	lw := p.cmd.Stdout.(*lockedWriter)
	lw.mu.Lock()
	defer lw.mu.Unlock()
	return lw.w.String()
}

func (p *proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	if grace == 0 {
		_ = p.cmd.Process.Kill()
		<-p.done
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// Stop unmounts both clients, ends every daemon and removes the directory.
func (c *Cluster) Stop() error {
	var errs []error
	for _, mnt := range c.Mounts {
		if mnt == "" {
			continue
		}
		if err := unmount(mnt); err != nil {
			errs = append(errs, err)
		}
	}
	c.mu.Lock()
	clients, daemons := c.clients, c.daemons
	c.mu.Unlock()
	for _, p := range clients {
		if p != nil {
			p.stop(5 * time.Second)
		}
	}
	// The cluster's data goes with it, so no daemon needs a clean shutdown
	// (the OSD and the MDS take seconds to give up on a monitor already gone).
	for _, p := range daemons {
		p.stop(0)
	}
	if len(errs) == 0 {
		if err := os.RemoveAll(c.Dir); err != nil {
			errs = append(errs, err)
		}
	} else {
		errs = append(errs, fmt.Errorf("left %s in place: a mount under it is still there", c.Dir))
	}
	return errors.Join(errs...)
}

// unmount takes a ceph-fuse mount down, lazily if a dead or busy client keeps
// it from going at once. Nothing is removed below a mount point still mounted.
func unmount(mnt string) error {
	for i := 0; ; i++ {
		// Read from the mount table: a stat of a dead client's mount point
		// fails (ENOTCONN), which is what Mounted does.
		ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(mnt))
		if err != nil {
			return err
		}
		if len(ms) == 0 {
			return nil
		}
		args := []string{mnt}
		if i >= 3 {
			args = []string{"-l", mnt}
		}
		out, err := exec.Command("umount", args...).CombinedOutput()
		if err != nil && i >= 5 {
			return fmt.Errorf("umount %s: %w: %s", mnt, err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// cleanStale removes what a test process that was killed left: fuse mounts and
// directories of clusters whose owner process is gone. Clusters of running
// processes (another test binary, another engineer) are left alone.
func cleanStale() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, d := range dirs {
		raw, err := os.ReadFile(filepath.Join(d, "owner"))
		if err != nil {
			continue // not ours, or still being made
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
		if err != nil || pid <= 0 || syscall.Kill(pid, 0) == nil {
			continue
		}
		ok := true
		for _, m := range []string{"nodeA", "nodeB"} {
			if unmount(filepath.Join(d, m)) != nil {
				ok = false
			}
		}
		if ok {
			os.RemoveAll(d)
		}
	}
}

// rss sums the resident memory of the cluster's processes.
func (c *Cluster) rss() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var total int64
	for _, p := range append(append([]*proc{}, c.daemons...), c.clients[0], c.clients[1]) {
		if p == nil {
			continue
		}
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(raw), "\n") {
			if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				total += kb << 10
			}
		}
	}
	return total
}

// tailLogs is the end of every daemon's log, for a failed start.
func (c *Cluster) tailLogs() string {
	var b strings.Builder
	logs, _ := filepath.Glob(c.path("log", "*.log"))
	for _, l := range logs {
		raw, err := os.ReadFile(l)
		if err != nil {
			continue
		}
		if len(raw) > 3000 {
			raw = raw[len(raw)-3000:]
		}
		fmt.Fprintf(&b, "--- %s (end)\n%s\n", filepath.Base(l), raw)
	}
	return b.String()
}

func run(ctx context.Context, bin string, args ...string) error {
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w\n%s", bin, strings.Join(args, " "), err, out)
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func uuid() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

type lockedWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
