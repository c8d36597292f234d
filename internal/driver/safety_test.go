package driver

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// tree fingerprints everything under root (names, types, sizes, contents of
// small files), so a test can prove a refused call changed nothing on disk.
func tree(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(root, func(path string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(path)
		if err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s %v %d", strings.TrimPrefix(path, root), fi.Mode().Type(), fi.Size())
		if fi.Mode().IsRegular() && fi.Size() < 1<<16 && filepath.Base(path) != "lock" {
			raw, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			fmt.Fprintf(&b, " %x", sha256.Sum256(raw))
		}
		b.WriteByte('\n')
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestDeleteRefusesUnreadableMetadata(t *testing.T) {
	for _, tc := range []struct {
		name string
		meta func(old []byte) []byte
	}{
		{"garbage", func([]byte) []byte { return []byte("{not json") }},
		{"newer schema", func(old []byte) []byte {
			return []byte(strings.Replace(string(old), `"schemaVersion": 1`, `"schemaVersion": 99`, 1))
		}},
		{"negative capacity", func(old []byte) []byte {
			return []byte(strings.Replace(string(old), `"capacityBytes": 67108864`, `"capacityBytes": -16777216`, 1))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
			vid, _ := pool.ParseVolumeID(id)
			meta := td.pool.MetadataPath(vid)
			old, err := os.ReadFile(meta)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(meta, tc.meta(old), 0o600); err != nil {
				t.Fatal(err)
			}
			before := tree(t, td.pool.Path())
			_, err = td.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id})
			wantCode(t, err, codes.FailedPrecondition)
			if after := tree(t, td.pool.Path()); after != before {
				t.Errorf("a refused delete changed the pool:\n%s\n---\n%s", before, after)
			}
			scan, err := td.ControllerGetVolumeHealth(context.Background(), &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
			if err != nil || len(scan.GetVolumeHealth().GetHealthStatuses()) == 0 {
				t.Errorf("damaged metadata is not reported abnormal: %v %v", scan, err)
			}
		})
	}
}

func TestHugeSizesAreOutOfRange(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	before := tree(t, td.pool.Path())
	for _, size := range []int64{math.MaxInt64, math.MaxInt64 - 1<<20 + 2, pool.MaxCapacity + 1} {
		_, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
			Name: "huge", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "ext4")},
			CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		})
		wantCode(t, err, codes.OutOfRange)
	}
	if after := tree(t, td.pool.Path()); after != before {
		t.Errorf("a refused create changed the pool:\n%s\n---\n%s", before, after)
	}
	id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
	before = tree(t, td.pool.Path())
	for _, size := range []int64{math.MaxInt64, pool.MaxCapacity + 1} {
		_, err := td.ControllerExpandVolume(context.Background(), &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: size}})
		wantCode(t, err, codes.OutOfRange)
	}
	if after := tree(t, td.pool.Path()); after != before {
		t.Errorf("a refused expand changed the pool:\n%s\n---\n%s", before, after)
	}
}

// NodeUnpublishVolume takes down only the named volume's mount: not another
// volume's pod mount, not a foreign mount at the path.
func TestUnpublishOnlyItsOwnMount(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "ext4")
	a := td.create(t, "a", vc, nil)
	b := td.create(t, "b", vc, nil)
	dirVol := td.create(t, "d", mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, ""), map[string]string{"layout": "dir"})
	for _, id := range []string{a, b, dirVol} {
		c := vc
		if id == dirVol {
			c = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
		}
		if err := td.stage(id, c); err != nil {
			t.Fatal(err)
		}
		if err := td.publish(id, c, false); err != nil {
			t.Fatal(err)
		}
	}
	foreign := filepath.Join(td.root, "foreign")
	if err := os.MkdirAll(filepath.Join(td.root, "elsewhere"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := td.host.Bind(context.Background(), filepath.Join(td.root, "elsewhere"), foreign, false, nil); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ id, target string }{
		{a, filepath.Join(td.root, "target", b)},
		{a, filepath.Join(td.root, "target", dirVol)},
		{dirVol, filepath.Join(td.root, "target", a)},
		{a, foreign},
		{"nopool.0123456789abcdef0123456789abcdef", filepath.Join(td.root, "target", a)},
	} {
		mountsBefore := len(td.host.Mounts())
		_, err := td.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: tc.id, TargetPath: tc.target})
		wantCode(t, err, codes.FailedPrecondition)
		if len(td.host.Mounts()) != mountsBefore {
			t.Fatalf("unpublish of %s at %s took a mount down", tc.id, tc.target)
		}
	}
	for _, id := range []string{a, b, dirVol} {
		if _, err := td.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: filepath.Join(td.root, "target", id)}); err != nil {
			t.Fatalf("own unpublish of %s: %v", id, err)
		}
	}
}

