package driver

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// clock is a settable clock for the lease code.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// leaseNode is a driver of one node over a shared pool directory that other
// leaseNodes open too, each with its own fake kernel and clock.
type leaseNode struct {
	*Driver
	host  *fake.Host
	clock *clock
	root  string
}

func newLeaseNode(t *testing.T, dir, node string) *leaseNode {
	t.Helper()
	p, err := pool.Open(pool.Config{Name: "shared", Path: dir, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	h := fake.New()
	d, err := New(Options{Name: "poolcsi.test", Version: "test", NodeID: node, Mode: ModeAll, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: h, Loops: h, Devices: h, FS: h}})
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{t: time.Unix(100000, 0)}
	d.leases.SetClock(c.now)
	d.registerNode(context.Background())
	return &leaseNode{Driver: d, host: h, clock: c, root: t.TempDir()}
}

// renew renews the node's lease in every shared pool and waits for it.
func (n *leaseNode) renew(t *testing.T) error {
	t.Helper()
	var errs []error
	for _, p := range n.leases.SharedPools() {
		done := make(chan error, 1)
		n.leases.RenewAsync(context.Background(), p, done)
		errs = append(errs, <-done)
	}
	return errors.Join(errs...)
}

// cut makes every renewal of the node fail, as a pool cut off does.
func (n *leaseNode) cut() {
	n.leases.SetRenewal(func(*pool.Pool, pool.Lease) error { return errors.New("the pool does not answer") }, nil)
}

func newLeasePool(t *testing.T) string {
	dir := filepath.Join(t.TempDir(), "shared")
	if _, err := pool.Initialise(pool.Config{Name: "shared", Path: dir, Shared: true}); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestFenceAndForceDetach: node A stages an image read-write; A's pool is cut,
// A cannot renew its lease, and at the lease's duration it fences its loop
// device and reports NodeFenced. A controller asked to take the volume from A
// (a force-detach: A never unstaged) answers UNAVAILABLE until A's record has
// been unchanged for the lease's duration plus the margin by its own clock,
// then drops A's publish and stage records; node B then publishes and stages.
func TestFenceAndForceDetach(t *testing.T) {
	ctx := context.Background()
	dir, a, b, vc, id, staging := stagedOnA(t)
	devs := []string{mustFind(t, a.host, dir)}

	// The controller (on B) sees A's lease; A's pool is then cut.
	_, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
	wantCode(t, err, codes.Unavailable)
	a.cut()
	if err := a.renew(t); err == nil {
		t.Fatal("a renewal through a cut pool succeeded")
	}
	a.clock.add(lease.Default.Duration - time.Second)
	a.leases.FenceExpired(ctx)
	if f, _ := a.host.Fenced(devs[0]); f {
		t.Fatal("fenced before the lease's duration")
	}
	a.clock.add(time.Second)
	a.leases.FenceExpired(ctx)
	waitFenced(t, a.host, devs[0])
	vid, _ := pool.ParseVolumeID(id)
	issues, err := a.nodeIssues(a.pools.Pool("shared"), vid, staging, "")
	if err != nil || len(issues) != 1 || issues[0].Reason != health.ReasonNodeFenced {
		t.Fatalf("node health after the fence: %+v %v", issues, err)
	}

	// The controller waits the lease's duration plus the margin since it
	// first saw A's record unchanged.
	b.clock.add(lease.Default.Duration + lease.Default.Margin - time.Second)
	_, err = b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
	wantCode(t, err, codes.Unavailable)
	b.clock.add(time.Second)
	if _, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"}); err != nil {
		t.Fatalf("force-detach after the lease expired: %v", err)
	}
	v, err := b.pools.Pool("shared").Load(vid)
	if err != nil || len(v.Staged) != 0 || len(v.Published) != 0 {
		t.Fatalf("A's records after the force-detach: %+v %v", v, err)
	}
	if _, err := b.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-b", VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(b.root, "staging"), VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	// A's pool comes back: it renews again, its device stays fenced, and
	// staging the volume there again is refused.
	a.leases.SetRenewal(func(p *pool.Pool, l pool.Lease) error { return p.Leases().Write(l) }, nil)
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	if f, _ := a.host.Fenced(devs[0]); !f {
		t.Fatal("the fence was lifted when the pool came back")
	}
	_, err = a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
	if err == nil {
		t.Fatal("node A staged the volume again")
	}
}

// stagedOnA is where the lease tests start: nodes A and B over one shared pool
// (dir), and an ext4 image volume (id) that A has published and staged
// read-write at staging.
func stagedOnA(t *testing.T) (dir string, a, b *leaseNode, vc *csi.VolumeCapability, id, staging string) {
	t.Helper()
	dir = newLeasePool(t)
	a, b = newLeaseNode(t, dir, "node-a"), newLeaseNode(t, dir, "node-b")
	id, vc, staging = createStaged(t, a)
	return dir, a, b, vc, id, staging
}

func waitFenced(t *testing.T, h *fake.Host, dev string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if f, _ := h.Fenced(dev); f {
			return
		}
	}
	t.Fatalf("%s was not fenced", dev)
}

