package driver

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// The node's own record of its devices in shared pools (docs/fencing.md,
// "How the fence finds its devices"). A node that lost its pool cannot resolve
// the pool's path: the kernel shows a file of a detached mount without the
// mount's prefix, a covered path shows another filesystem, a hung one does not
// answer. So the node writes down, outside every pool (internal/nodestate),
// before it attaches an image of a shared pool, the identity the kernel will
// report for the image's loop device (the file's st_dev and st_ino, as
// LOOP_GET_STATUS64's lo_device and lo_inode), and the pool's filesystem
// device numbers; the fence enumerates the kernel's loop devices and fences
// every one that holds a recorded file. A record goes only once its device is
// detached.

const (
	// stagesKind holds one record per image attached (or about to be) for
	// a stage or an inline volume of a shared pool, keyed
	// <volume>@<st_dev>-<st_ino>.
	stagesKind = "stages"
	// poolsKind holds, per shared pool, the device numbers its filesystem
	// answered with while this node staged from it.
	poolsKind = "pools"
	// identifyWait bounds how long the node waits for the kernel to
	// identify loop devices' backing files: a hung filesystem must not
	// hold up a fence.
	identifyWait = 2 * time.Second
)

// stageRecord is this node's record of one image of a shared pool it attached.
type stageRecord struct {
	Pool   string `json:"pool"`
	Volume string `json:"volume"`
	// FileDev and FileIno identify the image as the kernel reports a loop
	// device's backing file.
	FileDev  uint64 `json:"fileDev"`
	FileIno  uint64 `json:"fileIno"`
	ReadOnly bool   `json:"readOnly"`
	// Device is the loop device, once attached ("" before).
	Device string    `json:"device,omitempty"`
	At     time.Time `json:"at"`
}

// key is <pool>.<volume key>@<st_dev>-<st_ino> in hex: a volume ID on a share
// may be longer than a record's name may, and its pool and key identify it.
func (r stageRecord) key() string {
	vid, err := pool.ParseVolumeID(r.Volume)
	if err != nil {
		return ""
	}
	return fmt.Sprintf("%s@%x-%x", volumePrefix(vid), r.FileDev, r.FileIno)
}

// volumePrefix is what the keys of volume vid's records start with, before
// their "@".
func volumePrefix(vid pool.VolumeID) string { return vid.Pool + "." + vid.Key }

// holds tells whether loop device ld holds the file r records.
func (r stageRecord) holds(ld mount.LoopDevice) bool {
	return ld.Err == nil && ld.Dev == r.FileDev && ld.Ino == r.FileIno
}

// poolRecord is what this node remembers of a shared pool's filesystem.
type poolRecord struct {
	Pool string   `json:"pool"`
	Devs []uint64 `json:"devs"`
}

// recordsMu serialises the read-modify-write of pool records.
var recordsMu sync.Mutex

// readOnlyCaps tells whether a node call's capability only ever reads.
func readOnlyCaps(c params.Caps) bool {
	return len(c.Modes) > 0 && !slices.ContainsFunc(c.Modes, func(m csi.VolumeCapability_AccessMode_Mode) bool { return !readOnlyMode(m) })
}

// noteStage writes the record of image before it is attached, so that no
// crash between the two can leave a device this node does not know of. image
// is the path the attach will open (the pool's descriptor of it).
func (d *layoutDeps) noteStage(nv nodeVolume, image string) (stageRecord, error) {
	if !nv.pool.Shared() {
		return stageRecord{}, nil
	}
	var st unix.Stat_t
	if err := unix.Stat(image, &st); err != nil {
		return stageRecord{}, csierr.Failf(pool.ErrUnavailable, "volume %s: identify its image for this node's records: %w", nv.id, err)
	}
	rec := stageRecord{Pool: nv.pool.Name(), Volume: nv.id.String(), FileDev: st.Dev, FileIno: st.Ino, ReadOnly: readOnlyCaps(nv.caps), At: time.Now().UTC()}
	var old stageRecord
	if ok, err := d.state.Get(stagesKind, rec.key(), &old); err == nil && ok {
		// The image is still attached from before (a retried stage): one
		// read-write use of it makes the record read-write.
		rec.ReadOnly = rec.ReadOnly && old.ReadOnly
		rec.Device = old.Device
	}
	if err := d.notePool(nv.pool, st.Dev); err != nil {
		return stageRecord{}, err
	}
	if err := d.state.Put(stagesKind, rec.key(), rec); err != nil {
		return stageRecord{}, csierr.Failf(pool.ErrUnavailable, "volume %s: this node cannot record its stage, so its fence could not find the device: %w", nv.id, err)
	}
	return rec, nil
}

