package driver

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/fence"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/nodestate"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
)

// The ways a shared pool the driver may lay out by itself (a mount stanza's,
// RequireMount) leaves its path, with the real kernel: the driver must never
// lay it out again in what shows there, never renew its lease there, and
// answer a stage UNAVAILABLE (docs/fencing.md, "Every way of losing the
// pool").

func mustUnmount(t *testing.T, dir string) {
	t.Helper()
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatalf("unmount %s: %v", dir, err)
	}
}

func bindMount(t *testing.T, from, to string) {
	t.Helper()
	if err := unix.Mount(from, to, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s at %s: %v", from, to, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(to, unix.MNT_DETACH) })
}

// goneAside unmounts the pool's filesystem from dir, keeping it reachable
// at another path (a share whose mount on dir vanished while the filesystem
// lives on), and returns how to mount it back at dir.
func goneAside(t *testing.T, dir string) (back func()) {
	side := t.TempDir()
	bindMount(t, dir, side)
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	return func() { bindMount(t, side, dir) }
}

// coverWays: fault takes the pool at dir (a tmpfs mount point holding it)
// away from its path, and returns how to bring it back.
var coverWays = []struct {
	name  string
	fault func(t *testing.T, dir string) (uncover func())
}{
	{"tmpfs over the path", func(t *testing.T, dir string) func() {
		testutil.Tmpfs(t, dir, "4g")
		return func() { mustUnmount(t, dir) }
	}},
	{"empty dir bound over the path", func(t *testing.T, dir string) func() {
		bindMount(t, t.TempDir(), dir)
		return func() { mustUnmount(t, dir) }
	}},
	{"the pool's mount gone, the bare directory left", goneAside},
	{"the pool's mount gone, the bare directory covered", func(t *testing.T, dir string) func() {
		back := goneAside(t, dir)
		testutil.Tmpfs(t, dir, "4g")
		return func() { mustUnmount(t, dir); back() }
	}},
	{"another pool of the same name over the path", func(t *testing.T, dir string) func() {
		testutil.Tmpfs(t, dir, "4g")
		if _, err := pool.Initialise(pool.Config{Name: "shared", Path: dir, Shared: true}); err != nil {
			t.Fatal(err)
		}
		return func() { mustUnmount(t, dir) }
	}},
	{"pool.json deleted", func(t *testing.T, dir string) func() {
		meta := filepath.Join(dir, "pool.json")
		raw, err := os.ReadFile(meta)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(meta); err != nil {
			t.Fatal(err)
		}
		return func() {
			if err := os.WriteFile(meta, raw, 0o640); err != nil {
				t.Fatal(err)
			}
		}
	}},
}

// coveredNode is a node plugin over a shared pool with a mount stanza
// (RequireMount) at dir, a tmpfs mount point, with its records in state and
// its kernel h: what a restart keeps.
func coveredNode(t *testing.T, dir string, state *nodestate.Store, h *fake.Host) *leaseNode {
	t.Helper()
	// As the node plugin's start opens it (cmd/poolcsi, openPools).
	p, err := pool.Open(pool.Config{Name: "shared", Path: dir, Shared: true, RequireMount: true}, pool.WithNode("node-a"),
		pool.WithLayoutGuard(fence.LayoutGuard(&layout.Deps{State: state, Loops: h}, "shared")))
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(Options{Name: "poolcsi.test", Version: "test", NodeID: "node-a", Mode: ModeAll, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: h, Loops: h, Devices: h, FS: h}, State: state})
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{t: time.Unix(100000, 0)}
	d.leases.SetClock(c.now)
	d.registerNode(context.Background())
	return &leaseNode{Driver: d, host: h, clock: c, root: t.TempDir()}
}

// newCoveredPool is a tmpfs mount point for a pool, and the node's records.
func newCoveredPool(t *testing.T) (dir string, state *nodestate.Store) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "shared")
	if err := os.Mkdir(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	testutil.Tmpfs(t, dir, "4g") // the share the pool is on
	state, err := nodestate.Open(t.TempDir(), "node-a")
	if err != nil {
		t.Fatal(err)
	}
	return dir, state
}