// TestForceDetachWaitsForALiveNode: a node that keeps renewing is never
// force-detached, however long the controller waits, nor one whose lease
// says released while it still has the volume staged; one that unstaged is
// detached at once.
func TestForceDetachWaitsForALiveNode(t *testing.T) {
	ctx := context.Background()
	dir := newLeasePool(t)
	a, b := newLeaseNode(t, dir, "node-a"), newLeaseNode(t, dir, "node-b")
	vc := mountCap(rwo, "ext4")
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(a.root, "s"), VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		_, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
		wantCode(t, err, codes.Unavailable)
		b.clock.add(lease.Default.Duration)
		if err := a.renew(t); err != nil {
			t.Fatal(err)
		}
	}
	// A released lease is no proof while the node still holds a read-write
	// stage record of the volume (anyone who can write the pool can write
	// "released"): still waited for.
	if err := b.pools.Pool("shared").Leases().Write(pool.Lease{Node: "node-a", Instance: "x", Counter: 99, Released: true}); err != nil {
		t.Fatal(err)
	}
	_, err = b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
	wantCode(t, err, codes.Unavailable)
	// A node that unstaged is detached at once.
	if _, err := a.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(a.root, "s")}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"}); err != nil {
		t.Fatalf("after the unstage: %v", err)
	}
}

// TestStageNeedsALease: a node that cannot renew its lease does not take an
// image read-write (it could not fence itself); read-only and dir volumes are
// not held up.
func TestStageNeedsALease(t *testing.T) {
	ctx := context.Background()
	a := newLeaseNode(t, newLeasePool(t), "node-a")
	a.cut()
	vc := mountCap(rwo, "ext4")
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: resp.GetVolume().GetVolumeId(), StagingTargetPath: filepath.Join(a.root, "s"), VolumeCapability: vc})
	wantCode(t, err, codes.Unavailable)
	if st := status.Convert(err); st.Message() == "" {
		t.Fatal("no reason given")
	}
	ro := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY, "ext4")
	if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: resp.GetVolume().GetVolumeId(), StagingTargetPath: filepath.Join(a.root, "r"), VolumeCapability: ro}); err != nil {
		t.Fatalf("a read-only stage: %v", err)
	}
}

// TestStageWaitsForARenewalUnderWay: a stage that needs a fresh lease while
// a renewal is already under way (the keeper's first one, on a pool slow to
// answer) waits for that renewal's outcome instead of answering that the
// pool is busy; and a renewal that fails under it still refuses the stage.
func TestStageWaitsForARenewalUnderWay(t *testing.T) {
	for _, tt := range []struct {
		name    string
		outcome error
		want    codes.Code
	}{
		{"the renewal succeeds", nil, codes.OK},
		{"the renewal fails", errors.New("the pool does not answer"), codes.Unavailable},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			a := newLeaseNode(t, newLeasePool(t), "node-a")
			vc := mountCap(rwo, "ext4")
			resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
			if err != nil {
				t.Fatal(err)
			}
			entered, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			a.leases.SetRenewal(func(p *pool.Pool, l pool.Lease) error {
				once.Do(func() { close(entered) })
				<-release
				if tt.outcome != nil {
					return tt.outcome
				}
				return p.Leases().Write(l)
			}, nil)
			for _, p := range a.leases.SharedPools() {
				a.leases.RenewAsync(ctx, p, nil) // the keeper's renewal, under way
			}
			<-entered
			staged := make(chan error, 1)
			go func() {
				sctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				_, err := a.NodeStageVolume(sctx, &csi.NodeStageVolumeRequest{VolumeId: resp.GetVolume().GetVolumeId(), StagingTargetPath: filepath.Join(a.root, "s"), VolumeCapability: vc})
				staged <- err
			}()
			select {
			case err := <-staged:
				t.Fatalf("the stage answered before the renewal under way ended: %v", err)
			case <-time.After(50 * time.Millisecond):
			}
			close(release)
			err = <-staged
			if status.Code(err) != tt.want {
				t.Fatalf("stage = %v, want code %s", err, tt.want)
			}
		})
	}
}

