package csiproc

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// loopSettle is how long CheckNoLeaks gives a loop device to go after the
// unmount of a filesystem mounted with -o loop: the kernel detaches it (autoclear)
// when the filesystem lets go of it, which btrfs does a moment after umount
// returns, seconds later on a busy machine (5 s was seen to be too short with
// other test suites compiling beside the chaos suite).
const loopSettle = 15 * time.Second

// CheckNoLeaks fails the test if a loop device backed by a file under root, or a
// mount under root, is still there. Register it with t.Cleanup before anything is
// created, so it runs after every other cleanup.
func CheckNoLeaks(t testing.TB, roots ...string) {
	t.Helper()
	t.Cleanup(func() {
		var loops []string
		for deadline := time.Now().Add(loopSettle); ; time.Sleep(50 * time.Millisecond) {
			out, _ := exec.Command("losetup", "-a").Output()
			loops = loops[:0]
			for _, line := range strings.Split(string(out), "\n") {
				for _, r := range roots {
					if strings.Contains(line, r) {
						loops = append(loops, line)
					}
				}
			}
			if len(loops) == 0 || time.Now().After(deadline) {
				break
			}
		}
		for _, line := range loops {
			t.Errorf("loop device leaked: %s", line)
		}
		mi, _ := os.ReadFile("/proc/self/mountinfo")
		for _, r := range roots {
			for _, line := range strings.Split(string(mi), "\n") {
				if strings.Contains(line, r) {
					t.Errorf("mount leaked: %s", line)
				}
			}
		}
	})
}

// ShortRoot is a new directory with a short path (a share's type and source,
// path included, travel in every volume ID and may be 57 bytes together;
// t.TempDir's paths are long), checked with CheckNoLeaks and removed after the
// test, but never through a mount left behind (CheckNoLeaks reports that).
func ShortRoot(t testing.TB, prefix string) string {
	t.Helper()
	root, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if mi, _ := os.ReadFile("/proc/self/mountinfo"); !strings.Contains(string(mi), root) {
			os.RemoveAll(root)
		}
	})
	CheckNoLeaks(t, root)
	return root
}
