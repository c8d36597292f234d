package testutil

import (
	"crypto/rand"
	"encoding/hex"
	"os"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
)

// SanityIDs makes IDs in poolcsi's format for the CSI sanity suite, so "valid
// but unknown" IDs reach the code that looks volumes up instead of being
// refused by the ID parser.
type SanityIDs struct{ Pool string }

func randKey() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (g SanityIDs) GenerateUniqueValidVolumeID() string { return g.Pool + "." + randKey() }
func (SanityIDs) GenerateInvalidVolumeID() string       { return "nopool." + randKey() }
func (SanityIDs) GenerateUniqueValidNodeID() string     { return "node-" + randKey()[:8] }
func (SanityIDs) GenerateInvalidNodeID() string         { return "no-such-node" }

// SanityMutableParameters are the VolumeAttributesClass parameters the
// sanity suite creates and modifies image volumes with: every key poolcsi
// knows, so each is parsed, recorded and acted on (the image preallocated).
var SanityMutableParameters = map[string]string{
	"readBytesPerSecond": "40Mi", "writeBytesPerSecond": "20Mi",
	"readIOPS": "2000", "writeIOPS": "1000", "preallocate": "true",
}

// SanityCheckPath tells the sanity suite what is at a staging or target path.
func SanityCheckPath(path string) (sanity.PathKind, error) {
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