// TestRejoiningNodeFencesATakenVolume: node A stages an image read-write and
// goes silent without fencing (its node plugin was down, or the node was
// powered off with its kernel's mounts kept, as on one test machine); the
// controller force-detaches the volume once A's lease has expired, and node B
// stages it. When A comes back and kubelet unstages the stale stage, A fences
// its loop device before it unmounts: the filesystem's unmount must not write
// its journal and superblock into the image B has mounted.
func TestRejoiningNodeFencesATakenVolume(t *testing.T) {
	ctx := context.Background()
	dir, a, b, vc, id, staging := stagedOnA(t)
	devs := []string{mustFind(t, a.host, dir)}
	// A is silent: no renewal, no fence. The controller takes the volume.
	_, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
	wantCode(t, err, codes.Unavailable)
	b.clock.add(lease.Default.Duration + lease.Default.Margin)
	if _, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"}); err != nil {
		t.Fatalf("force-detach after the lease expired: %v", err)
	}
	if _, err := b.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-b", VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(b.root, "staging"), VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}

	// A is back, renews, and kubelet unstages what A left.
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	fencedAtUnmount := false
	a.host.Faults.OnCall("Unmount", func() { fencedAtUnmount, _ = a.host.Fenced(devs[0]) })
	if _, err := a.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("node A unstaging the volume B took: %v", err)
	}
	if !fencedAtUnmount {
		t.Fatal("node A unmounted the filesystem of a volume node B holds before fencing its loop device")
	}
	if left := backedUnder(a.host, dir); len(left) != 0 {
		t.Fatalf("node A kept loop devices of the pool: %v", left)
	}
	vid, _ := pool.ParseVolumeID(id)
	v, err := b.pools.Pool("shared").Load(vid)
	if err != nil || len(v.Staged) != 1 || v.Staged[0].Node != "node-b" {
		t.Fatalf("stage records after A rejoined: %+v %v", v.Staged, err)
	}

	// A node that still holds its record unmounts without a fence (B, here).
	b.host.Faults.OnCall("Unmount", func() {
		if f, _ := b.host.Fenced(mustFind(t, b.host, dir)); f {
			t.Error("node B fenced the volume it holds before unmounting it")
		}
	})
	if _, err := b.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(b.root, "staging")}); err != nil {
		t.Fatal(err)
	}
}

// backedUnder lists the fake loop devices, fenced or not, whose backing file is
// below dir.
func backedUnder(h *fake.Host, dir string) []string {
	all, _ := h.List(time.Second)
	var out []string
	for _, d := range all {
		if strings.HasPrefix(d.Backing, dir+"/") {
			out = append(out, d.Device)
		}
	}
	return out
}

func mustFind(t *testing.T, h *fake.Host, dir string) string {
	t.Helper()
	devs := backedUnder(h, dir)
	if len(devs) != 1 {
		t.Fatalf("loop devices under %s: %v", dir, devs)
	}
	return devs[0]
}