// Two nodes cannot both stage one image volume read-write, even when the CO
// never called ControllerPublishVolume: the stage record fences like a publish
// record. Readers on many nodes are fine; a failed stage takes its record back.
func TestStageRecordsFence(t *testing.T) {
	td := newTestDriver(t, testOpts{shared: true})
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	// Node 2: another driver over the same pool directory.
	other := newTestDriver(t, testOpts{modify: func(o *Options) {
		o.NodeID = "node-2"
		o.Pools = []*pool.Pool{td.pool}
	}})
	other.registerNode(context.Background())
	err := other.stage(id, vc)
	wantCode(t, err, codes.FailedPrecondition)
	ro := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, "ext4")
	wantCode(t, other.stage(id, ro), codes.FailedPrecondition) // a reader beside a writer
	// The controller refuses to publish it elsewhere too.
	_, err = td.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-2", VolumeCapability: vc})
	wantCode(t, err, codes.FailedPrecondition)
	if _, err := td.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(td.root, "staging", id)}); err != nil {
		t.Fatal(err)
	}
	// Readers on both nodes.
	if err := td.stage(id, ro); err != nil {
		t.Fatal(err)
	}
	if err := other.stage(id, ro); err != nil {
		t.Fatalf("second reader: %v", err)
	}
	// A stage that fails leaves no record behind to fence anyone.
	td2 := newTestDriver(t, testOpts{})
	id2 := td2.create(t, "w", vc, nil)
	td2.host.Faults.FailNth("Mount", 1, errInjected)
	wantCode(t, td2.stage(id2, vc), codes.Internal)
	v, err := td2.pool.Load(pool.NewVolumeID("local", "w"))
	if err != nil || len(v.Staged) != 0 {
		t.Fatalf("failed stage left records: %+v %v", v, err)
	}
}

// Two controllers creating one name on a shared pool at once: one formats, the
// other waits for it and answers the same volume; neither formats twice.
func TestConcurrentCreateFormatsOnce(t *testing.T) {
	a := newTestDriver(t, testOpts{shared: true})
	b := newTestDriver(t, testOpts{modify: func(o *Options) { o.Pools = []*pool.Pool{a.pool} }})
	a.host.Faults.OnCall("Format", func() { time.Sleep(200 * time.Millisecond) })
	b.host.Faults.OnCall("Format", func() { time.Sleep(200 * time.Millisecond) })
	req := &csi.CreateVolumeRequest{Name: "race", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "xfs")}, CapacityRange: &csi.CapacityRange{RequiredBytes: 512 << 20}}
	type result struct {
		id  string
		err error
	}
	out := make(chan result, 2)
	for _, d := range []*testDriver{a, b} {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp, err := d.CreateVolume(ctx, req)
			out <- result{resp.GetVolume().GetVolumeId(), err}
		}()
	}
	r1, r2 := <-out, <-out
	if r1.err != nil || r2.err != nil || r1.id != r2.id {
		t.Fatalf("racing creates: %v %v / %s %s", r1.err, r2.err, r1.id, r2.id)
	}
	if n := a.host.Faults.Calls("Format") + b.host.Faults.Calls("Format"); n != 1 {
		t.Fatalf("the image was formatted %d times", n)
	}
}

