package cluster

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"testing"
	"time"
)

// RunProgram runs body, a command's work written against this package (which takes a
// testing.TB everywhere), as go test would run a test: t.Fatal and t.Skip end body, t.Error
// marks the run failed, and every cleanup body registered runs afterwards, last first,
// even after a failure or a panic; t.Context is cancelled just before them. Log lines go to
// out with the time of day. It returns whether the run failed and whether it was skipped.
//
// It is what lets the conformance runner be a program (cmd/conformance) while the
// environment it starts stays the one the tests start.
func RunProgram(name string, out io.Writer, body func(t testing.TB)) (failed, skipped bool) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &programTB{name: name, out: out, ctx: ctx}
	p.guard(func() { body(p) })
	cancel()
	for {
		p.mu.Lock()
		n := len(p.cleanups)
		var fn func()
		if n > 0 {
			fn, p.cleanups = p.cleanups[n-1], p.cleanups[:n-1]
		}
		p.mu.Unlock()
		if fn == nil {
			break
		}
		p.guard(fn)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failed, p.skipped
}

// programTB is the testing.TB of RunProgram. The embedded TB is nil: a method of
// testing.TB not implemented here panics, which guard reports as a failure.
type programTB struct {
	testing.TB
	name string
	out  io.Writer
	ctx  context.Context

	mu       sync.Mutex
	failed   bool
	skipped  bool
	cleanups []func()
	tmpRoot  string
	tmpSeq   int
}

// guard runs fn on a goroutine of its own, as the testing package runs a test and each
// cleanup: FailNow and SkipNow end that goroutine (runtime.Goexit), and a panic is
// reported as a failure instead of ending the program before its cleanups.
func (p *programTB) guard(fn func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			if r := recover(); r != nil {
				p.Errorf("panic: %v\n%s", r, debug.Stack())
			}
		}()
		fn()
	}()
	<-done
}

func (p *programTB) Helper()      {}
func (p *programTB) Name() string { return p.name }

func (p *programTB) Context() context.Context { return p.ctx }

func (p *programTB) Log(args ...any) { p.logLine(fmt.Sprintln(args...)) }

func (p *programTB) Logf(format string, args ...any) { p.logLine(fmt.Sprintf(format, args...)) }

func (p *programTB) logLine(s string) {
	if s == "" || s[len(s)-1] != '\n' {
		s += "\n"
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.out, "%s %s", time.Now().Format("15:04:05"), s)
}

func (p *programTB) Fail() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failed = true
}

func (p *programTB) Failed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failed
}

func (p *programTB) FailNow() {
	p.Fail()
	runtime.Goexit()
}

func (p *programTB) Error(args ...any) { p.Log(args...); p.Fail() }

func (p *programTB) Errorf(format string, args ...any) { p.Logf(format, args...); p.Fail() }

func (p *programTB) Fatal(args ...any) { p.Log(args...); p.FailNow() }

func (p *programTB) Fatalf(format string, args ...any) { p.Logf(format, args...); p.FailNow() }

func (p *programTB) SkipNow() {
	p.mu.Lock()
	p.skipped = true
	p.mu.Unlock()
	runtime.Goexit()
}

func (p *programTB) Skip(args ...any) { p.Log(args...); p.SkipNow() }

func (p *programTB) Skipf(format string, args ...any) { p.Logf(format, args...); p.SkipNow() }

func (p *programTB) Skipped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.skipped
}

func (p *programTB) Cleanup(fn func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cleanups = append(p.cleanups, fn)
}

// TempDir is a new directory under one root per run, as t.TempDir's are under one per
// test (the environment lock records that root): removed, with the root, after every
// cleanup registered after the first call.
func (p *programTB) TempDir() string {
	p.mu.Lock()
	first := p.tmpRoot == ""
	if first {
		root, err := os.MkdirTemp("", p.name)
		if err != nil {
			p.mu.Unlock()
			p.Fatalf("TempDir: %v", err)
		}
		p.tmpRoot = root
		p.cleanups = append(p.cleanups, func() {
			if err := os.RemoveAll(root); err != nil {
				p.Errorf("TempDir RemoveAll cleanup: %v", err)
			}
		})
	}
	p.tmpSeq++
	dir := filepath.Join(p.tmpRoot, fmt.Sprintf("%03d", p.tmpSeq))
	p.mu.Unlock()
	if err := os.Mkdir(dir, 0o777); err != nil {
		p.Fatalf("TempDir: %v", err)
	}
	return dir
}

// Setenv sets an environment variable until the run ends.
func (p *programTB) Setenv(key, value string) {
	old, had := os.LookupEnv(key)
	if err := os.Setenv(key, value); err != nil {
		p.Fatalf("Setenv %s: %v", key, err)
	}
	p.Cleanup(func() {
		if had {
			_ = os.Setenv(key, old)
		} else {
			_ = os.Unsetenv(key)
		}
	})
}

// Chdir changes the working directory until the run ends.
func (p *programTB) Chdir(dir string) {
	old, err := os.Getwd()
	if err != nil {
		p.Fatalf("Chdir: %v", err)
	}
	if err := os.Chdir(dir); err != nil {
		p.Fatalf("Chdir: %v", err)
	}
	p.Cleanup(func() { _ = os.Chdir(old) })
}

// Attr logs an attribute, as go test -v prints one.
func (p *programTB) Attr(key, value string) { p.Logf("=== ATTR %s %s", key, strconv.Quote(value)) }

// Output is where the log lines go.
func (p *programTB) Output() io.Writer { return p.out }

// ArtifactDir is a directory for what the run leaves to read; like TempDir's, it goes
// when the run ends.
func (p *programTB) ArtifactDir() string { return p.TempDir() }
