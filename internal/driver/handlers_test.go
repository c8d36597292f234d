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
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/pool"
)

var errInjected = errors.New("injected fault")

// create makes a ready volume and returns its ID.
func (td *testDriver) create(t *testing.T, name string, vc *csi.VolumeCapability, params map[string]string) string {
	t.Helper()
	resp, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: name, VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: params,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
	})
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return resp.GetVolume().GetVolumeId()
}

func (td *testDriver) stage(id string, vc *csi.VolumeCapability) error {
	_, err := td.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: filepath.Join(td.root, "staging", id), VolumeCapability: vc,
	})
	return err
}

func (td *testDriver) publish(id string, vc *csi.VolumeCapability, readOnly bool) error {
	_, err := td.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: filepath.Join(td.root, "staging", id),
		TargetPath: filepath.Join(td.root, "target", id), VolumeCapability: vc, Readonly: readOnly,
	})
	return err
}

func wantCode(t *testing.T, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v (%v), want %v", status.Code(err), err, code)
	}
}

func TestStageRollsBack(t *testing.T) {
	cases := []struct {
		name   string
		method string
		nth    int
	}{
		{"attach fails", "Attach", 1},
		{"inspect fails", "DiskFormat", 1},
		{"mount fails", "Mount", 1},
		{"size fails", "Size", 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			vc := mountCap(rwo, "ext4")
			id := td.create(t, "v", vc, nil)
			td.host.Faults.FailNth(tc.method, 1, errInjected)
			if err := td.stage(id, vc); status.Code(err) != codes.Internal {
				t.Fatalf("stage with %s failing: %v, want Internal", tc.method, err)
			}
			if m := td.host.Mounts(); len(m) != 0 {
				t.Errorf("mounts left: %v", m)
			}
			if tc.method == "Mount" {
				if a := td.host.Attached(); len(a) != 0 {
					t.Errorf("a failed mount left the loop device attached: %v", a)
				}
			}
			v, err := td.pool.Load(pool.NewVolumeID("local", "v"))
			if err != nil || v.IsStaged() {
				t.Errorf("a failed stage was recorded: %+v %v", v, err)
			}
			// The retry converges.
			if err := td.stage(id, vc); err != nil {
				t.Fatalf("retry: %v", err)
			}
		})
	}
}

func TestCreateFormatFailureLeavesNoImage(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	td.host.Faults.FailNth("Format", 1, errInjected)
	_, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "xfs")},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 512 << 20},
	})
	wantCode(t, err, codes.Internal)
	vid := pool.NewVolumeID("local", "v")
	if _, err := td.pool.Images().Size(vid); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("a failed mkfs left an image: %v", err)
	}
	if _, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "xfs")},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 512 << 20},
	}); err != nil {
		t.Fatalf("retry: %v", err)
	}
}

func TestPublishFailureLeavesNothingMounted(t *testing.T) {
	for _, tc := range []struct {
		name   string
		vc     *csi.VolumeCapability
		method string
	}{
		{"filesystem", mountCap(rwo, "ext4"), "Bind"},
		{"block", blockCap(rwo), "BindBlock"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			id := td.create(t, "v", tc.vc, nil)
			if err := td.stage(id, tc.vc); err != nil {
				t.Fatal(err)
			}
			before := len(td.host.Mounts())
			td.host.Faults.FailNth(tc.method, 1, errInjected)
			wantCode(t, td.publish(id, tc.vc, false), codes.Internal)
			if n := len(td.host.Mounts()); n != before {
				t.Errorf("%d mounts after a failed publish, %d before", n, before)
			}
			if err := td.publish(id, tc.vc, false); err != nil {
				t.Fatalf("retry: %v", err)
			}
		})
	}
}

