package main

import (
	"context"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/internal/driver"
)

func TestServeOptionsValidate(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string // a part of the error; empty: valid
	}{
		{name: "defaults"},
		{name: "every mode", args: []string{"--mode=controller"}},
		{name: "node mode", args: []string{"--mode=node"}},
		{name: "zero TTL and events off are valid", args: []string{"--stats-health-ttl=0", "--pvc-events-interval=0", "--memory-limit-mib=0"}},
		{name: "threshold 100 %", args: []string{"--pool-full-threshold=100", "--volume-full-threshold=100"}},
		{name: "lease renewed three times per duration", args: []string{"--lease-duration=15s", "--lease-renew-interval=5s", "--lease-margin=5s"}},

		{name: "bad mode", args: []string{"--mode=both"}, want: "--mode"},
		{name: "empty endpoint", args: []string{"--endpoint="}, want: "--endpoint"},
		{name: "empty driver name", args: []string{"--driver-name="}, want: "--driver-name"},
		{name: "driver name leaving its directory", args: []string{"--driver-name=../../x"}, want: "--driver-name: driver name \"../../x\""},
		{name: "driver name with a slash", args: []string{"--driver-name=a/b"}, want: "--driver-name"},
		{name: "driver name too long", args: []string{"--driver-name=" + strings.Repeat("a", 64)}, want: "--driver-name"},
		{name: "another driver name", args: []string{"--driver-name=csi.example-1.com"}},
		{name: "pool threshold zero", args: []string{"--pool-full-threshold=0"}, want: "pool full threshold"},
		{name: "pool threshold over 100", args: []string{"--pool-full-threshold=101"}, want: "pool full threshold"},
		{name: "volume threshold negative", args: []string{"--volume-full-threshold=-5"}, want: "volume full threshold"},
		{name: "mount retry zero", args: []string{"--mount-retry=0"}, want: "--mount-retry"},
		{name: "mount retry negative", args: []string{"--mount-retry=-1s"}, want: "--mount-retry"},
		{name: "negative stats TTL", args: []string{"--stats-health-ttl=-1s"}, want: "--stats-health-ttl"},
		{name: "negative events interval", args: []string{"--pvc-events-interval=-1m"}, want: "--pvc-events-interval"},
		{name: "negative share mount timeout", args: []string{"--share-mount-timeout=-1s"}, want: "--share-mount-timeout"},
		{name: "negative max volumes", args: []string{"--max-volumes-per-node=-1"}, want: "--max-volumes-per-node"},
		{name: "negative memory limit", args: []string{"--memory-limit-mib=-1"}, want: "--memory-limit-mib"},
		{name: "renew interval equal to the lease", args: []string{"--lease-duration=5s", "--lease-renew-interval=5s"}, want: "three renewal intervals"},
		{name: "renew interval above the lease", args: []string{"--lease-duration=5s", "--lease-renew-interval=10s"}, want: "three renewal intervals"},
		{name: "zero renew interval", args: []string{"--lease-renew-interval=0"}, want: "must be positive"},
		{name: "negative lease duration", args: []string{"--lease-duration=-60s"}, want: "must be positive"},
		{name: "margin below an interval", args: []string{"--lease-margin=1s"}, want: "lease margin"},
		{name: "lease duration at the bound", args: []string{"--lease-duration=10m"}},
		{name: "lease duration over the bound", args: []string{"--lease-duration=11m"}, want: "at most 10m0s"},
		{name: "lease margin over the bound", args: []string{"--lease-margin=11m"}, want: "at most 10m0s"},
		{name: "freeze schedule", args: []string{"--freeze-poll-interval=100ms", "--freeze-max-hold=5s", "--freeze-ack-timeout=1s"}},
		{name: "zero freeze poll interval", args: []string{"--freeze-poll-interval=0"}, want: "--freeze-poll-interval"},
		{name: "freeze ack timeout below two polls", args: []string{"--freeze-poll-interval=1s", "--freeze-ack-timeout=1s"}, want: "two poll intervals"},
		{name: "freeze max hold below two polls", args: []string{"--freeze-poll-interval=1s", "--freeze-max-hold=1s"}, want: "two poll intervals"},
		{name: "every error at once", args: []string{"--mode=x", "--mount-retry=0"}, want: "--mount-retry"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := parseServeFlags(t, tt.args...)
			err := o.Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("Validate: %v, want no error", err)
			case tt.want != "" && err == nil:
				t.Fatalf("Validate: no error, want one with %q", tt.want)
			case tt.want != "" && !strings.Contains(err.Error(), tt.want):
				t.Fatalf("Validate: %v, want an error with %q", err, tt.want)
			}
		})
	}
}

