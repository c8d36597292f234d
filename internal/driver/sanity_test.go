package driver

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// sanityAccessEnv selects the sanity run of a child process: Ginkgo runs one
// suite per process.
const sanityAccessEnv = "POOLCSI_FAKE_SANITY"

// TestSanityOverFakes runs the official CSI sanity suite in-process against a
// driver over the fake kernel, without root: mount and block image volumes, and
// dir volumes, each in a child process.
func TestSanityOverFakes(t *testing.T) {
	if mode := os.Getenv(sanityAccessEnv); mode != "" {
		runFakeSanity(t, mode)
		return
	}
	if testing.Short() {
		t.Skip("-short: the sanity suite over fakes takes a few seconds")
	}
	for _, mode := range []string{"mount", "block", "dir"} {
		t.Run(mode, func(t *testing.T) {
			args := []string{"-test.run=^TestSanityOverFakes$", "-test.count=1"}
			if dir := os.Getenv("POOLCSI_COVER_DIR"); dir != "" {
				// make unit merges the children's coverage with the parent's.
				args = append(args, "-test.coverprofile="+filepath.Join(dir, "sanity-"+mode+".out"))
			}
			cmd := exec.Command(os.Args[0], args...)
			cmd.Env = append(os.Environ(), sanityAccessEnv+"="+mode)
			out, err := cmd.CombinedOutput()
			if err != nil || testing.Verbose() {
				t.Logf("sanity over fakes (%s):\n%s", mode, out)
			}
			if err != nil {
				t.Fatalf("sanity over fakes (%s) failed: %v", mode, err)
			}
		})
	}
}

func runFakeSanity(t *testing.T, mode string) {
	td := newTestDriver(t, testOpts{maxVols: 4})
	endpoint, _ := td.serve(t)
	cfg := sanity.NewTestConfig()
	cfg.Address = endpoint
	cfg.StagingPath = filepath.Join(td.root, "staging")
	cfg.TargetPath = filepath.Join(td.root, "target")
	cfg.TestVolumeSize = 64 << 20
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.IDGen = testutil.SanityIDs{Pool: "local"}
	cfg.IdempotentCount = 2
	cfg.TestNodeVolumeAttachLimit = true
	cfg.CheckPath = testutil.SanityCheckPath
	cfg.TestVolumeMutableParameters = testutil.SanityMutableParameters
	switch mode {
	case "block":
		cfg.TestVolumeAccessType = "block"
	case "dir":
		cfg.TestVolumeParameters = map[string]string{"layout": "dir"}
		// A directory has no device to throttle and no image to
		// preallocate; "false" is what it is.
		cfg.TestVolumeMutableParameters = map[string]string{"preallocate": "false"}
	}
	sanity.Test(t, cfg)
}
