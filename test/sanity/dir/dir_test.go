// Package dir runs the CSI sanity suite with every volume in the dir layout
// (Ginkgo runs one suite per process, so it cannot share test/sanity's).
package dir

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/harness"
)

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

func TestSanityDirLayout(t *testing.T) {
	testutil.RequireRoot(t)
	root := t.TempDir()
	harness.CheckNoLeaks(t, root)
	d := harness.Start(t, harness.Options{NodeID: "sanity-node", Pools: []string{"sanity=" + filepath.Join(root, "pool")}, Args: []string{"--max-volumes-per-node", "4"}})

	cfg := sanity.NewTestConfig()
	cfg.Address = d.Endpoint
	cfg.StagingPath = filepath.Join(root, "staging")
	cfg.TargetPath = filepath.Join(root, "target")
	cfg.TestVolumeSize = 64 << 20
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.TestVolumeParameters = map[string]string{"layout": "dir"}
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
