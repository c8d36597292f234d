package harness

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// CheckNoLeaks fails the test if a loop device backed by a file under root, or a
// mount under root, is still there. Register it with t.Cleanup before anything is
// created, so it runs after every other cleanup.
func CheckNoLeaks(t testing.TB, roots ...string) {
	t.Helper()
	t.Cleanup(func() {
		out, _ := exec.Command("losetup", "-a").Output()
		mi, _ := os.ReadFile("/proc/self/mountinfo")
		for _, r := range roots {
			for _, line := range strings.Split(string(out), "\n") {
				if strings.Contains(line, r) {
					t.Errorf("loop device leaked: %s", line)
				}
			}
			for _, line := range strings.Split(string(mi), "\n") {
				if strings.Contains(line, r) {
					t.Errorf("mount leaked: %s", line)
				}
			}
		}
	})
}