// notePool adds the pool's filesystem device numbers (its root's and dev's)
// to the pool's record.
func (d *layoutDeps) notePool(p *pool.Pool, dev uint64) error {
	devs := []uint64{dev}
	var st unix.Stat_t
	if err := unix.Stat(p.Path(), &st); err == nil {
		devs = append(devs, st.Dev)
	}
	recordsMu.Lock()
	defer recordsMu.Unlock()
	var rec poolRecord
	if _, err := d.state.Get(poolsKind, p.Name(), &rec); err != nil {
		klog.ErrorS(err, "Reading this node's record of a pool; writing it anew", "pool", p.Name())
	}
	changed := rec.Pool != p.Name()
	rec.Pool = p.Name()
	for _, v := range devs {
		if !slices.Contains(rec.Devs, v) {
			rec.Devs, changed = append(rec.Devs, v), true
		}
	}
	if !changed {
		return nil
	}
	slices.Sort(rec.Devs)
	if err := d.state.Put(poolsKind, p.Name(), rec); err != nil {
		return csierr.Failf(pool.ErrUnavailable, "pool %s: this node cannot record its filesystem: %w", p.Name(), err)
	}
	return nil
}

// noteDevice completes rec with the device the image was attached to, as the
// kernel identifies it: should the kernel report another identity than the
// file's stat did, the kernel's is recorded too (the fence matches the
// kernel's).
func (d *layoutDeps) noteDevice(ctx context.Context, rec stageRecord, dev string) error {
	if rec.Pool == "" || rec.Device == dev {
		return nil
	}
	rec.Device = dev
	if devs, err := d.loops.List(identifyWait); err == nil {
		for _, ld := range devs {
			if ld.Device == dev && ld.Err == nil && (ld.Dev != rec.FileDev || ld.Ino != rec.FileIno) {
				klog.FromContext(ctx).Info("The kernel identifies the image's loop device otherwise than the file's stat did; recording both", "volume", rec.Volume, "device", dev,
					"stat", fmt.Sprintf("%d:%d", rec.FileDev, rec.FileIno), "kernel", fmt.Sprintf("%d:%d", ld.Dev, ld.Ino))
				other := rec
				other.FileDev, other.FileIno = ld.Dev, ld.Ino
				if err := d.state.Put(stagesKind, other.key(), other); err != nil {
					return csierr.Failf(pool.ErrUnavailable, "volume %s: record its loop device: %w", rec.Volume, err)
				}
			}
		}
	}
	if err := d.state.Put(stagesKind, rec.key(), rec); err != nil {
		return csierr.Failf(pool.ErrUnavailable, "volume %s: record its loop device: %w", rec.Volume, err)
	}
	return nil
}

// volumeRecords are this node's records of volume vid.
func (d *layoutDeps) volumeRecords(vid pool.VolumeID) ([]stageRecord, error) {
	keys, err := d.state.Keys(stagesKind)
	if err != nil {
		return nil, err
	}
	var out []stageRecord
	for _, k := range keys {
		if !strings.HasPrefix(k, volumePrefix(vid)+"@") {
			continue
		}
		var r stageRecord
		if ok, err := d.state.Get(stagesKind, k, &r); err != nil {
			return nil, err
		} else if ok {
			out = append(out, r)
		}
	}
	return out, nil
}

// poolRecords are this node's records of images of the pool named name.
func (d *layoutDeps) poolRecords(name string) ([]stageRecord, error) {
	keys, err := d.state.Keys(stagesKind)
	if err != nil {
		return nil, err
	}
	var out []stageRecord
	var errs []error
	for _, k := range keys {
		var r stageRecord
		if ok, err := d.state.Get(stagesKind, k, &r); err != nil {
			errs = append(errs, err)
		} else if ok && r.Pool == name {
			out = append(out, r)
		}
	}
	if len(errs) > 0 {
		return out, fmt.Errorf("%d of this node's stage records unreadable: %w", len(errs), errs[0])
	}
	return out, nil
}

