package layout

import (
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// What a request may ask of a volume it names: the checks the handlers make
// on a volume's record once the front hall has found it.

// Compatible refuses capabilities s that volume v cannot serve: another
// access type, another filesystem, or what its layout does not allow.
func (d *Deps) Compatible(s params.Caps, v *pool.Volume) error {
	if s.Access != v.AccessType {
		return fmt.Errorf("volume %s is a %s volume, the request asks for %s access", v.ID, v.AccessType, s.Access)
	}
	lay := Of(d, v.Layout)
	if !lay.SameFS(s, v.FSType) {
		return fmt.Errorf("volume %s holds %s, the request asks for %s", v.ID, v.FSType, s.FSType)
	}
	if err := lay.Allowed(s); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	return nil
}

// CheckNodeUse refuses a stage or publish of nv with capability vc that the
// volume cannot serve: an inline volume named by its pool ID, capabilities it
// does not have, mount flags the filesystem's allow-list refuses (they are
// request input, never passed through as they come).
func (d *Deps) CheckNodeUse(nv NodeVolume, vc *csi.VolumeCapability) error {
	if err := NotEphemeral(nv.Vol, "be staged or published by its pool ID"); err != nil {
		return err
	}
	if err := d.Compatible(nv.Caps, nv.Vol); err != nil {
		return csierr.Failf(csierr.ErrState, "%w", err)
	}
	if err := mount.CheckOptions(Of(d, nv.Vol.Layout).MountFS(nv.Vol), VolumeFlags(nv.Pool, nv.Vol, vc)); err != nil {
		return status.Errorf(codes.InvalidArgument, "volume %s: %v", nv.ID, err)
	}
	return nil
}

// NotEphemeral refuses what an inline volume cannot do (what says which).
func NotEphemeral(v *pool.Volume, what string) error {
	if v == nil || v.Ephemeral == nil {
		return nil
	}
	return csierr.Failf(csierr.ErrInvalid, "volume %s is the ephemeral inline volume %s of pod %s on node %s: it cannot %s (it lives as long as its pod; its size is the pod's size attribute)",
		v.ID, v.Ephemeral.Handle, v.Ephemeral.Pod, v.Ephemeral.Node, what)
}

// VolumeFlags are the mount flags of a capability that concern the volume's
// own mount: all of them, except on a dir volume of a share, whose
// non-generic flags are the share's (params.ShareFlags).
func VolumeFlags(p *pool.Pool, v *pool.Volume, vc *csi.VolumeCapability) []string {
	flags := vc.GetMount().GetMountFlags()
	if p.Config().Share != nil && v.Layout == pool.LayoutDir {
		return mount.BindOptions(flags)
	}
	return flags
}

// CreateCompatible refuses a volume v that a CreateVolume of the same name
// found, when it is not what the request asks for: other capabilities (caps),
// other mutable parameters, a capacity outside the range r.
func (d *Deps) CreateCompatible(v *pool.Volume, caps params.Caps, r *csi.CapacityRange, mutable pool.Volume) error {
	if err := d.Compatible(caps, v); err != nil {
		return err
	}
	if v.IOLimits != mutable.IOLimits || v.Preallocate != mutable.Preallocate {
		return fmt.Errorf("its mutable parameters differ (I/O limits %+v, preallocate %t)", v.IOLimits, v.Preallocate)
	}
	if req := r.GetRequiredBytes(); v.CapacityBytes < req {
		return errors.New("its capacity is below required_bytes")
	}
	if lim := r.GetLimitBytes(); lim > 0 && v.CapacityBytes > lim {
		return errors.New("its capacity is above limit_bytes")
	}
	return nil
}

// SameSource tells whether two recorded content sources are one.
func SameSource(a, b *pool.ContentSource) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// Params is what the source brings to a new volume's parameters (nil for
// no source).
func (c *ContentSource) Params() *params.Source {
	if c == nil {
		return nil
	}
	return &params.Source{Pool: c.Pool.Name(), Share: c.Pool.Config().Share, Layout: c.Layout, FSType: c.FSType}
}

// OnlyVolume is the check before each unmount of a path the CO named (what
// says which): only the volume's own mount is taken down, so a wrong or
// hostile call cannot unmount another volume's mount or anything else mounted
// there.
func (d *Deps) OnlyVolume(p *pool.Pool, vid pool.VolumeID, what, path string) func(mount.MountInfo) error {
	return func(info mount.MountInfo) error {
		if d.ShowsVolume(p, vid, path, info) {
			return nil
		}
		return fmt.Errorf("%s %s holds %s, not volume %s: %w", what, path, info.Source, vid, csierr.ErrForeignMount)
	}
}

// ShowsVolume tells whether the mount info at path shows volume vid: the
// filesystem or the device node of the loop device its image is attached to,
// or its data directory. It needs no metadata, so a volume whose volume.json is
// gone can still be unmounted, and nothing else ever is.
func (d *Deps) ShowsVolume(p *pool.Pool, vid pool.VolumeID, path string, info mount.MountInfo) bool {
	if p == nil {
		return false
	}
	image := p.ImagePath(vid)
	if dev, ok, err := d.Loops.Find(image); err == nil && ok &&
		(info.Source == dev || d.Mounts.OnDevice(path, dev) || d.Mounts.IsDevice(path, dev)) {
		return true
	}
	// A device this node fenced is no attachment of the image any more, but
	// what is mounted from it is still this volume's.
	if d.Loops.Backs(info.Source, image) {
		return true
	}
	// A device of the volume this node recorded, whose backing file can be
	// found neither by path nor by identity any more (its filesystem is
	// gone for good: a FUSE daemon killed, a client evicted).
	if d.RecordedDevice(vid, info.Source) {
		return true
	}
	return d.Mounts.SameDir(path, p.DataPath(vid))
}
