// Package testutil holds the checks that tests needing real kernel resources share.
package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// InCI reports whether the tests run under CI, where every prerequisite must be
// present: a missing one is a failure there, never a silent skip.
func InCI() bool { return os.Getenv("CI") != "" }

// UnitOnlyEnv, when set, skips every test that needs root, loop devices or
// external tools, in CI too: it is how make unit runs only the no-root loop,
// while make test (without it) runs them all and fails on a missing one.
// RequireRoot and RequireCommands are the only readers of it: a test skipped
// for it is then always in the UnitSkipsEnv record.
const UnitOnlyEnv = "POOLCSI_UNIT_ONLY"

// UnitSkipsEnv names a file to which every test skipped for UnitOnlyEnv appends
// a line "<package directory>\t<top-level test name>". make test runs the
// internal/ and cmd/ packages once without root's tests (make unit) and then
// only the tests in this record, as root: every other test of theirs has run.
const UnitSkipsEnv = "POOLCSI_UNIT_SKIPS"

// skipUnitOnly skips t for UnitOnlyEnv, recorded in UnitSkipsEnv's file.
func skipUnitOnly(t testing.TB, needs string) {
	t.Helper()
	if path := os.Getenv(UnitSkipsEnv); path != "" {
		dir, err := os.Getwd()
		if err == nil {
			err = appendLine(path, dir+"\t"+strings.SplitN(t.Name(), "/", 2)[0]+"\n")
		}
		if err != nil {
			// Unrecorded, the test would run in neither pass.
			t.Fatalf("%s: cannot record the skip for %s: %v", UnitSkipsEnv, UnitOnlyEnv, err)
		}
	}
	t.Skipf("%s is set (make unit): this test needs %s and runs in make test", UnitOnlyEnv, needs)
}

// appendLine appends line to path in one write (O_APPEND: test binaries of
// several packages write at once).
func appendLine(path, line string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644) //nolint:gosec // make test names the record (POOLCSI_UNIT_SKIPS)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(line); err != nil {
		f.Close()
		return fmt.Errorf("append to %s: %w", path, err)
	}
	return f.Close()
}

// RequireRoot stops a test that needs root (mounts, loop devices). Outside CI it
// skips with the reason; in CI it fails, because CI runs as root and a skip would
// hide a broken environment.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Getenv(UnitOnlyEnv) != "" {
		skipUnitOnly(t, "root")
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
		skipUnitOnly(t, "external tools")
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
