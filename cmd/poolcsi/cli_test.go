package main

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"testing"

	"github.com/go-logr/logr/funcr"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// runCLI is run with its output captured.
func runCLI(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestHelpExitsZero(t *testing.T) {
	tests := []struct {
		args []string
		want string // in stdout; stderr stays empty
	}{
		{[]string{"-h"}, "Usage:"},
		{[]string{"--help"}, "Usage:"},
		{[]string{"help"}, "Usage:"},
		{[]string{"serve", "-h"}, "Usage: poolcsi serve"},
		{[]string{"serve", "--help"}, "Usage: poolcsi serve"},
		{[]string{"demo", "-h"}, "Usage: poolcsi demo"},
		{[]string{"pool", "-h"}, "poolcsi pool list"},
		{[]string{"pool", "list", "-h"}, "Usage: poolcsi pool list"},
		{[]string{"pool", "check", "--help"}, "Usage: poolcsi pool check"},
		{[]string{"pool", "check", "-h"}, "-repair"},
		{[]string{"pool", "unfence", "-h"}, "Usage: poolcsi pool unfence"},
		{[]string{"pool", "init", "-h"}, "Usage: poolcsi pool init"},
		{[]string{"version", "-h"}, "Usage: poolcsi version"},
		{[]string{"call", "-h"}, "Usage: poolcsi call"},
		{[]string{"status", "-h"}, "Usage: poolcsi status"},
		{[]string{"status", "--help"}, "Exit status: 0 all is well"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			code, out, errOut := runCLI(tt.args...)
			if code != 0 {
				t.Fatalf("exit %d, want 0; stderr:\n%s", code, errOut)
			}
			if !strings.Contains(out, tt.want) {
				t.Fatalf("stdout lacks %q:\n%s", tt.want, out)
			}
			if errOut != "" {
				t.Errorf("-h wrote to stderr (the usage asked for goes to stdout, for every command):\n%s", errOut)
			}
		})
	}
}

func TestUsageErrorsExitNonZero(t *testing.T) {
	tests := []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "Usage:"},
		{[]string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{[]string{"serve", "--no-such-flag"}, 1, "flag provided but not defined"},
		{[]string{"serve", "extra"}, 1, "unexpected arguments extra"},
		{[]string{"serve", "--mode=both"}, 1, "--mode"},
		{[]string{"version", "extra"}, 1, "unexpected arguments"},
		{[]string{"status", "extra"}, 1, "unexpected arguments extra"},
		{[]string{"status", "-o", "yaml"}, 1, `-o "yaml": want text or json`},
		{[]string{"pool"}, 1, "want a subcommand"},
		{[]string{"pool", "list"}, 1, "--path is required"},
		{[]string{"pool", "frob"}, 1, `unknown subcommand "frob"`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			code, out, errOut := runCLI(tt.args...)
			if code != tt.code || !strings.Contains(out+errOut, tt.want) {
				t.Fatalf("exit %d, want %d with %q; output:\n%s%s", code, tt.code, tt.want, out, errOut)
			}
		})
	}
}

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}} {
		code, out, errOut := runCLI(args...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, errOut)
		}
		for _, want := range []string{"poolcsi ", "commit:", "go:      " + runtime.Version(), "built:"} {
			if !strings.Contains(out, want) {
				t.Errorf("%v: output lacks %q:\n%s", args, want, out)
			}
		}
	}
}

func TestReadVersionInfo(t *testing.T) {
	vcs := &debug.BuildInfo{Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
		{Key: "vcs.time", Value: "2026-01-02T03:04:05Z"},
		{Key: "vcs.modified", Value: "true"},
	}}
	tests := []struct {
		name                  string
		commit, date          string // -ldflags
		bi                    *debug.BuildInfo
		wantCommit, wantBuilt string
	}{
		{"nothing known", "", "", nil, "", ""},
		{"build info only", "", "", vcs, "0123456789abcdef0123456789abcdef01234567 (modified)", "2026-01-02T03:04:05Z (commit time)"},
		{"ldflags win", "feedface", "2026-03-04T00:00:00Z", vcs, "feedface", "2026-03-04T00:00:00Z"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			oldCommit, oldDate := commit, buildDate
			t.Cleanup(func() { commit, buildDate = oldCommit, oldDate })
			commit, buildDate = tt.commit, tt.date
			vi := readVersionInfo(tt.bi)
			if vi.Commit != tt.wantCommit || vi.BuildDate != tt.wantBuilt || vi.GoVersion != runtime.Version() {
				t.Fatalf("got %+v, want commit %q, built %q", vi, tt.wantCommit, tt.wantBuilt)
			}
		})
	}
}