// recordedPools are the pools this node's stage records name (only those of
// read-write stages if readWrite), sorted; with an error, those of the
// records it could read.
func (d *layoutDeps) recordedPools(readWrite bool) ([]string, error) {
	keys, err := d.state.Keys(stagesKind)
	if err != nil {
		return nil, err
	}
	var out []string
	var errs []error
	for _, k := range keys {
		var r stageRecord
		if ok, err := d.state.Get(stagesKind, k, &r); err != nil {
			errs = append(errs, err)
		} else if ok && (!readWrite || !r.ReadOnly) && !slices.Contains(out, r.Pool) {
			out = append(out, r.Pool)
		}
	}
	slices.Sort(out)
	if len(errs) > 0 {
		return out, fmt.Errorf("%d of this node's stage records unreadable: %w", len(errs), errs[0])
	}
	return out, nil
}

// forgetStages drops this node's records of volume vid whose device is gone
// from the kernel: detached, or bound to another file. A record whose device
// the kernel cannot rule out (its backing file does not answer) stays.
func (d *layoutDeps) forgetStages(ctx context.Context, vid pool.VolumeID) {
	recs, err := d.volumeRecords(vid)
	if err != nil || len(recs) == 0 {
		if err != nil {
			klog.FromContext(ctx).Error(err, "Reading this node's stage records", "volume", vid)
		}
		return
	}
	devs, err := d.loops.List(identifyWait)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Listing the loop devices to drop this node's stage records; they stay", "volume", vid)
		return
	}
	for _, r := range recs {
		still := false
		for _, ld := range devs {
			if r.Device != "" && ld.Device != r.Device {
				continue
			}
			if !r.holds(ld) && (ld.Err == nil || r.Device == "" && !strings.HasSuffix(ld.Backing, "/"+vid.Key+"/disk.img")) {
				continue
			}
			// This node's fenced device of the image: let go of it here,
			// where its backing file may not be found any more (a FUSE
			// daemon killed, a client evicted: the file answers neither by
			// path nor by identity).
			if ld.Fenced {
				if err := d.loops.DetachFenced(ld.Device); err == nil {
					klog.FromContext(ctx).Info("Detached this node's fenced loop device of the volume", "volume", vid, "device", ld.Device)
					continue
				}
			}
			still = true
		}
		if still {
			continue
		}
		if err := d.state.Delete(stagesKind, r.key()); err != nil {
			klog.FromContext(ctx).Error(err, "Dropping this node's stage record", "volume", vid)
		}
	}
}

// recordedDevice tells whether dev is a loop device that this node's records
// name for volume vid and that still holds the recorded file, or whose backing
// file the kernel cannot identify while sysfs shows the volume's image.
func (d *layoutDeps) recordedDevice(vid pool.VolumeID, dev string) bool {
	if d.state == nil || !strings.HasPrefix(dev, "/dev/") {
		return false
	}
	recs, err := d.volumeRecords(vid)
	if err != nil || !slices.ContainsFunc(recs, func(r stageRecord) bool { return r.Device == dev }) {
		return false
	}
	devs, err := d.loops.List(identifyWait)
	if err != nil {
		return false
	}
	for _, ld := range devs {
		if ld.Device != dev {
			continue
		}
		for _, r := range recs {
			if r.Device == dev && (r.holds(ld) || ld.Err != nil && strings.HasSuffix(ld.Backing, "/"+vid.Key+"/disk.img")) {
				return true
			}
		}
	}
	return false
}

