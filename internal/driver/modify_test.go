package driver

import (
	"context"
	"os"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// allocatedOf is how many bytes of a volume's image hold blocks.
func allocatedOf(t *testing.T, td *testDriver, id string) (size, allocated int64) {
	t.Helper()
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(td.pool.ImagePath(vid))
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size(), fi.Sys().(*syscall.Stat_t).Blocks * 512
}

func (td *testDriver) record(t *testing.T, id string) *pool.Volume {
	t.Helper()
	vid, err := pool.ParseVolumeID(id)
	if err != nil {
		t.Fatal(err)
	}
	v, err := td.pool.Load(vid)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestControllerModifyVolume(t *testing.T) {
	vc := mountCap(rwo, "ext4")
	limits := map[string]string{"readBytesPerSecond": "40Mi", "writeBytesPerSecond": "20Mi", "readIOPS": "2000", "writeIOPS": "1000"}
	want := pool.IOLimits{ReadBytesPerSecond: 40 << 20, WriteBytesPerSecond: 20 << 20, ReadIOPS: 2000, WriteIOPS: 1000}
	tests := []struct {
		name   string
		params map[string]string // StorageClass parameters
		first  map[string]string // a first modify that succeeds
		modify map[string]string
		setup  func(td *testDriver)
		// huge: the volume is a sparse 1 TiB, far beyond the pool's free
		// space (overcommit allows it), so preallocating it cannot fit.
		huge   bool
		code   codes.Code
		limits pool.IOLimits
		prealloc,
		allocated bool // the whole image holds blocks afterwards
	}{
		{name: "limits recorded", modify: limits, limits: want},
		{name: "only the keys given change", first: limits, modify: map[string]string{"writeIOPS": "0"},
			limits: pool.IOLimits{ReadBytesPerSecond: 40 << 20, WriteBytesPerSecond: 20 << 20, ReadIOPS: 2000}},
		{name: "nothing given changes nothing", first: limits, modify: map[string]string{}, limits: want},
		{name: "unknown key changes nothing", first: limits, modify: map[string]string{"writeIOPS": "5", "XXX_FakeKey": "x"}, code: codes.InvalidArgument, limits: want},
		{name: "bad value changes nothing", first: limits, modify: map[string]string{"writeIOPS": "5", "readIOPS": "-1"}, code: codes.InvalidArgument, limits: want},
		{name: "preallocate fills the image", modify: map[string]string{"preallocate": "true"}, prealloc: true, allocated: true},
		{name: "preallocate again is a no-op", first: map[string]string{"preallocate": "true"}, modify: map[string]string{"preallocate": "true"}, prealloc: true, allocated: true},
		{name: "preallocate false keeps the blocks", first: map[string]string{"preallocate": "true"}, modify: map[string]string{"preallocate": "false"}, allocated: true},
		{name: "failing fallocate leaves the record", modify: map[string]string{"preallocate": "true", "readIOPS": "10"},
			setup: func(td *testDriver) { td.host.Faults.FailNth("Allocate", 1, errInjected) }, code: codes.Internal},
		{name: "no room is RESOURCE_EXHAUSTED", huge: true, modify: map[string]string{"preallocate": "true", "readIOPS": "10"}, code: codes.ResourceExhausted},
		{name: "limits on a dir volume", params: map[string]string{"layout": "dir"}, modify: map[string]string{"readIOPS": "10"}, code: codes.InvalidArgument},
		{name: "preallocate on a dir volume", params: map[string]string{"layout": "dir"}, modify: map[string]string{"preallocate": "true"}, code: codes.InvalidArgument},
		{name: "preallocate false on a dir volume", params: map[string]string{"layout": "dir"}, modify: map[string]string{"preallocate": "false"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := testOpts{}
			if tt.huge {
				o.overcommit = 1 << 20
			}
			td := newTestDriver(t, o)
			cap := vc
			if tt.params["layout"] == "dir" {
				cap = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
			}
			ctx := context.Background()
			var id string
			if tt.huge {
				cap = blockCap(rwo)
				resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{cap},
					CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 40}})
				if err != nil {
					t.Fatal(err)
				}
				id = resp.GetVolume().GetVolumeId()
			} else {
				id = td.create(t, "v", cap, tt.params)
			}
			if tt.first != nil {
				if _, err := td.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: tt.first}); err != nil {
					t.Fatal(err)
				}
			}
			if tt.setup != nil {
				tt.setup(td)
			}
			_, err := td.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: tt.modify})
			wantCode(t, err, tt.code)
			v := td.record(t, id)
			if v.IOLimits != tt.limits || v.Preallocate != tt.prealloc {
				t.Errorf("record: %+v preallocate=%t, want %+v preallocate=%t", v.IOLimits, v.Preallocate, tt.limits, tt.prealloc)
			}
			if v.Layout == pool.LayoutImage {
				size, alloc := allocatedOf(t, td, id)
				if got := alloc >= size; got != tt.allocated {
					t.Errorf("image %d bytes, %d allocated; want fully allocated=%t", size, alloc, tt.allocated)
				}
				if size != v.CapacityBytes {
					t.Errorf("image is %d bytes, record %d", size, v.CapacityBytes)
				}
				// Whatever happened, the volume still stages.
				if err := td.stage(id, cap); err != nil {
					t.Errorf("stage after the modify: %v", err)
				}
			}
		})
	}
}

