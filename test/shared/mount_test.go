package shared

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestMountStanza: a pool whose config has a mount stanza is mounted by the
// driver at start-up and its volumes land on the mounted filesystem, not on the
// empty mount point. The source is a btrfs filesystem bind-mounted, standing in
// for an NFS export (no NFS client here).
func TestMountStanza(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.btrfs", "btrfs", "mount", "umount")
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	export := testutil.LoopFS(t, root, "btrfs", 256*mib)
	poolPath := filepath.Join(root, "mnt", "shared")
	t.Cleanup(func() {
		if ok, _ := mountinfo.Mounted(poolPath); ok {
			if out, err := exec.Command("umount", poolPath).CombinedOutput(); err != nil {
				t.Errorf("umount %s: %v %s", poolPath, err, out)
			}
		}
	})
	cfg := filepath.Join(root, "config.yaml")
	os.WriteFile(cfg, []byte(fmt.Sprintf(`pools:
- name: shared
  path: %s
  shared: true
  mount:
    source: %s
    options: [bind]
    timeout: 10s
`, poolPath, export)), 0o600)
	d := csiproc.Start(t, csiproc.Options{NodeID: "node-1", Args: []string{"--config", cfg}})
	if ok, _ := mountinfo.Mounted(poolPath); !ok {
		t.Fatalf("%s is not mounted", poolPath)
	}
	vc := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
	v := createVolume(t, d, "on-export", 8*mib, map[string]string{"layout": "dir"}, vc)
	if _, err := os.Stat(filepath.Join(export, "volumes")); err != nil {
		t.Fatalf("the volume is not on the mounted filesystem: %v (volume %s)", err, v.GetVolumeId())
	}
	if _, err := d.Identity().Probe(context.Background(), &csi.ProbeRequest{}); err != nil {
		t.Fatal(err)
	}
}
