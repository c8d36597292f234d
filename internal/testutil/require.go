// Package testutil holds the checks that tests needing real kernel resources share.
package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// InCI reports whether the tests run under CI, where every prerequisite must be
// present: a missing one is a failure there, never a silent skip.
func InCI() bool { return os.Getenv("CI") != "" }

// RequireRoot stops a test that needs root (mounts, loop devices). Outside CI it
// skips with the reason; in CI it fails, because CI runs as root and a skip would
// hide a broken environment.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		missing(t, "needs root (mounts and loop devices); run the tests as root")
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		missing(t, "needs loop devices: /dev/loop-control is missing ("+err.Error()+")")
	}
}

// RequireCommands stops a test whose external tools (mkfs.xfs, losetup, …) are absent.
func RequireCommands(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			missing(t, "needs the command "+n+" (install e2fsprogs, xfsprogs, btrfs-progs, util-linux)")
		}
	}
}

func missing(t testing.TB, why string) {
	t.Helper()
	if InCI() {
		t.Fatalf("prerequisite missing in CI: %s", why)
	}
	t.Skipf("prerequisite missing: %s", why)
}