// dropStaleRecords drops, when the lease keeper starts, the stage records
// whose device the kernel shows gone (forgetStages): a crash between a detach
// and the record's deletion leaves one, which would make a later fence fail
// closed for nothing. A volume with a call under way is left to that call.
// The kernel's devices are looked at once first, under no lock: only a volume
// with a record they do not show held is locked and looked at again. A listing
// waits up to identifyWait for a hung backing file (any on the node, not only
// the pool's), and each lock held meanwhile turns the volume's calls away, and
// kept a restart's thaw of the volume from running (snapshot.go).
func (d *Driver) dropStaleRecords(ctx context.Context) {
	keys, err := d.opts.State.Keys(stagesKind)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading this node's stage records")
		return
	}
	if len(keys) == 0 {
		return
	}
	devs, err := d.loops.List(identifyWait)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Listing the loop devices to drop this node's stale stage records; they stay")
		return
	}
	held := func(r stageRecord) bool {
		return slices.ContainsFunc(devs, func(ld mount.LoopDevice) bool {
			return r.holds(ld) || ld.Err != nil && (r.Device == "" || ld.Device == r.Device)
		})
	}
	seen := map[string]bool{}
	for _, k := range keys {
		var r stageRecord
		if ok, err := d.opts.State.Get(stagesKind, k, &r); err != nil || !ok || seen[r.Volume] || held(r) {
			continue
		}
		seen[r.Volume] = true
		vid, err := pool.ParseVolumeID(r.Volume)
		if err != nil {
			continue
		}
		release, err := d.hold(vid.String(), holdDropStaleRecords)
		if err != nil {
			continue
		}
		d.forgetStages(ctx, vid)
		release()
	}
}

// adoptDevices records, while pool p answers, the loop devices of its images
// that this node holds without a record: those staged by a node plugin from
// before the records existed (an upgrade with volumes staged), whose fence
// would otherwise miss them. A device is adopted when the kernel shows its
// backing file under the pool's path, the file at that path is the device's
// (same st_dev and st_ino), and the volume's record in the pool names this
// node among its stages. Read-only or not cannot be told: it is recorded
// read-write (a fence that misses it then fails closed).
func (d *Driver) adoptDevices(ctx context.Context, p *pool.Pool) {
	root, err := filepath.EvalSymlinks(p.Path())
	if err != nil {
		return
	}
	devs, err := d.loops.List(identifyWait)
	if err != nil {
		return
	}
	prefix := filepath.Join(root, "volumes") + "/"
	for _, ld := range devs {
		rel, ok := strings.CutPrefix(ld.Backing, prefix)
		key, file, _ := strings.Cut(rel, "/")
		if !ok || ld.Err != nil || ld.Fenced || file != "disk.img" {
			continue
		}
		vid, err := pool.ParseVolumeID(p.Name() + "." + key)
		if err != nil {
			continue
		}
		rec := stageRecord{Pool: p.Name(), Volume: vid.String(), FileDev: ld.Dev, FileIno: ld.Ino, Device: ld.Device, At: time.Now().UTC()}
		var old stageRecord
		if ok, err := d.opts.State.Get(stagesKind, rec.key(), &old); err != nil || ok {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(p.ImagePath(vid), &st) != nil || st.Dev != ld.Dev || st.Ino != ld.Ino {
			continue
		}
		v, err := p.Load(vid)
		if err != nil || !slices.ContainsFunc(v.Staged, func(s pool.StageRecord) bool { return s.Node == d.opts.NodeID }) {
			continue
		}
		release, err := d.hold(vid.String(), holdAdoptDevices)
		if err != nil {
			continue
		}
		err = d.notePool(p, ld.Dev)
		if err == nil {
			err = d.opts.State.Put(stagesKind, rec.key(), rec)
		}
		release()
		if err != nil {
			klog.FromContext(ctx).Error(err, "Recording a loop device staged before this node kept records", "volume", vid, "device", ld.Device)
			continue
		}
		klog.FromContext(ctx).Info("Recorded a loop device staged before this node kept records", "volume", vid, "device", ld.Device)
	}
}

// poolDevs are the device numbers this node saw the pool's filesystem answer
// with.
func (d *layoutDeps) poolDevs(name string) []uint64 {
	var rec poolRecord
	if _, err := d.state.Get(poolsKind, name, &rec); err != nil {
		klog.ErrorS(err, "Reading this node's record of a pool", "pool", name)
	}
	return rec.Devs
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
func planFence(devs []mount.LoopDevice, recs []stageRecord, fsDevs []uint64, unreadable bool) fencePlan {
	var plan fencePlan
	take := map[string]bool{}
	matched := map[string]bool{}
	fs := slices.Clone(fsDevs)
	for _, r := range recs {
		fs = append(fs, r.FileDev)
		found := false
		for _, ld := range devs {
			if r.holds(ld) || ld.Err != nil && r.Device != "" && ld.Device == r.Device {
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
