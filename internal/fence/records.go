package fence

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
)

// DropStaleRecords drops, when the lease keeper starts, the stage records
// whose device the kernel shows gone (forgetStages): a crash between a detach
// and the record's deletion leaves one, which would make a later fence fail
// closed for nothing. A volume with a call under way is left to that call.
// The kernel's devices are looked at once first, under no lock: only a volume
// with a record they do not show held is locked and looked at again. A listing
// waits up to layout.IdentifyWait for a hung backing file (any on the node, not only
// the pool's), and each lock held meanwhile turns the volume's calls away, and
// kept a restart's thaw of the volume from running (snapshot.go).
func (k *Keeper) DropStaleRecords(ctx context.Context) {
	keys, err := k.deps.Node.State.Keys(layout.StagesKind)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading this node's stage records")
		return
	}
	if len(keys) == 0 {
		return
	}
	devs, err := k.deps.Node.Loops.List(layout.IdentifyWait)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Listing the loop devices to drop this node's stale stage records; they stay")
		return
	}
	held := func(r layout.StageRecord) bool {
		return slices.ContainsFunc(devs, func(ld mount.LoopDevice) bool {
			return r.Holds(ld) || ld.Err != nil && (r.Device == "" || ld.Device == r.Device)
		})
	}
	seen := map[string]bool{}
	for _, key := range keys {
		var r layout.StageRecord
		if ok, err := k.deps.Node.State.Get(layout.StagesKind, key, &r); err != nil || !ok || seen[r.Volume] || held(r) {
			continue
		}
		seen[r.Volume] = true
		vid, err := pool.ParseVolumeID(r.Volume)
		if err != nil {
			continue
		}
		release, err := k.deps.Lock(vid.String(), "dropStaleRecords")
		if err != nil {
			continue
		}
		k.deps.Node.ForgetStages(ctx, vid)
		release()
	}
}

// adoptLockWait bounds how long the adoption tries to take a busy volume's
// lock, every adoptLockRetry.
const (
	adoptLockWait  = 2 * time.Second
	adoptLockRetry = 100 * time.Millisecond
)

// AdoptDevices records, while pool p answers, the loop devices of its images
// that this node holds without a record: those staged by a node plugin from
// before the records existed (an upgrade with volumes staged), whose fence
// would otherwise miss them. A device is adopted when the kernel shows its
// backing file as a volume's image (…/volumes/<key>/disk.img: with the pool's
// path, or, attached from a container that is gone, relative to the pool's
// filesystem), the pool's image of that key is the device's file (same st_dev
// and st_ino), and the volume's record in the pool names this node among its
// stages. Read-only or not cannot be told: it is recorded
// read-write (a fence that misses it then fails closed).
func (k *Keeper) AdoptDevices(ctx context.Context, p *pool.Pool) {
	if err := k.adoptDevices(ctx, p); err != nil {
		klog.FromContext(ctx).Error(err, "Recording the loop devices staged before this node kept records left some undecided", "pool", p.Name())
	}
}