// TestStageAfterForceDetachStartsAnew: node A stages an image read-write and
// goes silent; the controller force-detaches it; the volume later comes back
// to A while A still has its old stage (kubelet stages again at the same
// path before it has unstaged the old one). A must not take the old mount as
// the stage: its view of the image is from before the force-detach. The old
// device is fenced, the staging path remounted from a new one.
func TestStageAfterForceDetachStartsAnew(t *testing.T) {
	ctx := context.Background()
	dir, a, b, vc, id, staging := stagedOnA(t)
	stage := func() {
		t.Helper()
		if _, err := a.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-a", VolumeCapability: vc}); err != nil {
			t.Fatal(err)
		}
		if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
			t.Fatal(err)
		}
	}
	old := mustFind(t, a.host, dir)
	// A retried stage keeps its device.
	stage()
	if again := mustFind(t, a.host, dir); again != old {
		t.Fatalf("a retried stage replaced device %s with %s", old, again)
	}
	_, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
	wantCode(t, err, codes.Unavailable)
	b.clock.add(lease.Default.Duration + lease.Default.Margin)
	if _, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"}); err != nil {
		t.Fatalf("force-detach after the lease expired: %v", err)
	}
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	fences, mounts := a.host.Faults.Calls("Fence"), a.host.Faults.Calls("Mount")
	stage()
	if a.host.Faults.Calls("Fence") != fences+1 || a.host.Faults.Calls("Mount") != mounts+1 {
		t.Fatalf("the stage after the force-detach fenced %d devices and mounted %d times; want the stale device %s fenced and the staging path mounted anew",
			a.host.Faults.Calls("Fence")-fences, a.host.Faults.Calls("Mount")-mounts, old)
	}
	fresh := mustFind(t, a.host, dir)
	if f, err := a.host.Fenced(fresh); f || err != nil {
		t.Fatalf("the new stage's device %s: fenced %t, %v", fresh, f, err)
	}
	shown := ""
	for _, m := range a.host.Mounts() {
		if m.Target == staging {
			shown = m.Device
		}
	}
	if shown != fresh {
		t.Fatalf("the staging path shows %q, the volume's device is %s", shown, fresh)
	}
}

