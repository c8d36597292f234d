package csiproc

import (
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// SanityPool is the pool name StartForSanity configures; the ID generator makes
// IDs in it.
const SanityPool = "sanity"

// StartForSanity starts a driver on a temporary local pool and returns a sanity
// configuration aimed at it, with real staging and target paths. A small attach
// limit lets the suite check that the controller holds it.
func StartForSanity(t *testing.T) *sanity.TestConfig {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "blkid")
	root := t.TempDir()
	CheckNoLeaks(t, root)
	d := Start(t, Options{NodeID: "sanity-node", Pools: []string{SanityPool + "=" + filepath.Join(root, "pool")},
		Args: []string{"--max-volumes-per-node", "4"}})

	cfg := sanity.NewTestConfig()
	cfg.Address = d.Endpoint
	cfg.StagingPath = filepath.Join(root, "staging")
	cfg.TargetPath = filepath.Join(root, "target")
	cfg.TestVolumeSize = 64 << 20
	// A whole number of MiB above every filesystem minimum poolcsi enforces for
	// ext4, so the expansion specs get exactly the size they ask for.
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.IDGen = testutil.SanityIDs{Pool: SanityPool}
	cfg.IdempotentCount = 2
	cfg.TestNodeVolumeAttachLimit = true
	cfg.CheckPath = testutil.SanityCheckPath
	cfg.TestVolumeMutableParameters = testutil.SanityMutableParameters
	return &cfg
}
