// Package poolmount mounts a shared pool's filesystem (an NFS export, CephFS, …)
// at the pool path when the config file's mount stanza asks for it. It keeps
// mounts out of internal/pool, which only reads and writes the pool's files.
package poolmount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/moby/sys/mountinfo"
	"k8s.io/klog/v2"
	mountutils "k8s.io/mount-utils"

	"github.com/poolcsi/poolcsi/internal/runner"
)

// DefaultTimeout bounds one mount attempt. An unreachable NFS server otherwise
// holds mount(8) for minutes.
const DefaultTimeout = 30 * time.Second

// Spec is a pool's mount stanza:
//
//	mount:
//	  type: nfs
//	  source: nfs.example.com:/export/poolcsi
//	  options: [nfsvers=4.1, hard]
//	  timeout: 30s
type Spec struct {
	Type    string   `json:"type,omitempty"`
	Source  string   `json:"source"`
	Options []string `json:"options,omitempty"`
	Timeout string   `json:"timeout,omitempty"`
	// Sensitive are options from secrets (a share's): passed to mount(8)
	// after Options, masked in every log line (mount-utils'
	// MakeMountArgsSensitive) and scrubbed from every error. Never in a file.
	Sensitive []string `json:"-"`
	// command, when set, is the program and argv that mount the stanza at
	// target instead of mount(8), and the argv as logs show it: a share
	// type whose helper cannot be trusted with request input (fuse.ceph).
	command func(target string) (prog string, args []string, logged string)
}

// Validate checks the stanza before anything is run.
func (s Spec) Validate() error {
	if s.Source == "" {
		return errors.New("mount: source is required")
	}
	if s.Type == "" && !s.isBind() {
		return errors.New("mount: type is required (or options: [bind])")
	}
	for _, o := range s.Options {
		if o == "" || strings.ContainsAny(o, ",\x00") {
			return fmt.Errorf("mount: option %q must be one option without commas", o)
		}
	}
	for i, o := range s.Sensitive {
		if o == "" || strings.ContainsAny(o, ",\x00") {
			return fmt.Errorf("mount: secret option %d must be one option without commas", i+1)
		}
	}
	if _, err := s.timeout(); err != nil {
		return err
	}
	return nil
}

func (s Spec) isBind() bool {
	for _, o := range s.Options {
		if o == "bind" || o == "rbind" {
			return true
		}
	}
	return false
}

func (s Spec) timeout() (time.Duration, error) {
	if s.Timeout == "" {
		return DefaultTimeout, nil
	}
	d, err := time.ParseDuration(s.Timeout)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("mount: timeout %q: want a positive duration such as 30s", s.Timeout)
	}
	return d, nil
}

// Args is the mount(8) command line that mounts the stanza at target, built by
// mount-utils exactly as kubelet builds its own.
func (s Spec) Args(target string) []string {
	args, _ := s.args(target)
	return args
}

// args is Args and the same command line for logs, the secret options masked.
func (s Spec) args(target string) ([]string, string) {
	return mountutils.MakeMountArgsSensitive(s.Source, target, s.Type, s.Options, s.Sensitive)
}

// scrub removes the secret options from text (a mount helper's output may
// repeat its arguments), whole and by value.
func (s Spec) scrub(text string) string {
	for _, o := range s.Sensitive {
		text = strings.ReplaceAll(text, o, "<masked>")
		if _, v, ok := strings.Cut(o, "="); ok && len(v) >= 4 {
			text = strings.ReplaceAll(text, v, "<masked>")
		}
	}
	return text
}

// Mounter keeps one pool's mount.
type Mounter struct {
	Pool string
	Path string
	Spec Spec
	// Command is the mount program; tests replace it to produce a mount that hangs.
	Command string

	mu       sync.Mutex
	inFlight bool // a mount process is still running (maybe stuck in the kernel)
	lastErr  error
}