// restartNode is node A's node plugin started again (a crash, an upgrade) on
// the same kernel and the same node-local records, its pool at path.
func restartNode(t *testing.T, old *leaseNode, path string) *leaseNode {
	t.Helper()
	p, err := pool.Open(pool.Config{Name: "shared", Path: path, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(Options{Name: "poolcsi.test", Version: "test", NodeID: old.opts.NodeID, Mode: ModeAll, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: old.host, Loops: old.host, Devices: old.host, FS: old.host}, State: old.opts.State})
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{t: old.clock.now()}
	d.leases.SetClock(c.now)
	return &leaseNode{Driver: d, host: old.host, clock: c, root: old.root}
}

// TestFenceFindsDevicesWithoutThePool: the fence finds this node's devices by
// its own records and the kernel's identity of their backing files, whatever
// the pool's path shows: a path the kernel no longer shows (a lazy unmount, a
// torn-down NFS client), a filesystem that fails the kernel's getattr (a FUSE
// daemon gone) or hangs, and the same after a restart of the node plugin while
// the pool is lost. With the old rule (the backing file's path under the
// pool's path) the lost path fenced nothing.
func TestFenceFindsDevicesWithoutThePool(t *testing.T) {
	for _, tc := range []struct {
		name    string
		lose    func(h *fake.Host, dir string)
		restart bool
	}{
		{"path gone", func(h *fake.Host, dir string) { h.LosePath(dir) }, false},
		{"path gone, plugin restarted", func(h *fake.Host, dir string) { h.LosePath(dir) }, true},
		{"backing file unidentified", func(h *fake.Host, dir string) {
			h.LosePath(dir)
			h.SetUnidentified(dir, errors.New("transport endpoint is not connected"))
		}, false},
		{"backing file unidentified, plugin restarted", func(h *fake.Host, dir string) {
			h.SetUnidentified(dir, mount.ErrNotIdentified)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			dir, a, _, _, id, staging := stagedOnA(t)
			dev := mustFind(t, a.host, dir)
			if err := a.renew(t); err != nil {
				t.Fatal(err)
			}
			a.cut()
			tc.lose(a.host, dir)
			if tc.restart {
				// The new process's pool path does not answer at all.
				a = restartNode(t, a, filepath.Join(t.TempDir(), "gone"))
				a.cut()
				_ = a.renew(t) // fails: the process's first try
				a.clock.add(lease.Default.Margin / 2)
			} else {
				a.clock.add(lease.Default.Duration)
			}
			a.leases.FenceExpired(ctx)
			waitFenced(t, a.host, dev)
			st := a.leases.States()
			if len(st) != 1 || !st[0].Fenced || st[0].FailedClosed {
				t.Fatalf("lease state after the fence: %+v", st)
			}
			if !tc.restart {
				vid, _ := pool.ParseVolumeID(id)
				issues, err := a.nodeIssues(a.pools.Pool("shared"), vid, staging, "")
				if err != nil || len(issues) != 1 || issues[0].Reason != health.ReasonNodeFenced {
					t.Fatalf("node health after the fence: %+v %v", issues, err)
				}
			}
		})
	}
}

// TestFenceFailsClosed: a fence that does not find the device of a read-write
// stage its records hold fences every device it cannot rule out (those on the
// pool's filesystem, those it cannot identify), and says so in the metric
// state, the volume's health and the storage health. A device of another
// filesystem that the kernel identifies is left alone.
func TestFenceFailsClosed(t *testing.T) {
	ctx := context.Background()
	dir, a, _, _, id, staging := stagedOnA(t)
	dev := mustFind(t, a.host, dir)
	// Another filesystem's image (/dev/shm: a tmpfs), attached on the node
	// by someone else.
	shm, err := os.MkdirTemp("/dev/shm", "poolcsi-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	other := filepath.Join(shm, "other.img")
	if err := os.WriteFile(other, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	otherDev, err := a.host.Attach(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	// The record names the device otherwise than the kernel shows it now
	// (records from before the device was renumbered, say), and the kernel
	// cannot identify the image.
	vid, _ := pool.ParseVolumeID(id)
	recs, err := a.VolumeRecords(vid)
	if err != nil || len(recs) != 1 || recs[0].Device != dev || recs[0].ReadOnly {
		t.Fatalf("node A's records of the stage: %+v %v", recs, err)
	}
	r := recs[0]
	r.Device = "/dev/fakeloop99"
	if err := a.opts.State.Put(layout.StagesKind, r.Key(), r); err != nil {
		t.Fatal(err)
	}
	a.host.SetUnidentified(dir, mount.ErrNotIdentified)
	a.cut()
	a.clock.add(lease.Default.Duration)
	a.leases.FenceExpired(ctx)
	waitFenced(t, a.host, dev)
	if f, _ := a.host.Fenced(otherDev); f {
		t.Fatal("the fence took a device of another filesystem that the kernel identified")
	}
	if st := a.leases.States(); len(st) != 1 || !st[0].FailedClosed {
		t.Fatalf("lease state after a fence that failed closed: %+v", st)
	}
	issues, err := a.nodeIssues(a.pools.Pool("shared"), vid, staging, "")
	if err != nil || len(issues) != 1 || issues[0].Reason != health.ReasonFenceFailedClosed {
		t.Fatalf("node health after a fence that failed closed: %+v %v", issues, err)
	}
	sh, err := a.NodeGetStorageHealth(ctx, &csi.NodeGetStorageHealthRequest{})
	if err != nil || !slices.ContainsFunc(sh.GetBackendHealth(), func(b *csi.NodeGetStorageHealthResponse_StorageBackendHealth) bool {
		return b.GetReason() == health.ReasonFenceFailedClosed
	}) {
		t.Fatalf("storage health after a fence that failed closed: %+v %v", sh, err)
	}
}

// TestFenceOfNothing: a node whose records hold no stage of the pool fences
// nothing, fails nothing closed, and does not claim to have stopped I/O.
func TestFenceOfNothing(t *testing.T) {
	ctx := context.Background()
	a := newLeaseNode(t, newLeasePool(t), "node-a")
	other := filepath.Join(t.TempDir(), "other.img")
	if err := os.WriteFile(other, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	otherDev, err := a.host.Attach(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	a.cut()
	_ = a.renew(t)
	a.clock.add(lease.Default.Duration)
	a.leases.FenceExpired(ctx)
	time.Sleep(20 * time.Millisecond)
	if f, _ := a.host.Fenced(otherDev); f {
		t.Fatal("a fence with nothing staged took a device")
	}
	if st := a.leases.States(); len(st) != 1 || !st[0].Fenced || st[0].FailedClosed {
		t.Fatalf("lease state: %+v", st)
	}
}

// TestStageRecords: a stage of a shared pool's image records it before it
// attaches (a failed attach leaves no record), with the device once attached;
// the record stays while the device does (a detach that fails) and keeps the
// node from releasing its lease; it goes with the detach.
func TestStageRecords(t *testing.T) {
	ctx := context.Background()
	dir := newLeasePool(t)
	a := newLeaseNode(t, dir, "node-a")
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	vc := mountCap(rwo, "ext4")
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	vid, _ := pool.ParseVolumeID(id)
	staging := filepath.Join(a.root, "s")
	records := func() []layout.StageRecord {
		t.Helper()
		recs, err := a.VolumeRecords(vid)
		if err != nil {
			t.Fatal(err)
		}
		return recs
	}

	var atAttach []layout.StageRecord
	a.host.Faults.OnCall("Attach", func() { atAttach = records() })
	a.host.Faults.FailNth("Attach", 1, errors.New("no free loop device"))
	if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err == nil {
		t.Fatal("the stage went through a failed attach")
	}
	if len(atAttach) != 1 || atAttach[0].Device != "" || atAttach[0].ReadOnly {
		t.Fatalf("records when the attach began: %+v", atAttach)
	}
	if recs := records(); len(recs) != 0 {
		t.Fatalf("records after a failed attach: %+v", recs)
	}

	if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	dev := mustFind(t, a.host, dir)
	recs := records()
	if len(recs) != 1 || recs[0].Device != dev {
		t.Fatalf("records after the stage: %+v", recs)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(a.pools.Pool("shared").ImagePath(vid), &st); err != nil || recs[0].FileDev != st.Dev || recs[0].FileIno != st.Ino {
		t.Fatalf("record %+v, image %d:%d %v", recs[0], st.Dev, st.Ino, err)
	}
	if keys, _ := a.opts.State.Keys(layout.PoolsKind); len(keys) != 1 {
		t.Fatalf("pool records: %v", keys)
	}

	// A detach that fails keeps the record, and the lease unreleased.
	a.host.Faults.FailNth("Detach", 1, errors.New("device busy"))
	if _, err := a.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err == nil {
		t.Fatal("the unstage went through a failed detach")
	}
	if recs := records(); len(recs) != 1 {
		t.Fatalf("records after a failed detach: %+v", recs)
	}
	a.leases.ReleaseLeases(ctx)
	if l, ok, err := a.pools.Pool("shared").Leases().Read("node-a"); err != nil || !ok || l.Released {
		t.Fatalf("lease released while a recorded device is attached: %+v %v %v", l, ok, err)
	}
	if _, err := a.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if recs := records(); len(recs) != 0 {
		t.Fatalf("records after the unstage: %+v", recs)
	}
	a.leases.ReleaseLeases(ctx)
	if l, ok, err := a.pools.Pool("shared").Leases().Read("node-a"); err != nil || !ok || !l.Released {
		t.Fatalf("lease not released with nothing staged: %+v %v %v", l, ok, err)
	}

	// A record whose device is gone (a crash between a detach and the
	// record's deletion) goes when the lease keeper starts.
	if err := a.opts.State.Put(layout.StagesKind, recs[0].Key(), recs[0]); err != nil {
		t.Fatal(err)
	}
	a.leases.DropStaleRecords(ctx)
	if recs := records(); len(recs) != 0 {
		t.Fatalf("stale records after the lease keeper's start: %+v", recs)
	}
}

// TestAdoptDevicesStagedBeforeRecords: a device staged by a node plugin from
// before the node kept records (an upgrade with volumes staged) is recorded
// when the lease keeper starts, while the pool answers, so a later fence
// finds it; a device whose volume's record does not name this node is not.
func TestAdoptDevicesStagedBeforeRecords(t *testing.T) {
	ctx := context.Background()
	dir, a, _, _, id, _ := stagedOnA(t)
	dev := mustFind(t, a.host, dir)
	vid, _ := pool.ParseVolumeID(id)
	recs, err := a.VolumeRecords(vid)
	if err != nil || len(recs) != 1 {
		t.Fatalf("records: %+v %v", recs, err)
	}
	if err := a.opts.State.Delete(layout.StagesKind, recs[0].Key()); err != nil {
		t.Fatal(err)
	}
	// Another node's plugin on the same kernel and path (as in tests) does
	// not take A's device for its own.
	other, err := New(Options{Name: "poolcsi.test", Version: "test", NodeID: "node-c", Mode: ModeAll, Pools: a.opts.Pools,
		Host: layout.Host{Mounts: a.host, Loops: a.host, Devices: a.host, FS: a.host}})
	if err != nil {
		t.Fatal(err)
	}
	other.leases.AdoptDevices(ctx, other.pools.Pool("shared"))
	if keys, _ := other.opts.State.Keys(layout.StagesKind); len(keys) != 0 {
		t.Fatalf("node C adopted %v", keys)
	}
	a.leases.AdoptDevices(ctx, a.pools.Pool("shared"))
	recs, err = a.VolumeRecords(vid)
	if err != nil || len(recs) != 1 || recs[0].Device != dev || recs[0].ReadOnly {
		t.Fatalf("records after the adoption: %+v %v", recs, err)
	}
	a.host.LosePath(dir)
	a.cut()
	_ = a.renew(t)
	a.clock.add(lease.Default.Duration)
	a.leases.FenceExpired(ctx)
	waitFenced(t, a.host, dev)
}

// TestFenceFiresAgainAfterThePoolCameBack: a fence episode ends with the
// first renewal that started after the fence; the pool lost again fences
// again, so a volume staged read-write between the two losses does not go on
// writing after another node takes it. While fenced and not renewed since, no
// volume is taken read-write.
func TestFenceFiresAgainAfterThePoolCameBack(t *testing.T) {
	ctx := context.Background()
	dir, a, _, vc, _, _ := stagedOnA(t)
	v1 := mustFind(t, a.host, dir)
	restore := func() {
		a.leases.SetRenewal(func(p *pool.Pool, l pool.Lease) error { return p.Leases().Write(l) }, nil)
	}
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	a.cut()
	a.clock.add(lease.Default.Duration)
	a.leases.FenceExpired(ctx)
	waitFenced(t, a.host, v1)

	// A renewal that started before the fence and succeeds after it does
	// not end the episode: no volume is taken read-write meanwhile.
	a.leases.SetLastRenewal("shared", a.clock.now().Add(-time.Second))
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc2", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id2 := resp.GetVolume().GetVolumeId()
	if _, err := a.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id2, NodeId: "node-a", VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	staging2 := filepath.Join(a.root, "staging2")
	_, err = a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id2, StagingTargetPath: staging2, VolumeCapability: vc})
	wantCode(t, err, codes.Unavailable)

	// The pool is back: a renewal ends the episode, and V2 is staged.
	restore()
	a.clock.add(time.Second)
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	if st := a.leases.States(); len(st) != 1 || st[0].Fenced {
		t.Fatalf("lease state after a renewal that started after the fence: %+v", st)
	}
	if f, _ := a.host.Fenced(v1); !f {
		t.Fatal("the fence of V1's device was lifted")
	}
	if _, err := a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id2, StagingTargetPath: staging2, VolumeCapability: vc}); err != nil {
		t.Fatalf("staging V2 once the pool renews again: %v", err)
	}
	var v2 string
	for _, d := range backedUnder(a.host, dir) {
		if d != v1 {
			v2 = d
		}
	}
	if v2 == "" {
		t.Fatal("V2 has no loop device")
	}

	// The pool is lost again: V2's device is fenced too.
	a.cut()
	a.clock.add(lease.Default.Duration)
	a.leases.FenceExpired(ctx)
	waitFenced(t, a.host, v2)
	if st := a.leases.States(); len(st) != 1 || !st[0].Fenced {
		t.Fatalf("lease state after the second fence: %+v", st)
	}
}

// TestPoolAddedLaterCountsFromItsAddition: the startup allowance (a pool's
// time without a renewal counted from the process's start) applies to the
// pools served at start and those the node's records name; a share's pool
// added later counts from when it was added, and is not fenced at the next
// tick (which set it fenced, with nothing to fence, and disarmed its fence).
func TestPoolAddedLaterCountsFromItsAddition(t *testing.T) {
	ctx := context.Background()
	dir, a, _, _, _, _ := stagedOnA(t)
	dev := mustFind(t, a.host, dir)
	a = restartNode(t, a, dir)
	a.cut()
	a.leases.StartLeases(ctx, a.clock.now())
	a.clock.add(lease.Default.Margin / 2)
	dir2 := filepath.Join(t.TempDir(), "share2")
	if _, err := pool.Initialise(pool.Config{Name: "share2", Path: dir2, Shared: true}); err != nil {
		t.Fatal(err)
	}
	p2, err := pool.Open(pool.Config{Name: "share2", Path: dir2, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	a.pools.Add(p2)
	a.leases.FenceExpired(ctx)
	waitFenced(t, a.host, dev)
	st := a.leases.States()
	if len(st) != 2 || st[0].Pool != "share2" || st[0].Fenced || st[1].Pool != "shared" || !st[1].Fenced {
		t.Fatalf("lease states half the margin after the start, share2 just added: %+v", st)
	}
	// share2 keeps its own allowance: not renewed for half the margin
	// since it was added, it fences.
	a.clock.add(lease.Default.Margin / 2)
	a.leases.FenceExpired(ctx)
	if st := a.leases.States(); !st[0].Fenced {
		t.Fatalf("lease states half the margin after share2 was added: %+v", st)
	}
}

// TestFenceOfAPoolNotServed: a node plugin restarted while a share's pool is
// lost does not serve it (recoverShares skips a share whose mount is gone),
// yet its records name read-write stages of it whose devices still write:
// the lease keeper fences it by name, after the same startup allowance.
func TestFenceOfAPoolNotServed(t *testing.T) {
	ctx := context.Background()
	dir, a, _, _, _, _ := stagedOnA(t)
	dev := mustFind(t, a.host, dir)
	a.host.LosePath(dir)
	// The restarted process serves another pool only.
	other := filepath.Join(t.TempDir(), "other")
	if _, err := pool.Initialise(pool.Config{Name: "other", Path: other}); err != nil {
		t.Fatal(err)
	}
	p, err := pool.Open(pool.Config{Name: "other", Path: other})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(Options{Name: "poolcsi.test", Version: "test", NodeID: "node-a", Mode: ModeAll, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: a.host, Loops: a.host, Devices: a.host, FS: a.host}, State: a.opts.State})
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{t: a.clock.now()}
	d.leases.SetClock(c.now)
	d.leases.StartLeases(ctx, c.now())
	c.add(lease.Default.Margin/2 - time.Second)
	d.leases.FenceExpired(ctx)
	time.Sleep(20 * time.Millisecond)
	if f, _ := a.host.Fenced(dev); f {
		t.Fatal("fenced before the startup allowance ran out")
	}
	c.add(time.Second)
	d.leases.FenceExpired(ctx)
	waitFenced(t, a.host, dev)
	if st := d.leases.States(); len(st) != 1 || st[0].Pool != "shared" || !st[0].Fenced {
		t.Fatalf("lease states: %+v", st)
	}
}

// TestStageRacingTheFence: a stage whose lease was fresh when it began, but
// which stalled before its attach for longer than the lease's duration (the
// fence ran meanwhile, before the device existed), does not leave the new
// device writing: it fences and detaches it and answers UNAVAILABLE.
func TestStageRacingTheFence(t *testing.T) {
	ctx := context.Background()
	dir := newLeasePool(t)
	a := newLeaseNode(t, dir, "node-a")
	vc := mountCap(rwo, "ext4")
	resp, err := a.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	if _, err := a.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-a", VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	if err := a.renew(t); err != nil {
		t.Fatal(err)
	}
	a.host.Faults.OnCall("Attach", func() {
		a.host.Faults.OnCall("Attach", nil)
		a.cut()
		a.clock.add(lease.Default.Duration)
		a.leases.FenceExpired(ctx)
	})
	_, err = a.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(a.root, "s"), VolumeCapability: vc})
	wantCode(t, err, codes.Unavailable)
	time.Sleep(20 * time.Millisecond)
	all, _ := a.host.List(time.Second)
	for _, ld := range all {
		if !ld.Fenced {
			t.Fatalf("a loop device the stage attached after the fence takes I/O: %+v", ld)
		}
	}
}