// The pool's contents are untrusted: a symbolic link put in place of a volume's
// image, data directory or whole directory is never followed. Nothing outside
// the pool is attached, formatted, mounted or copied, and health reports it.
func TestPoolLinksAreNeverFollowed(t *testing.T) {
	type setup struct {
		name   string
		layout string
		// plant replaces part of volume id with a link to outside (a file or
		// directory in td.root/outside).
		plant func(t *testing.T, td *testDriver, vid pool.VolumeID, outside string)
	}
	link := func(t *testing.T, target, at string) {
		t.Helper()
		if err := os.RemoveAll(at); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, at); err != nil {
			t.Fatal(err)
		}
	}
	cases := []setup{
		{"image is a link to a file outside", "image", func(t *testing.T, td *testDriver, vid pool.VolumeID, outside string) {
			link(t, filepath.Join(outside, "victim.img"), td.pool.ImagePath(vid))
		}},
		{"image is a link to another volume's image", "image", func(t *testing.T, td *testDriver, vid pool.VolumeID, _ string) {
			other := pool.NewVolumeID("local", "other")
			link(t, td.pool.ImagePath(other), td.pool.ImagePath(vid))
		}},
		{"volume directory is a link", "image", func(t *testing.T, td *testDriver, vid pool.VolumeID, outside string) {
			if err := os.Rename(td.pool.Dir(vid), filepath.Join(outside, "moved")); err != nil {
				t.Fatal(err)
			}
			link(t, filepath.Join(outside, "moved"), td.pool.Dir(vid))
		}},
		{"data directory is a link", "dir", func(t *testing.T, td *testDriver, vid pool.VolumeID, outside string) {
			link(t, outside, td.pool.DataPath(vid))
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			outside := filepath.Join(td.root, "outside")
			if err := os.MkdirAll(outside, 0o750); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(outside, "victim.img"), make([]byte, 64<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			vc := mountCap(rwo, "ext4")
			params := map[string]string(nil)
			if tc.layout == "dir" {
				vc = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
				params = map[string]string{"layout": "dir"}
			}
			td.create(t, "other", mountCap(rwo, "ext4"), nil)
			id := td.create(t, "v", vc, params)
			vid, _ := pool.ParseVolumeID(id)
			tc.plant(t, td, vid, outside)
			before := tree(t, outside)
			attached := td.host.Attached()

			if err := td.stage(id, vc); err == nil {
				t.Error("a volume whose files are links was staged")
			}
			if _, err := td.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: id}); err == nil {
				t.Error("a snapshot copied through a link")
			}
			if _, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
				Name: "clone", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: params,
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}},
			}); err == nil {
				t.Error("a clone copied through a link")
			}
			if got := td.host.Attached(); len(got) != len(attached) {
				t.Errorf("something was attached: %v", got)
			}
			for _, m := range td.host.Mounts() {
				if strings.HasPrefix(m.Dir, outside) {
					t.Errorf("something outside the pool was mounted: %+v", m)
				}
			}
			if after := tree(t, outside); after != before {
				t.Errorf("files outside the pool changed:\n%s\n---\n%s", before, after)
			}
			h, err := td.ControllerGetVolumeHealth(context.Background(), &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
			if err != nil || len(h.GetVolumeHealth().GetHealthStatuses()) == 0 {
				t.Errorf("health does not report it: %v %v", h, err)
			}
		})
	}
}

// Mount options are checked against the filesystem's allow-list, and staging and
// target paths may not go through a link or leave the allowed prefix.
func TestHostileMountFlagsAndPaths(t *testing.T) {
	td := newTestDriver(t, testOpts{modify: func(o *Options) {}})
	id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
	for _, flags := range [][]string{{"loop"}, {"offset=4096"}, {"sizelimit=1"}, {"errors=panic"}, {"noatime,loop"}} {
		vc := mountCap(rwo, "ext4")
		vc.GetMount().MountFlags = flags
		wantCode(t, td.stage(id, vc), codes.InvalidArgument)
		if n := len(td.host.Mounts()) + len(td.host.Attached()); n != 0 {
			t.Fatalf("mount flags %q: something was mounted or attached", flags)
		}
	}
	vc := mountCap(rwo, "ext4")
	vc.GetMount().MountFlags = []string{"noatime", "discard"}
	if err := td.stage(id, vc); err != nil {
		t.Fatalf("allowed flags refused: %v", err)
	}
	if err := td.publish(id, vc, false); err != nil {
		t.Fatalf("allowed flags refused at publish: %v", err)
	}

	// A target path through a link.
	elsewhere := filepath.Join(td.root, "elsewhere")
	if err := os.MkdirAll(elsewhere, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(elsewhere, filepath.Join(td.root, "link")); err != nil {
		t.Fatal(err)
	}
	_, err := td.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: filepath.Join(td.root, "staging", id),
		TargetPath: filepath.Join(td.root, "link", "target"), VolumeCapability: vc,
	})
	wantCode(t, err, codes.InvalidArgument)

	// Outside the allowed prefix.
	pinned := newTestDriver(t, testOpts{modify: func(o *Options) { o.PathPrefix = "/var/lib/kubelet" }})
	pid := pinned.create(t, "v", mountCap(rwo, "ext4"), nil)
	wantCode(t, pinned.stage(pid, mountCap(rwo, "ext4")), codes.InvalidArgument)
	if n := len(pinned.host.Mounts()); n != 0 {
		t.Fatal("a stage outside the allowed prefix mounted something")
	}
}

