package e2e

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestPoolCommands runs the operator commands against a pool a live driver uses:
// list shows what the driver did, check finds damage and leftovers and exits 1,
// and exits 0 again once they are repaired.
func TestPoolCommands(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	staged := e.create("pvc-staged", vc, 32*mib)
	idle := e.create("pvc-idle", vc, 16*mib)
	e.stage(staged, vc)

	poolcsi := func(args ...string) (string, int) {
		out, err := exec.Command(csiproc.Binary(t), append([]string{"pool"}, args...)...).CombinedOutput()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), code
	}
	out, code := poolcsi("list", "--path", e.pool)
	if code != 0 {
		t.Fatalf("pool list exited %d:\n%s", code, out)
	}
	for _, want := range []string{staged, idle, "pvc-staged", "32 MiB", "node-1", "healthy"} {
		if !strings.Contains(out, want) {
			t.Errorf("pool list lacks %q:\n%s", want, out)
		}
	}
	if out, code := poolcsi("check", "--path", e.pool); code != 0 || !strings.Contains(out, "no problems") {
		t.Fatalf("check of a healthy pool exited %d:\n%s", code, out)
	}

	image := filepath.Join(e.pool, "volumes", strings.SplitN(idle, ".", 2)[1], "disk.img")
	if err := os.Truncate(image, 4*mib); err != nil {
		t.Fatal(err)
	}
	stray := filepath.Join(e.pool, "volumes", "stray-file")
	if err := os.WriteFile(stray, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	out, code = poolcsi("check", "--path", e.pool)
	if code != 1 || !strings.Contains(out, "ImageTruncated") || !strings.Contains(out, "stray-file") {
		t.Fatalf("check of a damaged pool exited %d:\n%s", code, out)
	}
	if err := os.Truncate(image, 16*mib); err != nil {
		t.Fatal(err)
	}
	os.Remove(stray)
	if out, code := poolcsi("check", "--path", e.pool); code != 0 {
		t.Fatalf("check after the repair exited %d:\n%s", code, out)
	}
	if _, code := poolcsi("list", "--path", t.TempDir()); code == 0 {
		t.Fatal("pool list accepted a directory that is not a pool")
	}
}
