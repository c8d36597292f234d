// Package sanity runs the official CSI sanity suite (csi-test) against a real
// `poolcsi serve` process on a temporary pool, with real loop devices and mounts.
package sanity

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/harness"
)

// idGen makes IDs in poolcsi's format, so "valid but unknown" IDs reach the code
// that looks volumes up instead of being refused by the ID parser.
type idGen struct{}

func randKey() string {
	b := make([]byte, 16)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func (idGen) GenerateUniqueValidVolumeID() string { return "sanity." + randKey() }
func (idGen) GenerateInvalidVolumeID() string     { return "nopool." + randKey() }
func (idGen) GenerateUniqueValidNodeID() string   { return "node-" + randKey()[:8] }
func (idGen) GenerateInvalidNodeID() string       { return "no-such-node" }

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
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid")
	root := t.TempDir()
	harness.CheckNoLeaks(t, root)
	poolDir := filepath.Join(root, "pool")
	// A small attach limit lets the suite check that the controller holds it.
	d := harness.Start(t, harness.Options{NodeID: "sanity-node", Pools: []string{"sanity=" + poolDir}, Args: []string{"--max-volumes-per-node", "4"}})

	cfg := sanity.NewTestConfig()
	cfg.Address = d.Endpoint
	cfg.StagingPath = filepath.Join(root, "staging")
	cfg.TargetPath = filepath.Join(root, "target")
	cfg.TestVolumeAccessType = access
	cfg.TestVolumeSize = 64 << 20
	// A whole number of MiB above every filesystem minimum poolcsi enforces for
	// ext4, so the expansion specs get exactly the size they ask for.
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.IDGen = idGen{}
	cfg.IdempotentCount = 2
	cfg.TestNodeVolumeAttachLimit = true
	cfg.CheckPath = func(path string) (sanity.PathKind, error) {
		fi, err := os.Stat(path)
		switch {
		case os.IsNotExist(err):
			return sanity.PathIsNotFound, nil
		case err != nil:
			return sanity.PathIsOther, err
		case fi.IsDir():
			return sanity.PathIsDir, nil
		case fi.Mode().IsRegular():
			return sanity.PathIsFile, nil
		}
		return sanity.PathIsOther, nil
	}
	sanity.Test(t, cfg)
}
