package mkfsns

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestUnreachable(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		want bool
	}{
		{"", false},
		{"tmpfs", false},        // not a path: mkfs skips it too
		{"ceph-fuse", false},    // idem
		{dir, false},            // there
		{file, false},           // there
		{file + ".gone", false}, // ENOENT: not mounted from anything, not an error
		{file + "/x", false},    // ENOTDIR
	} {
		if got := unreachable(tc.path); got != tc.want {
			t.Errorf("unreachable(%q) = %v, want %v", tc.path, got, tc.want)
		}
	}
}

func TestLoopBackingFileNames(t *testing.T) {
	// Only /dev/loopN names are looked up in sysfs, never a path built from
	// anything else.
	for _, dev := range []string{"", "tmpfs", "/dev/sda", "/dev/loop0/../sda", "/tmp/loop0", "/dev/mapper/loop0"} {
		if got := loopBackingFile(dev); got != "" {
			t.Errorf("loopBackingFile(%q) = %q, want \"\"", dev, got)
		}
	}
}

// TestScanBlockedIsShared: a scan blocked on a paused FUSE is given up at
// scanTimeout, is not started again while it blocks, and then mkfs runs as
// it always did.
func TestScanBlockedIsShared(t *testing.T) {
	release := make(chan struct{})
	var calls atomic.Int32
	oldFunc, oldTimeout := scanFunc, scanTimeout
	scanFunc = func() ([]string, error) {
		calls.Add(1)
		<-release
		return nil, nil
	}
	scanTimeout = 50 * time.Millisecond
	t.Cleanup(func() {
		close(release)
		for { // the blocked scan ends before the next test swaps scanFunc
			scan.Lock()
			idle := scan.cur == nil
			scan.Unlock()
			if idle {
				break
			}
			time.Sleep(time.Millisecond)
		}
		scanFunc, scanTimeout = oldFunc, oldTimeout
	})
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := unreachableMounts(context.Background()); err == nil {
				t.Error("unreachableMounts with a blocked scan: no error")
			}
		}()
	}
	wg.Wait()
	if _, err := unreachableMounts(context.Background()); err == nil {
		t.Error("unreachableMounts after the timeout, scan still blocked: no error")
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("scan started %d times while blocked, want 1", n)
	}
	out, err := Run(context.Background(), "/", "true")
	if err != nil {
		t.Errorf("Run with a blocked scan: %v, %s", err, out)
	}
}
