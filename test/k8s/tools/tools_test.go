package tools

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A second builder (cmd/prebuild beside the tests) that finds the cache entry locked waits,
// and takes the first one's binary instead of building it again.
func TestBuildWaitsForAnotherBuilder(t *testing.T) {
	t.Setenv("POOLCSI_K8S_CACHE", t.TempDir())
	// No module a build could fetch: a build attempt fails instead of passing unseen.
	tl := Tool{Name: "nothing", Module: "poolcsi.test/none", Version: "v0.0.0", Package: "."}
	dir := tl.cacheEntry()
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}

	type result struct {
		bin  string
		took time.Duration
		err  error
	}
	done := make(chan result, 1)
	go func() {
		bin, took, err := tl.Build(t.Context())
		done <- result{bin, took, err}
	}()
	select {
	case r := <-done:
		t.Fatalf("Build returned while another builder held the lock: %+v", r)
	case <-time.After(200 * time.Millisecond):
	}

	// The other builder finishes: its binary appears, then its lock goes.
	bin := filepath.Join(dir, tl.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, []byte("#!/bin/true\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := lock.Close(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.bin != bin || r.took != 0 {
		t.Fatalf("Build after the other builder = %q, %v, %v; want %q, 0, nil", r.bin, r.took, r.err, bin)
	}
}
