// Package dir runs the CSI sanity suite with every volume in the dir layout
// (Ginkgo runs one suite per process, so it cannot share test/sanity's).
package dir

import (
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

func TestSanityDirLayout(t *testing.T) {
	cfg := csiproc.StartForSanity(t)
	cfg.TestVolumeParameters = map[string]string{"layout": "dir"}
	// A directory has no device to throttle and no image to preallocate.
	cfg.TestVolumeMutableParameters = map[string]string{"preallocate": "false"}
	sanity.Test(t, *cfg)
}