// createPublished creates an image volume on a and publishes it to node-a.
func createPublished(t *testing.T, a *leaseNode) (id string, vc *csi.VolumeCapability) {
	t.Helper()
	ctx := context.Background()
	vc = mountCap(rwo, "ext4")
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id = resp.GetVolume().GetVolumeId()
	if _, err := a.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-a", VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	return id, vc
}

// createStaged is createPublished, then the volume staged read-write on a
// at <a.root>/staging.
func createStaged(t *testing.T, a *leaseNode) (id string, vc *csi.VolumeCapability, staging string) {
	t.Helper()
	id, vc = createPublished(t, a)
	staging = filepath.Join(a.root, "staging")
	if _, err := a.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	return id, vc, staging
}

// TestStageOnCoveredPool: a node whose pool's path no longer shows the pool
// answers NodeStageVolume UNAVAILABLE (kubelet retries), never NOT_FOUND for
// a volume that exists, and neither Probe nor the stage changes anything at
// the path; once the pool shows again, the stage works.
func TestStageOnCoveredPool(t *testing.T) {
	testutil.RequireRoot(t)
	for _, w := range coverWays {
		t.Run(w.name, func(t *testing.T) {
			ctx := context.Background()
			dir, state := newCoveredPool(t)
			a := coveredNode(t, dir, state, fake.New())
			id, vc := createPublished(t, a)

			uncover := w.fault(t, dir)
			before := tree(t, dir)
			_, _ = a.Probe(ctx, &csi.ProbeRequest{}) // the pool's checks run
			staging := filepath.Join(a.root, "staging")
			_, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
			wantCode(t, err, codes.Unavailable)
			if err := a.renew(t); !errors.Is(err, pool.ErrUnavailable) {
				t.Fatalf("renewal where the pool does not show: %v, want cut off", err)
			}
			if after := tree(t, dir); after != before {
				t.Fatalf("the covered path changed:\nbefore:\n%s\nafter:\n%s", before, after)
			}
			// kubelet's retry, once the pool shows again.
			uncover()
			if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
				t.Fatalf("stage once the pool is back: %v", err)
			}
		})
	}
}

// TestCoveredPoolFences: whichever way a node's pool leaves its path, with an
// image staged read-write from it, Probe lays nothing out there, the renewal
// fails as cut off (a lease renewed into a filesystem covering the pool would
// keep the fence quiet while no other node sees it), and at the lease's
// duration the node fences its device. The same after a restart of the node
// plugin with the path covered: a new process has not seen the pool, but its
// records and the kernel say this node writes to it.
func TestCoveredPoolFences(t *testing.T) {
	testutil.RequireRoot(t)
	for _, restart := range []bool{false, true} {
		for _, w := range coverWays {
			name := w.name
			if restart {
				name = "restart/" + name
			}
			t.Run(name, func(t *testing.T) { coveredPoolFences(t, w.fault, restart) })
		}
	}
}

