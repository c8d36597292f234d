// Package csiproc builds the real poolcsi binary and runs it as a separate process
// on temporary pools, the way kubelet and the sidecars meet it: over a unix socket.
package csiproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// RepoRoot is the module root, found from this file's location.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// binDirPrefix names the directory of a test process's binary, after the
// process ID: nothing removes it when the process ends (a package has no
// hook for that), so the next build removes those of processes that ended.
const binDirPrefix = "poolcsi-bin.pid-"

func cleanStaleBinaries() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), binDirPrefix+"*"))
	for _, d := range dirs {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), binDirPrefix))
		if err != nil || pid <= 0 || syscall.Kill(pid, 0) == nil || !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			continue // not ours, or its process is still there
		}
		os.RemoveAll(d)
	}
}

// Binary builds cmd/poolcsi once per test process and returns its path.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		cleanStaleBinaries()
		dir := filepath.Join(os.TempDir(), binDirPrefix+strconv.Itoa(os.Getpid()))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "poolcsi")
		cmd := exec.Command("go", "build", "-o", binPath, "./cmd/poolcsi")
		cmd.Dir = RepoRoot()
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %w\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// Driver is a running `poolcsi serve`.
type Driver struct {
	Endpoint string // unix:///…
	Socket   string
	Conn     *grpc.ClientConn
	opts     Options
	stateDir string // the node plugin's --state-dir, kept across Restart
	spawn    bool   // launch returns without waiting (Spawn)
	cmd      *exec.Cmd
	log      *bytes.Buffer
	logMu    sync.Mutex
	done     chan struct{}

	callsMu sync.Mutex
	calls   []Call
}

// Call is one RPC the test made through the driver's connection.
type Call struct {
	Method   string
	Elapsed  time.Duration
	Deadline time.Duration // the call's deadline, from its start
	Err      error
}

// Unanswered reports whether the driver did not answer the call within its
// deadline: the client gave up when the deadline came. The driver answers
// DEADLINE_EXCEEDED itself, with the reason, a little before the deadline.
func (c Call) Unanswered() bool {
	code := status.Code(c.Err)
	return c.Deadline > 0 && c.Elapsed >= c.Deadline && (code == codes.DeadlineExceeded || code == codes.Canceled)
}

// Options for Start.
type Options struct {
	NodeID string
	Pools  []string // NAME=PATH[,shared]
	Args   []string // extra flags
	// SidecarDeadlines gives every call without a deadline the one the chart's
	// sidecars and probes give it (SidecarTimeout, ProbeTimeout for Probe),
	// and fails the test if any call of the test was not answered within its
	// deadline (Call.Unanswered).
	SidecarDeadlines bool
	// Binary is the poolcsi binary to run ("": cmd/poolcsi built from this
	// tree): a benchmark's baseline, built from another commit.
	Binary string
	// Verbosity is the driver's klog -v (0: 5, which logs every call's request
	// and answer, for the tests' failures). A benchmark that times the driver as
	// operators run it sets ChartLogLevel.
	Verbosity int
}

// ChartLogLevel is the chart's default logLevel (deploy/helm/poolcsi/values.yaml):
// at it a call's request and answer are not logged; at the tests' 5 each is
// formatted, secrets stripped, a cost operators do not pay (docs/performance.md).
const ChartLogLevel = 2

// The deadlines of the chart's sidecars (--timeout=60s) and of its probes
// (--probe-timeout=3s), which SidecarDeadlines puts on calls.
const (
	SidecarTimeout = 60 * time.Second
	ProbeTimeout   = 3 * time.Second
)

