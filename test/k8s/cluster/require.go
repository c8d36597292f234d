package cluster

import (
	"os"
	"os/exec"
	"testing"
)

// The pattern of internal/testutil/require.go, copied because test/k8s is its own module:
// a missing prerequisite fails under CI (CI set) and skips, with the reason, elsewhere.

// InCI reports whether the tests run under CI (CI set), where a missing prerequisite
// fails instead of skipping.
func InCI() bool { return os.Getenv("CI") != "" }

// RequireRoot skips (fails under CI) unless the process is root with loop devices.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "needs root (poolcsi serve manages loop devices and mounts); run the tests as root")
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		Missing(t, "needs loop devices: /dev/loop-control is missing ("+err.Error()+")")
	}
}

// RequireCommands skips (fails under CI) unless every command is on the PATH.
func RequireCommands(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			Missing(t, "needs the command "+n+" (install e2fsprogs, xfsprogs, btrfs-progs, util-linux)")
		}
	}
}

// Missing skips the test, or fails it under CI, naming the missing prerequisite.
func Missing(t testing.TB, why string) {
	t.Helper()
	if InCI() {
		t.Fatalf("prerequisite missing in CI: %s", why)
	}
	t.Skipf("prerequisite missing: %s", why)
}
