package driver

import (
	"context"
	"fmt"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/fence"
	"github.com/poolcsi/poolcsi/internal/iolimits"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// The stage-time fence checks of the handlers; the lease keeper and the
// self-fence are internal/fence.

// fenceIfTaken fences this node's loop device of an image volume of a shared
// pool whose records no longer name this node: a controller force-detached
// the volume while this node was cut off or down (its lease expired), and
// another node may have it now. A node that comes back with the volume still
// staged (a kernel that kept its mounts, a node plugin that was down) must
// not let anything of its own reach the image again; unmounting the
// filesystem on it would write its journal and superblock into an image that
// another node has mounted. An unreadable record fences nothing here: the
// lease's own fence covers a pool that does not answer.
func (d *core) fenceIfTaken(ctx context.Context, p *pool.Pool, vid pool.VolumeID, image, staging string) error {
	if !p.Shared() {
		return nil
	}
	v, err := p.Load(vid)
	if err != nil || v.Layout != pool.LayoutImage {
		return nil
	}
	for _, s := range v.Staged {
		if s.Node == d.opts.NodeID {
			return nil
		}
	}
	dev, err := d.stageDevice(staging, image)
	if err != nil || dev == "" {
		return err
	}
	if fenced, err := d.Loops.Fenced(dev); err == nil && fenced {
		return nil
	}
	klog.FromContext(ctx).Info("Fencing the loop device of a volume this node no longer holds before unmounting it: a controller force-detached it from this node, and another node may have it", "volume", vid, "device", dev)
	if err := d.Loops.Fence(dev); err != nil {
		return csierr.Failf(pool.ErrUnavailable, "fencing %s, the loop device of volume %s that another node may hold, before unmounting it: %w", dev, vid, err)
	}
	return nil
}

// dropStaleStage clears, before a stage that has just claimed a shared pool's
// image volume for this node, whatever this node still has of an earlier stage
// of it: a loop device attached before this node held a stage record can only
// be left by a stage whose record a controller dropped (a force-detach while
// this node was silent), or by a stage that failed half way. Its filesystem's
// view of the image is stale (another node may have written since), so the
// device is fenced, the staging path unmounted if it shows that device, and
// the device detached if nothing else mounts it; the stage then starts anew.
// Reusing it would serve a stale page cache and write it back over the other
// node's data.
func (d *core) dropStaleStage(ctx context.Context, nv layout.NodeVolume, staging string, readOnly bool) error {
	// A read-only stage writes nothing back; on one machine running two node
	// plugins (the tests) the device it finds is the other node's read-only one.
	if readOnly || !nv.Pool.Shared() || nv.Vol.Layout != pool.LayoutImage {
		return nil
	}
	image := nv.Pool.ImagePath(nv.ID)
	dev, err := d.stageDevice(staging, image)
	if err != nil || dev == "" {
		return err
	}
	log := klog.FromContext(ctx).WithValues("volume", nv.ID, "device", dev, "path", staging)
	log.Info("A loop device of the volume was attached on this node before this stage claimed it (a stage a controller force-detached, or one that failed half way): fencing it and staging anew")
	if err := d.Loops.Fence(dev); err != nil {
		return csierr.Failf(pool.ErrUnavailable, "fencing %s, a stale loop device of volume %s: %w", dev, nv.ID, err)
	}
	if info, mounted, err := d.Mounts.Info(staging); err == nil && mounted && d.Loops.Backs(info.Source, image) {
		if err := d.Mounts.UnmountChecked(ctx, staging, d.OnlyVolume(nv.Pool, nv.ID, "staging path", staging)); err != nil {
			return fmt.Errorf("unmount the stale stage at %s: %w", staging, err)
		}
	}
	// Detaches the fenced device once nothing mounts it (the publish targets
	// of the stale stage's pods may still: kubelet unmounts those, and a
	// later unstage detaches it).
	if err := d.Loops.Detach(ctx, image); err != nil {
		log.Error(err, "Detaching the stale loop device")
	}
	return nil
}

// stageDevice is the loop device of this node's stage of image at staging: the
// one whose filesystem the staging path shows, or, where nothing is mounted
// there (a block stage, or an unstage retried after its unmount), the image's
// device if nothing mounts it. A device of the image mounted elsewhere is not
// this stage's: on one machine running two node plugins (the tests), it is the
// other node's, which must not be fenced for this one.
func (d *core) stageDevice(staging, image string) (string, error) {
	if info, mounted, err := d.Mounts.Info(staging); err == nil && mounted {
		if d.Loops.Backs(info.Source, image) {
			return info.Source, nil
		}
		return "", nil
	}
	dev, found, err := d.AttachedDevice(image)
	if err != nil {
		return "", err
	}
	if !found {
		return "", nil
	}
	if mps, err := d.Mounts.MountPoints(dev); err != nil || len(mps) > 0 {
		return "", nil
	}
	return dev, nil
}

// forceDetachable decides whether the records of nodes that still have image
// volume v staged read-write may go (a force-detach: the node never unstaged):
// only once each one's lease has expired. It returns the retryable error to
// answer meanwhile.
func (d *core) forceDetachable(p *pool.Pool, v *pool.Volume, nodes []string) error {
	var waits []string
	for _, n := range nodes {
		// Every node here holds a read-write stage record of v.
		verdict, err := d.leases.Verdict(p, n, true)
		if err != nil {
			return fmt.Errorf("volume %s is staged read-write on node %s, whose lease cannot be read: %w", v.ID, n, err)
		}
		if !verdict.Expired {
			waits = append(waits, fmt.Sprintf("%s (%s more: %s)", n, verdict.Wait.Round(time.Second), verdict.Why))
		}
	}
	if len(waits) > 0 {
		return csierr.Failf(pool.ErrUnavailable, "volume %s is still staged read-write on node(s) %s, which never unstaged it; it goes to another node only once their lease in pool %s has expired by this controller's clock, so that a node that is still running has fenced itself off first (docs/fencing.md): retry later",
			v.ID, strings.Join(waits, "; "), p.Name())
	}
	return nil
}

// LeaseState is this node's lease in one pool, for metrics.
type LeaseState = fence.LeaseState

// PeerLease is one node's lease in one shared pool as this controller sees it.
type PeerLease = fence.PeerLease

// LeaseStates reports this node's leases, by pool name.
func (d *core) LeaseStates() []LeaseState { return d.leases.States() }

// PeerLeases is what the last watch saw of every node's lease, for metrics.
func (d *core) PeerLeases() []PeerLease { return d.leases.PeerLeases() }

// DefaultIOLimitsInterval is how often the node re-applies the I/O limits of
// the volumes published here (Options.IOLimitsInterval).
const DefaultIOLimitsInterval = iolimits.DefaultInterval