// parseServeFlags is newServeOptions with args parsed over it.
func parseServeFlags(t *testing.T, args ...string) *serveOptions {
	t.Helper()
	o := newServeOptions()
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse %q: %v", args, err)
	}
	return o
}

// The defaults are those the flags had before serveOptions: a change to one
// is a change of behaviour, to be made on purpose.
func TestServeOptionsDefaults(t *testing.T) {
	o := parseServeFlags(t)
	if o.Endpoint != "unix:///csi/csi.sock" || o.DriverName != "poolcsi.io" || o.Mode != "all" ||
		o.PathPrefix != "/var/lib/kubelet" || o.MountRetry != 30*time.Second || o.StatsHealthTTL != 5*time.Second ||
		o.PoolFullPercent != 90 || o.VolumeFullPercent != 90 || o.MemoryLimitMiB != 20 ||
		o.Lease.Duration != time.Minute || o.Lease.Interval != 5*time.Second || o.Lease.Margin != 30*time.Second {
		t.Fatalf("defaults changed: %+v", o)
	}
	o = parseServeFlags(t, "--pool", "a=/srv/a,shared", "--pool", "b=/srv/b")
	if len(o.Pools) != 2 || !o.Pools[0].Shared || o.Pools[1].Shared || o.Pools[1].Path != "/srv/b" {
		t.Fatalf("--pool twice: %+v", o.Pools)
	}
}

// TestServeRefusesNodeWithoutStateDir: a node plugin (mode node or all) with
// a shared pool, from a flag or the config file, or with share support, does
// not start with --state-dir empty: its stage records would live in memory,
// and a restart would leave its self-fence nothing to fence. A controller, or
// a node with local pools only, may.
func TestServeRefusesNodeWithoutStateDir(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("pools:\n- name: fromfile\n  path: "+filepath.Join(dir, "f")+"\n  shared: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	shared := "--pool=s=" + filepath.Join(dir, "s") + ",shared"
	local := "--pool=l=" + filepath.Join(dir, "l")
	const noShares = "--share-dir="
	tests := []struct {
		name string
		args []string
		want string // a part of the error; empty: allowed
	}{
		{name: "node, shared pool", args: []string{"--mode=node", "--state-dir=", noShares, shared}, want: "pool(s) s are shared"},
		{name: "all, shared pool", args: []string{"--mode=all", "--state-dir=", noShares, local, shared}, want: "--state-dir is empty"},
		{name: "node, shared pool in the config", args: []string{"--mode=node", "--state-dir=", noShares, "--config=" + cfg}, want: "pool(s) fromfile are shared"},
		{name: "node, shares (the default)", args: []string{"--mode=node", "--state-dir=", local}, want: "--share-dir"},
		{name: "node, local pools only", args: []string{"--mode=node", "--state-dir=", noShares, local}},
		{name: "controller, shared pool", args: []string{"--mode=controller", "--state-dir=", shared}},
		{name: "node with a state dir", args: []string{"--mode=node", "--state-dir=" + dir, shared}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := parseServeFlags(t, tt.args...)
			if err := o.Validate(); err != nil {
				t.Fatal(err)
			}
			if tt.want == "" {
				mode, err := driver.ParseMode(o.Mode)
				if err != nil {
					t.Fatal(err)
				}
				if err := o.checkStateDir(mode); err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // should it start after all, it stops at once
			err := o.run(ctx)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("run: %v, want an error with %q", err, tt.want)
			}
		})
	}
}
