package testutil

import (
	"os"
	"path/filepath"
	"testing"
)

// TestUnitOnlySkipsAreRecorded: each test make unit skips for UnitOnlyEnv is in
// UnitSkipsEnv's record, by package directory and top-level name, which make
// test's root pass runs again; an unrecorded skip would run nowhere.
func TestUnitOnlySkipsAreRecorded(t *testing.T) {
	record := filepath.Join(t.TempDir(), "skips")
	t.Setenv(UnitOnlyEnv, "1")
	t.Setenv(UnitSkipsEnv, record)
	t.Run("root", func(t *testing.T) {
		RequireRoot(t)
		t.Error("RequireRoot did not skip under " + UnitOnlyEnv)
	})
	t.Run("tools/nested", func(t *testing.T) {
		RequireCommands(t, "mkfs.btrfs")
		t.Error("RequireCommands did not skip under " + UnitOnlyEnv)
	})
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(record)
	if err != nil {
		t.Fatal(err)
	}
	want := dir + "\tTestUnitOnlySkipsAreRecorded\n" + dir + "\tTestUnitOnlySkipsAreRecorded\n"
	if string(got) != want {
		t.Fatalf("record:\n%q\nwant\n%q", got, want)
	}
}
