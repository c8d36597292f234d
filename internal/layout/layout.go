// Package layout holds what the image and dir layouts do on the controller and
// on the node, and this node's records of the images it attached in shared
// pools (records.go). It reaches the node's kernel only through the Host seam
// (host.go) and holds only Deps: the pools, locks, leases and handlers of
// internal/driver are out of its reach; what it needs of them comes in its
// arguments or as a function in Deps.
package layout

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/nodestate"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Layout is everything the image and dir layouts do differently. Handlers pick
// it once per volume (Of) and never branch on pool.Layout themselves, so
// a third layout is one more implementation in files of its own (its
// controller side in <layout>.go, its node side in <layout>_node.go).
type Layout interface {
	layoutFacts
	controllerLayout
	nodeLayout
}

// layoutFacts are what a layout is: answers that act on nothing.
type layoutFacts interface {
	// allowed refuses capabilities the layout cannot honour (INVALID_ARGUMENT).
	Allowed(s params.Caps) error
	// minSize is the smallest volume of the layout for s.
	MinSize(s params.Caps) int64
	// fsType is the filesystem volume.json records for a volume made for s.
	FSType(s params.Caps) string
	// sameFS refuses a request whose fs_type the volume does not have.
	SameFS(s params.Caps, fsType string) bool
	// mountFS is the filesystem whose mount options a stage or publish of v
	// may carry ("" for a bind of a directory).
	MountFS(v *pool.Volume) string
	// volumeContext adds the layout's keys to a volume's context.
	VolumeContext(v *pool.Volume, ctx map[string]string)
	NodeExpansionRequired() bool
}

// controllerLayout is what a layout does for the controller's calls.
type controllerLayout interface {
	FinishCreate(ctx context.Context, p *pool.Pool, v *pool.Volume) error
	// cloneFrom fills a volume still creating from a snapshot or volume and
	// marks it ready; finishClone holds the source.
	CloneFrom(ctx context.Context, p *pool.Pool, v *pool.Volume, src *ContentSource) error
	Delete(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) error
	// fence decides whether node may have v published the way it asks.
	Fence(v *pool.Volume, node string, readOnly bool) error
	Expand(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, r *csi.CapacityRange) (*csi.ControllerExpandVolumeResponse, error)
}

// nodeLayout is what a layout does for the node's calls.
type nodeLayout interface {
	Stage(ctx context.Context, nv NodeVolume, staging string, vc *csi.VolumeCapability) error
	Publish(ctx context.Context, nv NodeVolume, staging, target string, readOnly bool, vc *csi.VolumeCapability) error
	ExpandNode(ctx context.Context, nv NodeVolume, req *csi.NodeExpandVolumeRequest, path string) (*csi.NodeExpandVolumeResponse, error)
	Stats(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, path string) (*csi.NodeGetVolumeStatsResponse, error)
}

// Layouts are the layouts a StorageClass may name.
var Layouts = []pool.Layout{pool.LayoutImage, pool.LayoutDir}

// Deps is what a layout acts through: this node's kernel (its mounts,
// loop and block devices and filesystems), the quota backends of dir volumes,
// and the few settings that shape a stage. The driver embeds it, so its
// handlers reach the same parts; a layout holds only this, not the driver, so
// the pools, locks, leases and handlers are out of its reach: what it needs of
// them comes in its arguments.
type Deps struct {
	Mounts MountTable
	Loops  LoopDevices
	Devs   BlockDevices
	FS     Filesystems
	Quotas quotaBackends

	NodeID       string
	ExpandOnNode bool
	// PathPrefix is --allowed-path-prefix: the only directory mounts go in.
	PathPrefix string
	// Freeze freezes the filesystem of a volume wherever it is staged
	// read-write, for a consistent copy (the snapshot's quiesce, quiesce.go);
	// its thaw fails when a node let go before the copy ended.
	Freeze func(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (thaw func() error, err error)
	// State is the node's own record store (records.go).
	State *nodestate.Store
	// LeaseLost tells whether this node's lease in the pool named name
	// expired or was fenced (the lease keeper), for a stage to check after
	// it recorded its device that no fence has run or is due meanwhile;
	// nil: no such check.
	LeaseLost func(name string) bool
}

// Of returns the implementation of l; an unknown layout (a volume.json
// written by a newer driver) is treated as an image, whose checks refuse
// anything they do not recognise.
func Of(d *Deps, l pool.Layout) Layout {
	if l == pool.LayoutDir {
		return dirLayout{d}
	}
	return imageLayout{d}
}

// dirLayout is a subdirectory of the pool, bind-mounted into pods: many
// writers on many nodes, size enforced where the pool's filesystem can.
type dirLayout struct{ *Deps }