func TestModifyVolumeIDs(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	tests := []struct {
		id   string
		code codes.Code
	}{
		{"", codes.InvalidArgument},
		{"non-existing-volume-id", codes.NotFound},
		{"local.0123456789abcdef0123456789abcdef", codes.NotFound},
		{"nopool.0123456789abcdef0123456789abcdef", codes.NotFound},
		{"../../etc", codes.InvalidArgument},
		{"local.x\x00", codes.InvalidArgument},
	}
	for _, tt := range tests {
		_, err := td.ControllerModifyVolume(context.Background(), &csi.ControllerModifyVolumeRequest{VolumeId: tt.id, MutableParameters: map[string]string{"readIOPS": "1"}})
		if got := status.Code(err); got != tt.code {
			t.Errorf("%q: %v, want %v", tt.id, err, tt.code)
		}
	}
}

func TestCreateVolumeMutableParameters(t *testing.T) {
	tests := []struct {
		name     string
		params   map[string]string
		mutable  map[string]string
		again    map[string]string // a retried create's
		code     codes.Code
		againErr codes.Code
		prealloc bool
	}{
		{name: "recorded and allocated", mutable: map[string]string{"writeIOPS": "100", "preallocate": "true"}, again: map[string]string{"writeIOPS": "100", "preallocate": "true"}, prealloc: true},
		{name: "a retry with others is another volume", mutable: map[string]string{"writeIOPS": "100"}, again: map[string]string{"writeIOPS": "200"}, againErr: codes.AlreadyExists},
		{name: "unknown key", mutable: map[string]string{"XXX_FakeKey": "x"}, code: codes.InvalidArgument},
		{name: "limits on dir", params: map[string]string{"layout": "dir"}, mutable: map[string]string{"writeIOPS": "1"}, code: codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			vc := mountCap(rwo, "ext4")
			if tt.params["layout"] == "dir" {
				vc = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
			}
			req := &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{vc}, Parameters: tt.params,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, MutableParameters: tt.mutable}
			resp, err := td.CreateVolume(context.Background(), req)
			wantCode(t, err, tt.code)
			if err != nil {
				if entries, _ := os.ReadDir(td.pool.Path() + "/volumes"); len(entries) != 0 {
					t.Errorf("a refused create left %d volumes", len(entries))
				}
				return
			}
			id := resp.GetVolume().GetVolumeId()
			v := td.record(t, id)
			if v.Preallocate != tt.prealloc {
				t.Errorf("preallocate %t, want %t", v.Preallocate, tt.prealloc)
			}
			if size, alloc := allocatedOf(t, td, id); tt.prealloc && alloc < size {
				t.Errorf("image %d bytes, %d allocated", size, alloc)
			}
			req.MutableParameters = tt.again
			_, err = td.CreateVolume(context.Background(), req)
			wantCode(t, err, tt.againErr)
		})
	}
}

// TestExpandPreallocated: a preallocated volume's growth is allocated too, and
// a failing fallocate leaves it at its size, usable, and a retry grows it.
func TestExpandPreallocated(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	vc := mountCap(rwo, "ext4")
	ctx := context.Background()
	resp, err := td.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{vc},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, MutableParameters: map[string]string{"preallocate": "true"}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	td.host.Faults.FailNth("Allocate", 1, errInjected)
	grow := &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}}
	_, err = td.ControllerExpandVolume(ctx, grow)
	wantCode(t, err, codes.Internal)
	if v := td.record(t, id); v.CapacityBytes != 64<<20 {
		t.Fatalf("a failed growth recorded %d bytes", v.CapacityBytes)
	}
	if err := td.stage(id, vc); err != nil {
		t.Fatalf("stage after a failed growth: %v", err)
	}
	if _, err := td.ControllerExpandVolume(ctx, grow); err != nil {
		t.Fatal(err)
	}
	size, alloc := allocatedOf(t, td, id)
	if size != 128<<20 || alloc < size {
		t.Errorf("image %d bytes, %d allocated; want 128 MiB, all allocated", size, alloc)
	}
}