// An ENOENT from the system while the volume is there (no /dev/loop-control,
// a device node gone, a helper's missing file) is the node's fault, not a
// missing volume: INTERNAL, never NOT_FOUND, which a CO takes as "gone".
func TestSystemENOENTIsNoMissingVolume(t *testing.T) {
	enoent := &os.PathError{Op: "open", Path: "/dev/loop-control", Err: unix.ENOENT}
	for _, tc := range []struct {
		name, method string
		vc           *csi.VolumeCapability
		call         func(td *testDriver, id string, vc *csi.VolumeCapability) error
	}{
		{"stage attach", "Attach", mountCap(rwo, "ext4"), func(td *testDriver, id string, vc *csi.VolumeCapability) error { return td.stage(id, vc) }},
		{"stage mount", "Mount", mountCap(rwo, "ext4"), func(td *testDriver, id string, vc *csi.VolumeCapability) error { return td.stage(id, vc) }},
		{"publish bind", "Bind", mountCap(rwo, "ext4"), func(td *testDriver, id string, vc *csi.VolumeCapability) error {
			if err := td.stage(id, vc); err != nil {
				return err
			}
			return td.publish(id, vc, false)
		}},
		{"publish block", "BindBlock", blockCap(rwo), func(td *testDriver, id string, vc *csi.VolumeCapability) error {
			if err := td.stage(id, vc); err != nil {
				return err
			}
			return td.publish(id, vc, false)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			id := td.create(t, "v", tc.vc, nil)
			td.host.Faults.FailNth(tc.method, 1, enoent)
			err := tc.call(td, id, tc.vc)
			wantCode(t, err, codes.Internal)
			if !strings.Contains(status.Convert(err).Message(), "/dev/loop-control") {
				t.Errorf("the cause is lost: %v", err)
			}
		})
	}
}

// A cancelled call answers CANCELLED, whatever it was doing.
func TestCancelledCall(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := td.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(td.root, "s"), VolumeCapability: vc})
	wantCode(t, err, codes.Canceled)
}

func TestSnapshotFreezesAStagedVolume(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	resp, err := td.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: id})
	if err != nil {
		t.Fatal(err)
	}
	if !resp.GetSnapshot().GetReadyToUse() {
		t.Error("snapshot not ready")
	}
	if td.host.Faults.Calls("Freeze") != 1 || td.host.Faults.Calls("Thaw") != 1 {
		t.Errorf("freeze %d, thaw %d: want one each", td.host.Faults.Calls("Freeze"), td.host.Faults.Calls("Thaw"))
	}
	if f, _ := td.opts.State.Keys(freeze.RecordKind); len(f) != 0 {
		t.Errorf("freeze records left: %v", f)
	}
	// A filesystem that cannot be frozen still gets a crash-consistent snapshot.
	td.host.Faults.FailNth("Freeze", 1, errInjected)
	if _, err := td.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "s2", SourceVolumeId: id}); err != nil {
		t.Fatal(err)
	}
	if f, _ := td.opts.State.Keys(freeze.RecordKind); len(f) != 0 {
		t.Errorf("a failed freeze left its record: %v", f)
	}
}

// TestThawAfterCrash: a restart thaws what this node's own records say it
// froze, and, for a record an older version left in the pool, this node's own
// mount of that volume, never the path the record names.
func TestThawAfterCrash(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(map[bool]string{false: "node-local record", true: "older version's pool record"}[legacy], func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			vc := mountCap(rwo, "ext4")
			id := td.create(t, "v", vc, nil)
			if err := td.stage(id, vc); err != nil {
				t.Fatal(err)
			}
			staging := filepath.Join(td.root, "staging", id)
			vid, _ := pool.ParseVolumeID(id)
			dev, _, _ := td.Loops.Find(td.pool.ImagePath(vid))
			if legacy {
				// The path it names is not even looked at.
				if err := td.pool.Freezes().WriteRecord(vid, "node-1", "/nonexistent"); err != nil {
					t.Fatal(err)
				}
			} else if err := td.opts.State.Put(freeze.RecordKind, id, freeze.Record{Volume: id, Path: staging, Device: dev}); err != nil {
				t.Fatal(err)
			}
			td.host.FreezeDevice(dev)
			td.freezes.ThawAfterCrash(context.Background())
			waitFor(t, "the recovery is done", td.freezes.Recovered)
			if td.host.Frozen(staging) {
				t.Error("still frozen after restart")
			}
			if f, _ := td.pool.Freezes().Records(); len(f) != 0 {
				t.Errorf("pool records left: %v", f)
			}
			if keys, _ := td.opts.State.Keys(freeze.RecordKind); len(keys) != 0 {
				t.Errorf("node records left: %v", keys)
			}
		})
	}
}

