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

// UnitOnlyEnv, when set, skips every test that needs root, loop devices or
// external tools, in CI too: it is how make unit runs only the no-root loop,
// while make test (without it) runs them all and fails on a missing one.
const UnitOnlyEnv = "POOLCSI_UNIT_ONLY"

// RequireRoot stops a test that needs root (mounts, loop devices). Outside CI it
// skips with the reason; in CI it fails, because CI runs as root and a skip would
// hide a broken environment.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Getenv(UnitOnlyEnv) != "" {
		t.Skipf("%s is set (make unit): this test needs root and runs in make test", UnitOnlyEnv)
	}
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
	if os.Getenv(UnitOnlyEnv) != "" {
		t.Skipf("%s is set (make unit): this test needs external tools and runs in make test", UnitOnlyEnv)
	}
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
