package driver

import (
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

func TestPublishFence(t *testing.T) {
	rec := func(node string, ro bool) pool.PublishRecord {
		return pool.PublishRecord{Node: node, ReadOnly: ro, At: time.Unix(0, 0)}
	}
	tests := []struct {
		name     string
		layout   pool.Layout
		held     []pool.PublishRecord
		readOnly bool
		want     codes.Code
	}{
		{"first writer", pool.LayoutImage, nil, false, codes.OK},
		{"second writer", pool.LayoutImage, []pool.PublishRecord{rec("n1", false)}, false, codes.FailedPrecondition},
		{"reader beside a writer", pool.LayoutImage, []pool.PublishRecord{rec("n1", false)}, true, codes.FailedPrecondition},
		{"writer beside readers", pool.LayoutImage, []pool.PublishRecord{rec("n1", true)}, false, codes.FailedPrecondition},
		{"readers", pool.LayoutImage, []pool.PublishRecord{rec("n1", true), rec("n3", true)}, true, codes.OK},
		{"own record", pool.LayoutImage, []pool.PublishRecord{rec("n2", false)}, false, codes.OK},
		{"dir writers", pool.LayoutDir, []pool.PublishRecord{rec("n1", false), rec("n3", false)}, false, codes.OK},
	}
	d := &core{}
	for _, tt := range tests {
		v := &pool.Volume{ID: "p.x", Layout: tt.layout, Published: tt.held}
		if got := status.Code(csierr.GRPCError(d.layoutOf(tt.layout).Fence(v, "n2", tt.readOnly))); got != tt.want {
			t.Errorf("%s: %s, want %s", tt.name, got, tt.want)
		}
	}
}

func TestAccessModesByLayout(t *testing.T) {
	mount := func(m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
		return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: m}}
	}
	block := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	tests := []struct {
		name   string
		vc     *csi.VolumeCapability
		layout pool.Layout
		ok     bool
	}{
		{"image RWO", mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), pool.LayoutImage, true},
		{"image RWX", mount(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), pool.LayoutImage, false},
		{"image single writer of many", mount(csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER), pool.LayoutImage, false},
		{"dir RWX", mount(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), pool.LayoutDir, true},
		{"dir RWOP", mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER), pool.LayoutDir, true},
		{"dir block", block, pool.LayoutDir, false},
		{"image block", block, pool.LayoutImage, true},
	}
	d := &core{}
	for _, tt := range tests {
		caps, err := params.ParseCaps([]*csi.VolumeCapability{tt.vc}, "ext4")
		if err != nil {
			t.Fatalf("%s: parseCaps: %v", tt.name, err)
		}
		err = d.layoutOf(tt.layout).Allowed(caps)
		if (err == nil) != tt.ok {
			t.Errorf("%s: allowed = %v, want ok=%t", tt.name, err, tt.ok)
		}
		if code := status.Code(csierr.GRPCError(err)); err != nil && code != codes.InvalidArgument {
			t.Errorf("%s: code %s", tt.name, code)
		}
	}
}