// TestThawAfterCrashWaitsForBusyVolume: a volume another start-up task holds
// (the lease keeper's dropStaleRecords takes each recorded volume's lock while
// the kernel lists its loop devices) is thawed once that task lets go, never
// skipped. A skipped thaw left the filesystem frozen for good: the next freeze
// failed on it and dropped its record, the unstage unmounted it frozen, its
// superblock kept the loop device open, and the next stage fenced that device
// as a stale one and left it attached.
func TestThawAfterCrashWaitsForBusyVolume(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(td.root, "staging", id)
	vid, _ := pool.ParseVolumeID(id)
	dev, _, _ := td.Loops.Find(td.pool.ImagePath(vid))
	if err := td.opts.State.Put(freeze.RecordKind, id, freeze.Record{Volume: id, Path: staging, Device: dev}); err != nil {
		t.Fatal(err)
	}
	td.host.FreezeDevice(dev)
	release, err := td.locks.acquire(id, "dropStaleRecords")
	if err != nil {
		t.Fatal(err)
	}
	td.freezes.ThawAfterCrash(context.Background())
	time.Sleep(100 * time.Millisecond) // the recovery finds the volume busy
	release()
	waitFor(t, "the filesystem is thawed", func() bool { return !td.host.Frozen(staging) })
	waitFor(t, "the recovery is done", td.freezes.Recovered)
	waitFor(t, "the freeze record is dropped", func() bool { keys, _ := td.opts.State.Keys(freeze.RecordKind); return len(keys) == 0 })
}

func TestExpandOnline(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "xfs")
	resp, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: "v", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 512 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(td.root, "staging", id)
	ce, err := td.ControllerExpandVolume(context.Background(), &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
	if err != nil || !ce.GetNodeExpansionRequired() {
		t.Fatalf("ControllerExpandVolume: %v %v", ce, err)
	}
	td.host.Faults.FailNth("ResizeFS", 1, errInjected)
	req := &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: staging, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}}
	_, err = td.NodeExpandVolume(context.Background(), req)
	wantCode(t, err, codes.Internal)
	ne, err := td.NodeExpandVolume(context.Background(), req)
	if err != nil || ne.GetCapacityBytes() != 1<<30 {
		t.Fatalf("NodeExpandVolume: %v %v", ne, err)
	}
	st, err := td.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: staging})
	if err != nil {
		t.Fatal(err)
	}
	if total := st.GetUsage()[0].GetTotal(); total != 1<<30 {
		t.Errorf("stats total %d after growth, want %d", total, 1<<30)
	}
}

// A shared pool that is not mounted answers UNAVAILABLE, never NOT_FOUND.
func TestUnavailableSharedPool(t *testing.T) {
	td := newTestDriver(t, testOpts{modify: func(o *Options) {
		p, err := pool.Open(pool.Config{Name: "share", Path: "/nonexistent/poolcsi-share", Shared: true})
		if err != nil {
			t.Fatal(err)
		}
		o.Pools = append(o.Pools, p)
	}})
	_, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "ext4")}, Parameters: map[string]string{"pool": "share"},
	})
	wantCode(t, err, codes.Unavailable)
	_, err = td.GetCapacity(context.Background(), &csi.GetCapacityRequest{Parameters: map[string]string{"pool": "share"}})
	wantCode(t, err, codes.Unavailable)
}

// A source volume whose data cannot be measured for a reason other than its
// absence (here its image is a link that loops) is not NOT_FOUND: the
// snapshotter would take that for a volume gone and give up on the snapshot.
func TestSnapshotOfUnreadableDataIsNotNotFound(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	image := td.pool.ImagePath(vid)
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Base(image), image); err != nil {
		t.Fatal(err)
	}
	_, err = td.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: id})
	if status.Code(err) == codes.NotFound || err == nil {
		t.Fatalf("CreateSnapshot of a volume whose image loops: %v, want an error other than NOT_FOUND", err)
	}
}
