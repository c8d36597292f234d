package e2e

import (
	"fmt"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestListVolumesPagingSurvivesChanges is the pagination case csi-test keeps
// disabled (XIt) because index-based tokens fail it: volumes are deleted and
// created between pages. poolcsi's token is the next volume's ID, so the listing
// never repeats a volume and never loses one that existed throughout.
func TestListVolumesPagingSurvivesChanges(t *testing.T) {
	e := newEnv(t, "mkfs.ext4")
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	all := map[string]bool{}
	for i := range 7 {
		all[e.create(fmt.Sprintf("pvc-page-%d", i), vc, 16*mib)] = true
	}
	c := e.drv.Controller()
	seen := map[string]int{}
	deleted := map[string]bool{}
	token := ""
	for page := 0; ; page++ {
		resp, err := c.ListVolumes(ctx(t), &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: token})
		if err != nil {
			t.Fatalf("page %d: %v", page, err)
		}
		if n := len(resp.GetEntries()); n > 2 {
			t.Fatalf("page %d has %d entries, max_entries was 2", page, n)
		}
		for _, en := range resp.GetEntries() {
			seen[en.GetVolume().GetVolumeId()]++
		}
		if page == 0 {
			// Delete the page's last volume (the one the token follows) and add one.
			last := resp.GetEntries()[len(resp.GetEntries())-1].GetVolume().GetVolumeId()
			if _, err := c.DeleteVolume(ctx(t), &csi.DeleteVolumeRequest{VolumeId: last}); err != nil {
				t.Fatal(err)
			}
			deleted[last] = true
			e.create("pvc-page-new", vc, 16*mib)
		}
		token = resp.GetNextToken()
		if token == "" {
			break
		}
	}
	for id, n := range seen {
		if n > 1 {
			t.Errorf("volume %s listed %d times", id, n)
		}
	}
	for id := range all {
		if seen[id] == 0 && !deleted[id] {
			t.Errorf("volume %s existed throughout but was never listed", id)
		}
	}
}