// serve -h lists serve's own flags first and klog's apart, under their heading.
func TestServeHelpKeepsKlogApart(t *testing.T) {
	_, help, _ := runCLI("serve", "-h") // the usage asked for goes to stdout
	heading := strings.Index(help, "Logging flags (klog):")
	if heading < 0 {
		t.Fatalf("no klog heading:\n%s", help)
	}
	own, logging := help[:heading], help[heading:]
	for _, f := range []string{"-endpoint", "-pool NAME=PATH[,OPTION...]", "-lease-duration", "-memory-limit-mib"} {
		if !strings.Contains(own, "  "+f) {
			t.Errorf("serve's flag %s not listed before the klog heading", f)
		}
	}
	for _, f := range []string{"-v value", "-vmodule", "-logtostderr"} {
		if strings.Contains(own, "  "+f) || !strings.Contains(logging, "  "+f) {
			t.Errorf("klog's flag %s not listed under its own heading only", f)
		}
	}
}

func TestServeAcceptsKlogFlags(t *testing.T) {
	o := newServeOptions()
	var errOut bytes.Buffer
	if err := parseFlags(serveFlags(o, &errOut), []string{"-v=3", "--endpoint=unix:///x.sock"}); err != nil {
		t.Fatalf("parse: %v\n%s", err, errOut.String())
	}
	if o.Endpoint != "unix:///x.sock" {
		t.Fatalf("endpoint %q", o.Endpoint)
	}
}

func TestSizeEnforced(t *testing.T) {
	tests := []struct {
		name string
		v    pool.Volume
		want string
	}{
		{"image", pool.Volume{Layout: pool.LayoutImage}, "yes"},
		{"dir with a qgroup", pool.Volume{Layout: pool.LayoutDir, Quota: &pool.DirQuota{Kind: "btrfs-qgroup", Enforced: true}}, "yes (btrfs-qgroup)"},
		{"dir without quota", pool.Volume{Layout: pool.LayoutDir, Quota: &pool.DirQuota{Kind: "none", Reason: "ext4 without project quota"}}, "NO"},
		{"dir from before quota records", pool.Volume{Layout: pool.LayoutDir}, "NO"},
	}
	for _, tt := range tests {
		if got := sizeEnforced(&tt.v); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestAttributes(t *testing.T) {
	tests := []struct {
		name string
		v    pool.Volume
		want string
	}{
		{"none", pool.Volume{Layout: pool.LayoutImage}, ""},
		{"every key", pool.Volume{Layout: pool.LayoutImage, Preallocate: true, IOLimits: pool.IOLimits{
			ReadBytesPerSecond: 40 << 20, WriteBytesPerSecond: 20 << 20, ReadIOPS: 2000, WriteIOPS: 1000}},
			"rbps=40Mi,wbps=20Mi,riops=2000,wiops=1000,preallocated"},
		{"odd bytes", pool.Volume{Layout: pool.LayoutImage, IOLimits: pool.IOLimits{WriteBytesPerSecond: 1000}}, "wbps=1k"},
	}
	for _, tt := range tests {
		if got := attributes(&tt.v); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestPoolListEmptyPool(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "p")
	if _, err := pool.Initialise(pool.Config{Name: "p", Path: dir}); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI("pool", "list", "--path", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if !strings.Contains(out, "SIZE ENFORCED") || !strings.Contains(out, "iB free") || !strings.Contains(out, "0 volumes") {
		t.Fatalf("pool list:\n%s", out)
	}
}

func TestLogStop(t *testing.T) {
	sigCtx, cancel := context.WithCancelCause(context.Background())
	cancel(errors.New("interrupt signal received"))
	tests := []struct {
		name string
		ctx  context.Context
		err  error
		want string
	}{
		{"signal", sigCtx, nil, `"cause"="interrupt signal received"`},
		{"error", context.Background(), errors.New("listen unix /csi.sock: address in use"), `"error"="listen unix /csi.sock: address in use"`},
		{"neither", context.Background(), nil, `"cause"="the CSI server ended"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var lines []string
			logger := funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{})
			logStop(tt.ctx, logger, tt.err)
			if len(lines) != 1 || !strings.Contains(lines[0], "poolcsi serve stopped") || !strings.Contains(lines[0], tt.want) {
				t.Fatalf("logged %q, want one line with %s", lines, tt.want)
			}
		})
	}
}

// signal.NotifyContext's cause names the signal: the stop line says which.
func TestLogStopNamesTheSignal(t *testing.T) {
	ctx, stop := signalContext()
	defer stop()
	if err := syscall.Kill(syscall.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-ctx.Done()
	var line string
	logStop(ctx, funcr.New(func(_, args string) { line = args }, funcr.Options{}), nil)
	if !strings.Contains(line, "terminated") {
		t.Fatalf("stop line %q does not name SIGTERM", line)
	}
}
