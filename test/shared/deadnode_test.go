package shared

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/test/support/cephfs"
)

// TestNodeDiesHoldingALock: node 2 holds a volume's lock when it dies (its
// ceph-fuse is killed: the client never says goodbye, so the MDS keeps its
// session, caps and lock until it evicts it, 300 s by default). Node 1's calls
// that need the lock answer a retryable code naming node 2 within their
// deadline; calls that do not need it are not held up; once the operator evicts
// the dead client, the lock is free and the call succeeds.
func TestNodeDiesHoldingALock(t *testing.T) {
	e := setup(t, "cephfs")
	c := cephfs.Shared(t)
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4")
	id := createVolume(t, e.d1, "held", 16*mib, map[string]string{"pool": "shared"}, vc).GetVolumeId()
	vid, _ := pool.ParseVolumeID(id)

	// Whatever happens, node B gets a working client back for the tests after.
	t.Cleanup(func() {
		if _, err := c.EvictClient(ctx, 1); err != nil {
			t.Errorf("evict node B: %v", err)
		}
		if err := c.Remount(ctx, 1); err != nil {
			t.Errorf("remount node B: %v", err)
		}
	})
	// Node 2 takes the volume's lock as its driver does (through its own mount,
	// recording itself as the holder) and dies holding it.
	p2, err := pool.Open(pool.Config{Name: "shared", Path: e.pool2, Shared: true}, pool.WithNode("node-2"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p2.LockVolume(ctx, vid); err != nil {
		t.Fatal(err)
	}
	lockFile := filepath.Join(e.poolDir, "volumes", vid.Key, "lock")
	for deadline := time.Now().Add(20 * time.Second); ; {
		raw, _ := os.ReadFile(lockFile)
		if strings.Contains(string(raw), "node-2") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node 1 never saw node 2's holder record: %q", raw)
		}
		time.Sleep(100 * time.Millisecond)
	}
	e.d2.Kill() // the node's processes die with it
	c.KillClient(1)
	died := time.Now()

	// Node 1 asks, as the attacher does, every few seconds with a 5 s
	// deadline, until the lock is free. Every call is answered within its
	// deadline, with a retryable code: first the lock file itself does not
	// answer (the dead client holds its capabilities until the MDS marks it
	// stale, after session_timeout), then the lock is held, by node 2.
	var named, freed bool
	for deadline := time.Now().Add(cephfs.SessionTimeout + 60*time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Second) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		start := time.Now()
		_, err := e.d1.Controller().ControllerPublishVolume(cctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: vc})
		cancel()
		took := time.Since(start)
		t.Logf("%5.1fs after node 2 died: ControllerPublishVolume on node 1 answered in %s: %v", start.Sub(died).Seconds(), took.Round(time.Millisecond), err)
		if took >= 5*time.Second {
			t.Fatalf("ControllerPublishVolume was not answered within its deadline of 5s")
		}
		if err == nil {
			freed = true
			break
		}
		switch status.Code(err) {
		case codes.DeadlineExceeded, codes.Aborted, codes.Unavailable:
		default:
			t.Fatalf("ControllerPublishVolume while a dead node holds the volume's lock: %v, want a retryable code", err)
		}
		named = named || strings.Contains(err.Error(), "node node-2")
	}
	t.Logf("holder named: %t; lock freed without an eviction: %t", named, freed)
	if !named && !freed {
		t.Errorf("no answer named the holder, node-2")
	}
	// Another volume's calls are not held up.
	start := time.Now()
	other := createVolume(t, e.d1, "free", 16*mib, map[string]string{"pool": "shared"}, vc).GetVolumeId()
	if err := publish(t, e.d1, other, "node-1", vc, false); err != nil {
		t.Fatalf("publish another volume while node 2 is dead: %v", err)
	}
	unpublish(t, e.d1, other, "node-1")
	t.Logf("create, publish and unpublish of another volume while node 2 is dead: %s", time.Since(start).Round(time.Millisecond))
	if freed {
		unpublish(t, e.d1, id, "node-1")
		return
	}

	// The operator evicts the dead client: the lock is free.
	n, err := c.EvictClient(ctx, 1)
	if err != nil {
		t.Fatalf("evict node B's client: %v", err)
	}
	t.Logf("evicted %d sessions of node B", n)
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	start = time.Now()
	if _, err := e.d1.Controller().ControllerPublishVolume(cctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: vc}); err != nil {
		t.Fatalf("ControllerPublishVolume after the dead client was evicted: %v", err)
	}
	t.Logf("ControllerPublishVolume after the eviction: %s", time.Since(start).Round(time.Millisecond))
	unpublish(t, e.d1, id, "node-1")
}