// An image volume staged read-only is never reported grown while its
// filesystem keeps the old size; a read-only publish of a read-write stage
// grows through the stage.
func TestReadOnlyExpansionIsHonest(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name        string
		stageMode   csi.VolumeCapability_AccessMode_Mode
		publishRO   bool
		wantGrowErr codes.Code
	}{
		{"read-only stage", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, true, codes.FailedPrecondition},
		{"read-only publish of a read-write stage", rwo, true, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			vc := mountCap(tc.stageMode, "xfs")
			resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{vc}, CapacityRange: &csi.CapacityRange{RequiredBytes: 512 << 20}})
			if err != nil {
				t.Fatal(err)
			}
			id := resp.GetVolume().GetVolumeId()
			if err := td.stage(id, vc); err != nil {
				t.Fatal(err)
			}
			if err := td.publish(id, vc, tc.publishRO); err != nil {
				t.Fatal(err)
			}
			if _, err := td.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}}); err != nil {
				t.Fatal(err)
			}
			_, err = td.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: filepath.Join(td.root, "target", id), CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
			wantCode(t, err, tc.wantGrowErr)
			dev, _, _ := td.host.Find(td.pool.ImagePath(pool.NewVolumeID("local", "v")))
			_, fsSize, _ := td.host.FilesystemSize(dev)
			if grown := fsSize == 1<<30; grown != (tc.wantGrowErr == codes.OK) {
				t.Errorf("filesystem is %d bytes after NodeExpandVolume answered %v", fsSize, err)
			}
		})
	}
}

// TestDeleteRefusesWhenAttachmentUnknown: an image volume is deleted only when
// this node can tell that no loop device holds it; a failed loop lookup is
// UNAVAILABLE with the pool untouched, and the retry deletes.
func TestDeleteRefusesWhenAttachmentUnknown(t *testing.T) {
	for _, tc := range []struct {
		name    string
		prepare func(t *testing.T, td *testDriver, vid pool.VolumeID)
	}{
		{"ready volume", func(*testing.T, *testDriver, pool.VolumeID) {}},
		{"create interrupted before its metadata", func(t *testing.T, td *testDriver, vid pool.VolumeID) {
			if err := os.Remove(td.pool.MetadataPath(vid)); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
			vid, err := pool.ParseVolumeID(id)
			if err != nil {
				t.Fatal(err)
			}
			tc.prepare(t, td, vid)
			before := tree(t, td.pool.Path())
			td.host.Faults.FailFrom("Find", 1, errInjected)
			_, err = td.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id})
			wantCode(t, err, codes.Unavailable)
			if after := tree(t, td.pool.Path()); after != before {
				t.Errorf("a delete that could not check the loop devices changed the pool:\n%s\n---\n%s", before, after)
			}
			td.host.Faults.Reset()
			if _, err := td.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Fatalf("retry: %v", err)
			}
			if td.pool.VolumeExists(vid) {
				t.Error("the retried delete left the volume")
			}
		})
	}
}

// A failed scan of the loop devices is no answer that the image is not
// attached: the node calls that ask say UNAVAILABLE (retry), never NOT_FOUND,
// ALREADY_EXISTS or a detached-device condition.
func TestLoopLookupFailureIsUnavailable(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "ext4")
	id := td.create(t, "v", vc, nil)
	if err := td.stage(id, vc); err != nil {
		t.Fatal(err)
	}
	if err := td.publish(id, vc, false); err != nil {
		t.Fatal(err)
	}
	staging, target := filepath.Join(td.root, "staging", id), filepath.Join(td.root, "target", id)
	td.opts.StatsHealthTTL = 0 // no cached condition hides the lookup
	td.host.Faults.FailFrom("Find", 1, errInjected)
	defer td.host.Faults.Reset()
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"NodeGetVolumeStats", func() error {
			_, err := td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target, StagingTargetPath: staging})
			return err
		}},
		{"NodeGetVolumeStats of the staging path", func() error {
			_, err := td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: staging})
			return err
		}},
		{"NodePublishVolume again", func() error { return td.publish(id, vc, false) }},
	} {
		t.Run(tc.name, func(t *testing.T) { wantCode(t, tc.call(), codes.Unavailable) })
	}
}