// New checks the stanza and returns a Mounter for it.
func New(pool, path string, spec Spec) (*Mounter, error) {
	if err := spec.Validate(); err != nil {
		return nil, fmt.Errorf("pool %s: %w", pool, err)
	}
	return &Mounter{Pool: pool, Path: path, Spec: spec, Command: "mount"}, nil
}

// Ensure mounts the pool unless something is mounted there already. It returns
// after the stanza's timeout at the latest. A timed-out mount(8) is killed, but a
// mount stuck in the kernel may outlive the kill: no new attempt starts until it
// has ended, so stuck attempts never pile up (csi-driver-nfs #1271).
func (m *Mounter) Ensure(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	err := m.ensure(ctx)
	m.lastErr = err
	return err
}

func (m *Mounter) ensure(ctx context.Context) error {
	if mounted, err := mountinfo.Mounted(m.Path); err == nil && mounted {
		return nil
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("pool %s: inspect %s: %w", m.Pool, m.Path, err)
	}
	if m.inFlight {
		return fmt.Errorf("pool %s: an earlier mount of %s at %s has not ended yet", m.Pool, m.Spec.Source, m.Path)
	}
	if err := os.MkdirAll(m.Path, 0o750); err != nil {
		return fmt.Errorf("pool %s: create mount point: %w", m.Pool, err)
	}
	timeout, _ := m.Spec.timeout()
	prog := m.Command
	args, logArgs := m.Spec.args(m.Path)
	if m.Spec.command != nil {
		prog, args, logArgs = m.Spec.command(m.Path)
	}
	cmd := exec.Command(prog, args...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pool %s: run %s: %w", m.Pool, prog, err)
	}
	m.inFlight = true
	done := make(chan error, 1)
	go func() {
		err := cmd.Wait()
		m.mu.Lock()
		m.inFlight = false
		m.mu.Unlock()
		done <- err
	}()
	log := klog.FromContext(ctx)
	log.Info("Mounting pool", "pool", m.Pool, "command", prog+" "+strings.TrimSpace(logArgs), "timeout", timeout)
	t := time.NewTimer(timeout)
	defer t.Stop()
	// The waiting goroutine takes m.mu to clear inFlight, so release it while waiting.
	m.mu.Unlock()
	defer m.mu.Lock()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("pool %s: mount %s at %s: %w: %s", m.Pool, m.Spec.Source, m.Path, err, m.Spec.scrub(strings.TrimSpace(out.String())))
		}
		log.Info("Mounted pool", "pool", m.Pool, "path", m.Path)
		return nil
	case <-t.C:
		_ = cmd.Process.Kill()
		return fmt.Errorf("pool %s: mount %s at %s did not finish within %s", m.Pool, m.Spec.Source, m.Path, timeout)
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		return fmt.Errorf("pool %s: mount %s: %w", m.Pool, m.Spec.Source, ctx.Err())
	}
}

// Ready is a readiness check for Probe: nil once the pool is mounted, otherwise
// why not (the last attempt's error).
func (m *Mounter) Ready() error {
	if mounted, err := mountinfo.Mounted(m.Path); err == nil && mounted {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.lastErr != nil {
		return m.lastErr
	}
	return fmt.Errorf("pool %s: %s is not mounted yet", m.Pool, m.Path)
}

// Keep retries Ensure every interval, the first one interval after the
// start, until its context ends, so a pool whose server was down at
// start-up is mounted when it comes back, without a driver restart.
func (m *Mounter) Keep(interval time.Duration) runner.Runner {
	return runner.Every{Interval: interval, F: func(ctx context.Context) {
		if err := m.Ensure(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Pool still not mounted", "pool", m.Pool)
		}
	}}
}

// busy tells whether a mount process of this mounter is still running.
func (m *Mounter) busy() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.inFlight
}

// setSpec replaces the stanza (a share's options come with each request).
func (m *Mounter) setSpec(s Spec) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.Spec = s
}
