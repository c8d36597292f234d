package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestPathSwapRace: while NodeStageVolume, NodePublishVolume and their
// unpublish and unstage run again and again, another process keeps swapping a
// directory of the staging and target paths for a symbolic link to a directory
// outside --allowed-path-prefix. No mount ever lands outside it, nothing is
// created there, and the prefix itself is refused as a path. Before the paths
// were resolved once and used through what was resolved, 4 of 80 publishes
// were mounted outside the prefix.
func TestPathSwapRace(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	base := csiproc.ShortRoot(t, "pcsi-race-")
	prefix, outside := filepath.Join(base, "kubelet"), filepath.Join(base, "outside")
	for _, d := range []string{prefix, outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e := newEnvArgs(t, []string{"--allowed-path-prefix", prefix}, "mkfs.ext4")
	c := ctx(t)
	n := e.drv.Node()
	vc := csiproc.MountCap("ext4", csiproc.RWO)
	id := e.create("pvc-race", vc, 16*mib)

	// The prefix itself is never a staging or target path.
	if _, err := n.NodeStageVolume(c, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: prefix, VolumeCapability: vc}); err == nil {
		t.Fatal("the allowed prefix itself was accepted as a staging path")
	}

	pods := filepath.Join(prefix, "pods")
	link := filepath.Join(prefix, "pods.link")
	if err := os.Mkdir(pods, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, link); err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(pods, "staging")
	target := filepath.Join(pods, "target")
	// The attacker exchanges pods and the link atomically (RENAME_EXCHANGE),
	// so pods always exists: were it missing for a moment, the driver would
	// rightly make it anew (it makes the missing directories of a path), and
	// the next swap would leave the real directory, and a mount in it, under
	// another name.
	swapped := false
	exchange := func() {
		if err := unix.Renameat2(unix.AT_FDCWD, pods, unix.AT_FDCWD, link, unix.RENAME_EXCHANGE); err != nil {
			t.Errorf("exchange %s and %s: %v", pods, link, err)
			return
		}
		swapped = !swapped
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	attack := func() { // pods <-> a link to outside
		stop.Store(false)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				exchange()
				time.Sleep(50 * time.Microsecond)
			}
		}()
	}
	pause := func() {
		stop.Store(true)
		wg.Wait()
		if swapped {
			exchange()
		}
	}
	attack()
	cleanupCtx := context.Background()
	ok := 0
	for i := 0; i < 80; i++ {
		_, err := n.NodeStageVolume(c, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
		if err == nil {
			if _, err := n.NodePublishVolume(c, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc}); err == nil {
				ok++
			}
		}
		// Tear down with the attacker paused, so every round starts clean.
		pause()
		if mounted := mountsUnder(t, outside); len(mounted) > 0 {
			t.Fatalf("round %d: mounted outside the allowed prefix: %v", i, mounted)
		}
		if _, err := n.NodeUnpublishVolume(cleanupCtx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
			t.Fatalf("round %d: unpublish: %v", i, err)
		}
		if _, err := n.NodeUnstageVolume(cleanupCtx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			t.Fatalf("round %d: unstage: %v", i, err)
		}
		attack()
	}
	pause()
	if entries, _ := os.ReadDir(outside); len(entries) > 0 {
		t.Fatalf("created outside the allowed prefix: %v", entries)
	}
	t.Logf("%d of 80 rounds staged and published while the links were swapped", ok)
}

// mountsUnder lists the mount points below dir.
func mountsUnder(t *testing.T, dir string) []string {
	out, err := exec.Command("findmnt", "-rn", "-o", "TARGET").Output()
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, m := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(m, dir+"/") || m == dir {
			found = append(found, m)
		}
	}
	return found
}