// adoptDevices is AdoptDevices, returning what it could not decide: the
// pool or the kernel's list that did not answer, a device that may be one of
// this node's images of p but could not be checked or recorded. Until it has
// returned nil, this node's records may miss a device it holds.
func (k *Keeper) adoptDevices(ctx context.Context, p *pool.Pool) error {
	devs, err := k.deps.Node.Loops.List(layout.IdentifyWait)
	if err != nil {
		return fmt.Errorf("listing the kernel's loop devices: %w", err)
	}
	var undecided []error
	for _, ld := range devs {
		// The path shown names the volume, not the pool: a device attached by
		// the plugin of an earlier container (an upgrade) shows its file
		// relative to the pool's filesystem, as that container's mounts are
		// gone. Which pool and image it is, is the st_dev/st_ino check below.
		parts := strings.Split(ld.Backing, "/")
		if len(parts) < 3 || ld.Fenced || parts[len(parts)-1] != "disk.img" || parts[len(parts)-3] != "volumes" {
			continue
		}
		key := parts[len(parts)-2]
		vid, err := pool.ParseVolumeID(p.Name() + "." + key)
		if err != nil {
			continue
		}
		if ld.Err != nil {
			// Its filesystem does not answer the kernel: nothing tells
			// whether it is this node's image of p, and it cannot be
			// recorded by identity.
			undecided = append(undecided, fmt.Errorf("device %s (%s): the kernel cannot identify its backing file: %w", ld.Device, ld.Backing, ld.Err))
			continue
		}
		rec := layout.StageRecord{Pool: p.Name(), Volume: vid.String(), FileDev: ld.Dev, FileIno: ld.Ino, Device: ld.Device, At: time.Now().UTC()}
		var old layout.StageRecord
		if ok, err := k.deps.Node.State.Get(layout.StagesKind, rec.Key(), &old); err != nil {
			undecided = append(undecided, fmt.Errorf("device %s: reading its record: %w", ld.Device, err))
			continue
		} else if ok {
			continue
		}
		var st unix.Stat_t
		image := p.ImagePath(vid)
		err = unix.Stat(image, &st)
		if errors.Is(err, unix.ENOENT) {
			// Not this pool's image (a device of another pool whose path
			// looks alike) only if the pool's volumes are there to say so:
			// a pool gone shows no image at all.
			var vols unix.Stat_t
			if verr := unix.Stat(filepath.Dir(filepath.Dir(image)), &vols); verr == nil {
				continue
			}
		}
		if err == nil && (st.Dev != ld.Dev || st.Ino != ld.Ino) {
			continue
		} else if err != nil {
			undecided = append(undecided, fmt.Errorf("device %s: identifying the image of volume %s: %w", ld.Device, vid, err))
			continue
		}
		v, err := p.Load(vid)
		if err != nil {
			undecided = append(undecided, fmt.Errorf("device %s: reading volume %s: %w", ld.Device, vid, err))
			continue
		}
		if !slices.ContainsFunc(v.Staged, func(s pool.StageRecord) bool { return s.Node == k.deps.NodeID }) {
			continue
		}
		// A call under way on the volume holds its lock for a moment: try
		// again for a while before calling the device undecided, which
		// keeps the leases from being released on the way out.
		var release func()
		var lockErr error
		if err := wait.PollUntilContextTimeout(ctx, adoptLockRetry, adoptLockWait, true, func(context.Context) (bool, error) {
			release, lockErr = k.deps.Lock(vid.String(), "adoptDevices")
			return lockErr == nil, nil
		}); err != nil {
			undecided = append(undecided, fmt.Errorf("device %s of volume %s: %w", ld.Device, vid, errors.Join(lockErr, err)))
			continue
		}
		err = k.deps.Node.NotePool(p, ld.Dev)
		if err == nil {
			err = k.deps.Node.State.Put(layout.StagesKind, rec.Key(), rec)
		}
		release()
		if err != nil {
			klog.FromContext(ctx).Error(err, "Recording a loop device staged before this node kept records", "volume", vid, "device", ld.Device)
			undecided = append(undecided, fmt.Errorf("device %s of volume %s: recording it: %w", ld.Device, vid, err))
			continue
		}
		klog.FromContext(ctx).Info("Recorded a loop device staged before this node kept records", "volume", vid, "device", ld.Device)
	}
	return errors.Join(undecided...)
}

// fencePlan is what a fence does in one pool.
type fencePlan struct {
	// devices to fence, sorted.
	devices []string
	// matched are the devices of recorded images, already fenced ones
	// included.
	matched []string
	// unmatched are the volumes recorded read-write whose device the
	// kernel did not show: the fence then fences all it cannot rule out.
	unmatched []string
	// failedClosed: unmatched records (or unreadable ones) made the fence
	// take every device on the pool's filesystem and every device it could
	// not identify.
	failedClosed bool
}

// planFence picks the loop devices a fence of one pool takes, from the
// kernel's devices (devs), this node's records of the pool's images (recs,
// unreadable telling that some could not be read) and the pool filesystem's
// device numbers (fsDevs):
//   - every device whose backing file is a recorded image (by st_dev and
//     st_ino, as the kernel keeps them for the device's whole life);
//   - every device the kernel cannot identify (its backing filesystem fails
//     or hangs) that a record names;
//   - and, failing closed when a read-write record matched no device, or a
//     record could not be read: every device whose backing file is on the
//     pool's filesystem, and every device the kernel cannot identify.
func planFence(devs []mount.LoopDevice, recs []layout.StageRecord, fsDevs []uint64, unreadable bool) fencePlan {
	var plan fencePlan
	take := map[string]bool{}
	matched := map[string]bool{}
	fs := slices.Clone(fsDevs)
	for _, r := range recs {
		fs = append(fs, r.FileDev)
		found := false
		for _, ld := range devs {
			if r.Names(ld) {
				found = true
				matched[ld.Device] = true
				if !ld.Fenced {
					take[ld.Device] = true
				}
			}
		}
		if !found && !r.ReadOnly && !slices.Contains(plan.unmatched, r.Volume) {
			plan.unmatched = append(plan.unmatched, r.Volume)
		}
	}
	if len(plan.unmatched) > 0 || unreadable {
		plan.failedClosed = true
		for _, ld := range devs {
			if !ld.Fenced && (ld.Err != nil || slices.Contains(fs, ld.Dev)) {
				take[ld.Device] = true
			}
		}
	}
	for dev := range take {
		plan.devices = append(plan.devices, dev)
	}
	for dev := range matched {
		plan.matched = append(plan.matched, dev)
	}
	slices.Sort(plan.devices)
	slices.Sort(plan.matched)
	slices.Sort(plan.unmatched)
	return plan
}