func coveredPoolFences(t *testing.T, fault func(t *testing.T, dir string) func(), restart bool) {
	ctx := context.Background()
	dir, state := newCoveredPool(t)
	h := fake.New()
	a := coveredNode(t, dir, state, h)
	createStaged(t, a)
	dev := mustFind(t, h, dir)
	if err := a.renew(t); err != nil {
		t.Fatalf("renewal in the pool: %v", err)
	}

	fault(t, dir)
	before := tree(t, dir)
	if restart {
		// The node plugin killed and started again over the same records
		// and kernel, the path covered meanwhile.
		a = coveredNode(t, dir, state, h)
	}
	_, _ = a.Probe(ctx, &csi.ProbeRequest{})
	err := a.renew(t)
	if err == nil {
		t.Fatal("the lease was renewed where the path does not show the pool")
	}
	if !errors.Is(err, pool.ErrUnavailable) {
		t.Fatalf("renewal: %v, want cut off (unavailable)", err)
	}
	_, _ = a.Probe(ctx, &csi.ProbeRequest{})
	a.clock.add(lease.Default.Duration)
	a.leases.FenceExpired(ctx)
	waitFenced(t, h, dev)
	if is := a.leases.FencedIssue(a.pools.Pool("shared")); is == nil || !strings.Contains(is.Message, "cut off from the pool") {
		t.Fatalf("fence cause: %+v", is)
	}
	if after := tree(t, dir); after != before {
		t.Fatalf("the path changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// TestRenewalChecksWriters: the renewal checks only the images whose loop
// device is attached. A stale record (its device detached, its image
// rightly deleted since) fails nothing; an attached device whose image the
// path no longer shows (the file replaced) fails the renewal as cut off.
func TestRenewalChecksWriters(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	dir, state := newCoveredPool(t)
	h := fake.New()
	a := coveredNode(t, dir, state, h)
	id, _, staging := createStaged(t, a)
	vid, _ := pool.ParseVolumeID(id)
	image := a.pools.Pool("shared").ImagePath(vid)
	// The image replaced by another file under its name: the device holds
	// the old one.
	if err := os.Rename(image, image+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := a.renew(t); !errors.Is(err, fence.ErrWritersElsewhere) || !errors.Is(err, pool.ErrUnavailable) {
		t.Fatalf("renewal with the device's image gone from the path: %v", err)
	}
	// Detached without its record dropped (a crash between the two), and
	// the image deleted: a stale record.
	if err := h.UnmountChecked(ctx, staging, nil); err != nil {
		t.Fatal(err)
	}
	if err := h.Detach(ctx, image); err != nil { // the fake kernel's name of it
		t.Fatal(err)
	}
	if devs, _ := h.List(0); len(devs) != 0 {
		t.Fatalf("still attached: %+v", devs)
	}
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(image + ".old"); err != nil {
		t.Fatal(err)
	}
	if recs, err := a.PoolRecords("shared"); err != nil || len(recs) == 0 {
		t.Fatalf("the stale record is gone: %v %v", recs, err)
	}
	if err := a.renew(t); err != nil {
		t.Fatalf("a stale record failed the renewal: %v", err)
	}
	// A record whose device never was (a crash before the attach).
	rec := layout.StageRecord{Pool: "shared", Volume: id, FileDev: 1, FileIno: 2, At: time.Now()}
	if err := state.Put(layout.StagesKind, rec.Key(), rec); err != nil {
		t.Fatal(err)
	}
	if err := a.renew(t); err != nil {
		t.Fatalf("a record without a device failed the renewal: %v", err)
	}
}

// TestShareReplacedByAnEmptyExport: a share whose pool this process served
// shows an empty filesystem (the export replaced by an empty one, or an
// empty tmpfs over its mount): a CreateVolume whose StorageClass names the
// share does not lay a new pool out on it, a stage of a volume of the pool
// answers UNAVAILABLE, and nothing is written there.
func TestShareReplacedByAnEmptyExport(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	shares := filepath.Join(t.TempDir(), "shares")
	td, _ := newShareDriver(t, shares, "node-1")
	vc := mountCap(rwx, "")
	resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: nfsParams()})
	if err != nil {
		t.Fatal(err)
	}
	v := resp.GetVolume()
	vid, err := pool.ParseVolumeID(v.GetVolumeId())
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := vid.ShareRef()
	path := filepath.Join(shares, ref.PoolName())
	if _, err := os.Stat(filepath.Join(path, "pool.json")); err != nil {
		t.Fatalf("no pool laid out on the share: %v", err)
	}

	testutil.Tmpfs(t, path, "4g") // the export, empty now
	_, err = td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-2", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: nfsParams()})
	wantCode(t, err, codes.Unavailable)
	_, err = td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: v.GetVolumeId(), StagingTargetPath: filepath.Join(td.root, "staging"), VolumeCapability: vc, VolumeContext: v.GetVolumeContext(),
	})
	wantCode(t, err, codes.Unavailable)
	if ents, err := os.ReadDir(path); err != nil || len(ents) != 0 {
		t.Fatalf("the empty export got %v (%v)", ents, err)
	}
}
