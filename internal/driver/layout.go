package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/nodestate"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// layout is everything the image and dir layouts do differently. Handlers pick
// it once per volume (layoutOf) and never branch on pool.Layout themselves, so
// a third layout is one more implementation in files of its own (its
// controller side in <layout>.go, its node side in <layout>_node.go).
type layout interface {
	layoutFacts
	controllerLayout
	nodeLayout
}

// layoutFacts are what a layout is: answers that act on nothing.
type layoutFacts interface {
	// allowed refuses capabilities the layout cannot honour (INVALID_ARGUMENT).
	allowed(s params.Caps) error
	// minSize is the smallest volume of the layout for s.
	minSize(s params.Caps) int64
	// fsType is the filesystem volume.json records for a volume made for s.
	fsType(s params.Caps) string
	// sameFS refuses a request whose fs_type the volume does not have.
	sameFS(s params.Caps, fsType string) bool
	// mountFS is the filesystem whose mount options a stage or publish of v
	// may carry ("" for a bind of a directory).
	mountFS(v *pool.Volume) string
	// volumeContext adds the layout's keys to a volume's context.
	volumeContext(v *pool.Volume, ctx map[string]string)
	nodeExpansionRequired() bool
}

// controllerLayout is what a layout does for the controller's calls.
type controllerLayout interface {
	finishCreate(ctx context.Context, p *pool.Pool, v *pool.Volume) error
	// cloneFrom fills a volume still creating from a snapshot or volume and
	// marks it ready; finishClone holds the source.
	cloneFrom(ctx context.Context, p *pool.Pool, v *pool.Volume, src *contentSource) error
	delete(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) error
	// fence decides whether node may have v published the way it asks.
	fence(v *pool.Volume, node string, readOnly bool) error
	expand(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error)
}

// nodeLayout is what a layout does for the node's calls.
type nodeLayout interface {
	stage(ctx context.Context, nv nodeVolume, staging string, vc *csi.VolumeCapability) error
	publish(ctx context.Context, nv nodeVolume, staging, target string, readOnly bool, vc *csi.VolumeCapability) error
	expandNode(ctx context.Context, nv nodeVolume, req *csi.NodeExpandVolumeRequest, path string) (*csi.NodeExpandVolumeResponse, error)
	stats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error)
}

// layoutOf returns the implementation of l; an unknown layout (a volume.json
// written by a newer driver) is treated as an image, whose checks refuse
// anything they do not recognise.
func (d *Driver) layoutOf(l pool.Layout) layout {
	if l == pool.LayoutDir {
		return dirLayout{&d.layoutDeps}
	}
	return imageLayout{&d.layoutDeps}
}

// layoutDeps is what a layout acts through: this node's kernel (its mounts,
// loop and block devices and filesystems), the quota backends of dir volumes,
// and the few settings that shape a stage. The Driver embeds it, so its
// handlers reach the same parts; a layout holds only this, not the Driver, so
// the pools, locks, leases and handlers are out of its reach: what it needs of
// them comes in its arguments.
type layoutDeps struct {
	mounts MountTable
	loops  LoopDevices
	devs   BlockDevices
	fs     Filesystems
	quotas quotaBackends

	nodeID       string
	expandOnNode bool
	// pathPrefix is --allowed-path-prefix: the only directory mounts go in.
	pathPrefix string
	// freeze freezes the filesystem of a volume wherever it is staged
	// read-write, for a consistent copy (the snapshot's quiesce, quiesce.go);
	// its thaw fails when a node let go before the copy ended.
	freeze func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (thaw func() error, err error)
	// state is the node's own record store (noderecords.go).
	state *nodestate.Store
	// leaseState is the driver's lease state (lease.go), for a stage to
	// check after it recorded its device that no fence has run or is due
	// meanwhile; nil: no such check.
	leaseState *leases
}

// dirLayout is a subdirectory of the pool, bind-mounted into pods: many
// writers on many nodes, size enforced where the pool's filesystem can.
type dirLayout struct{ *layoutDeps }
