// Package sanity runs the official CSI sanity suite (csi-test) against a real
// `poolcsi serve` process on a temporary pool, with real loop devices and mounts.
package sanity

import (
	"os"
	"os/exec"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// accessEnv selects the access type of one sanity run. Ginkgo runs a suite once
// per process, so TestSanity runs each access type in a child test process.
const accessEnv = "POOLCSI_SANITY_ACCESS"

// TestSanity runs the whole suite twice, for Filesystem (mount) and for raw Block
// volumes, each against its own driver process and pool.
func TestSanity(t *testing.T) {
	if access := os.Getenv(accessEnv); access != "" {
		runSanity(t, access)
		return
	}
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid")
	for _, access := range []string{"mount", "block"} {
		t.Run(access, func(t *testing.T) {
			args := []string{"-test.run=^TestSanity$", "-test.count=1"}
			if testing.Verbose() {
				args = append(args, "-test.v")
			}
			cmd := exec.Command(os.Args[0], args...)
			cmd.Env = append(os.Environ(), accessEnv+"="+access)
			out, err := cmd.CombinedOutput()
			if testing.Verbose() || err != nil {
				t.Logf("sanity (%s access):\n%s", access, out)
			}
			if err != nil {
				t.Fatalf("sanity suite with %s access failed: %v", access, err)
			}
		})
	}
}

func runSanity(t *testing.T, access string) {
	cfg := csiproc.StartForSanity(t)
	cfg.TestVolumeAccessType = access
	sanity.Test(t, *cfg)
}