// Start runs `poolcsi serve` and waits until Probe answers. The process is stopped
// in t.Cleanup, and its log is printed when the test failed.
func Start(t testing.TB, o Options) *Driver {
	t.Helper()
	sockDir, err := os.MkdirTemp("", "poolcsi-sock-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	sock := filepath.Join(sockDir, "csi.sock")
	if o.NodeID == "" {
		o.NodeID = "node-1"
	}
	d := &Driver{Endpoint: "unix://" + sock, Socket: sock, log: &bytes.Buffer{}, opts: o}
	// Each driver keeps its node-local records (--state-dir) apart from every
	// other test's, and from the machine's own /var/lib/poolcsi/state; a
	// Restart finds them again, as a restarted node plugin does on its node.
	if !slices.ContainsFunc(o.Args, func(a string) bool { return strings.HasPrefix(a, "--state-dir") }) {
		d.stateDir = filepath.Join(sockDir, "state")
	}
	conn, err := grpc.NewClient(d.Endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(d.intercept))
	if err != nil {
		t.Fatal(err)
	}
	d.Conn = conn
	// Registered before the process starts, so they run after every cleanup a
	// test registers later (which may still need the driver).
	t.Cleanup(func() {
		conn.Close()
		d.Stop()
		if o.SidecarDeadlines {
			for _, c := range d.Calls() {
				if c.Unanswered() {
					t.Errorf("%s: %s was not answered within its deadline of %s: %v", o.NodeID, c.Method, c.Deadline, c.Err)
				}
			}
		}
		// POOLCSI_DEBUG_LOG=1 shows the log of a passing test too: a leak or a
		// wrong turn that fails no assertion is found there.
		if t.Failed() || os.Getenv("POOLCSI_DEBUG_LOG") != "" {
			t.Logf("poolcsi log (%s):\n%s", o.NodeID, d.Log())
		}
	})
	d.launch(t)
	return d
}

// intercept records every call the test makes (not the readiness probes of
// launch) and gives it the sidecars' deadline if asked to.
func (d *Driver) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if ctx.Value(launchProbe{}) != nil {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	if _, ok := ctx.Deadline(); !ok && d.opts.SidecarDeadlines {
		timeout := SidecarTimeout
		if strings.HasSuffix(method, "/Probe") {
			timeout = ProbeTimeout
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	start := time.Now()
	var deadline time.Duration
	if dl, ok := ctx.Deadline(); ok {
		deadline = dl.Sub(start)
	}
	err := invoker(ctx, method, req, reply, cc, opts...)
	d.callsMu.Lock()
	d.calls = append(d.calls, Call{Method: method[strings.LastIndex(method, "/")+1:], Elapsed: time.Since(start), Deadline: deadline, Err: err})
	d.callsMu.Unlock()
	return err
}

type launchProbe struct{}

// Calls returns the calls made so far, in the order they ended.
func (d *Driver) Calls() []Call {
	d.callsMu.Lock()
	defer d.callsMu.Unlock()
	return append([]Call(nil), d.calls...)
}

// LogSlowCalls logs, when the test ends, every call that took longer than
// threshold: where a slow shared filesystem shows.
func (d *Driver) LogSlowCalls(t testing.TB, threshold time.Duration) {
	t.Cleanup(func() {
		for _, c := range d.Calls() {
			if c.Elapsed > threshold {
				t.Logf("%s: slow call %s: %s (deadline %s, err %v)", d.opts.NodeID, c.Method, c.Elapsed.Round(time.Millisecond), c.Deadline, c.Err)
			}
		}
	})
}

// Restart stops the driver process and starts a new one on the same socket and
// pools, as kubelet does after a plugin crash or upgrade.
func (d *Driver) Restart(t testing.TB) {
	t.Helper()
	d.Stop()
	d.launch(t)
}

func (d *Driver) launch(t testing.TB) {
	t.Helper()
	v := d.opts.Verbosity
	if v == 0 {
		v = 5
	}
	args := []string{"serve", "--endpoint", d.Endpoint, "--node-id", d.opts.NodeID, "-v", strconv.Itoa(v)}
	for _, p := range d.opts.Pools {
		args = append(args, "--pool", p)
	}
	args = append(args, d.opts.Args...)
	if !slices.ContainsFunc(d.opts.Args, func(a string) bool { return strings.HasPrefix(a, "--allowed-path-prefix") }) {
		// The tests' staging and target paths are in the temp directory.
		args = append(args, "--allowed-path-prefix", os.TempDir())
	}
	if d.stateDir != "" {
		args = append(args, "--state-dir", d.stateDir)
	}
	bin := d.opts.Binary
	if bin == "" {
		bin = Binary(t)
	}
	d.cmd = exec.Command(bin, args...)
	// If the test process dies without its cleanups (os.Exit, a panic, a
	// killed go test), the driver goes with it instead of running on.
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	d.cmd.Stdout = &lockedWriter{mu: &d.logMu, w: d.log}
	d.cmd.Stderr = d.cmd.Stdout
	done := make(chan struct{})
	d.done = done
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.cmd.Wait(); close(done) }()
	d.WaitReady(t)
}

// Spawn starts the driver again after Kill or Stop without waiting until it
// is ready: a start that hangs (on a pool that does not answer) is what a
// test may want to see. WaitReady waits for it.
func (d *Driver) Spawn(t testing.TB) {
	t.Helper()
	d.spawn = true
	defer func() { d.spawn = false }()
	d.launch(t)
}

// WaitReady waits until the driver answers Probe, 30 s at most.
func (d *Driver) WaitReady(t testing.TB) {
	t.Helper()
	if d.spawn {
		return
	}
	done := d.done
	deadline := time.Now().Add(30 * time.Second)
	// Probe only once the socket is there: a dial that fails puts the
	// connection into gRPC's reconnect backoff (a second at first).
	for _, err := os.Stat(d.Socket); err != nil && time.Now().Before(deadline); _, err = os.Stat(d.Socket) {
		select {
		case <-done:
			t.Fatalf("poolcsi exited before it was ready: %v\n%s", d.cmd.ProcessState, d.Log())
		case <-time.After(5 * time.Millisecond):
		}
	}
	for {
		ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), launchProbe{}, true), time.Second)
		_, err := csi.NewIdentityClient(d.Conn).Probe(ctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
		cancel()
		if err == nil {
			return
		}
		select {
		case <-done:
			t.Fatalf("poolcsi exited before it was ready: %v\n%s", d.cmd.ProcessState, d.Log())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("poolcsi not ready after 30s: %v\n%s", err, d.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop ends the driver with SIGTERM (SIGKILL after 10 s) and waits for it.
func (d *Driver) Stop() {
	if d.cmd == nil {
		return
	}
	select {
	case <-d.done:
		return
	default:
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(10 * time.Second):
		d.cmd.Process.Kill()
		<-d.done
	}
}

// Kill ends the driver with SIGKILL at once, as a crash or an OOM kill does,
// and waits for it: no cleanup of its own runs.
func (d *Driver) Kill() {
	if d.cmd == nil {
		return
	}
	select {
	case <-d.done:
		return
	default:
	}
	_ = d.cmd.Process.Kill()
	<-d.done
}

// Launch starts the driver again after Kill or Stop, on the same socket and
// pools, and waits until it is ready.
func (d *Driver) Launch(t testing.TB) {
	t.Helper()
	d.launch(t)
}

// Log returns what the driver printed so far.
func (d *Driver) Log() string {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	return d.log.String()
}

// Controller, Node and Identity are clients over the driver's socket.
// Pid is the driver process's, while it runs.
func (d *Driver) Pid() int { return d.cmd.Process.Pid }

func (d *Driver) Controller() csi.ControllerClient { return csi.NewControllerClient(d.Conn) }
func (d *Driver) Node() csi.NodeClient             { return csi.NewNodeClient(d.Conn) }
func (d *Driver) Identity() csi.IdentityClient     { return csi.NewIdentityClient(d.Conn) }

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
