package layout

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

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
	// StagesKind holds one record per image attached (or about to be) for
	// a stage or an inline volume of a shared pool, keyed
	// <volume>@<st_dev>-<st_ino>.
	StagesKind = "stages"
	// PoolsKind holds, per shared pool, the device numbers its filesystem
	// answered with while this node staged from it.
	PoolsKind = "pools"
	// IdentifyWait bounds how long the node waits for the kernel to
	// identify loop devices' backing files: a hung filesystem must not
	// hold up a fence.
	IdentifyWait = 2 * time.Second
)

// StageRecord is this node's record of one image of a shared pool it attached.
type StageRecord struct {
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
func (r StageRecord) Key() string {
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
func (r StageRecord) Holds(ld mount.LoopDevice) bool {
	return ld.Err == nil && ld.Dev == r.FileDev && ld.Ino == r.FileIno
}

// Names tells whether loop device ld is the one r stands for: it holds the
// file r records, or the kernel cannot identify its file (its filesystem
// fails or hangs) and it is the device r names. The fence, the renewals'
// check of this node's writers and the layout guard all match records so.
func (r StageRecord) Names(ld mount.LoopDevice) bool {
	return r.Holds(ld) || ld.Err != nil && r.Device != "" && ld.Device == r.Device
}

// poolRecord is what this node remembers of a shared pool's filesystem.
type poolRecord struct {
	Pool string   `json:"pool"`
	Devs []uint64 `json:"devs"`
}

// recordsMu serialises the read-modify-write of pool records.
var recordsMu sync.Mutex

// readOnlyCaps tells whether a node call's capability only ever reads.
func readOnlyCaps(c params.Caps) bool { return c.ReadOnly() }

// noteStage writes the record of image before it is attached, so that no
// crash between the two can leave a device this node does not know of. image
// is the path the attach will open (the pool's descriptor of it).
func (d *Deps) NoteStage(nv NodeVolume, image string) (StageRecord, error) {
	if !nv.Pool.Shared() {
		return StageRecord{}, nil
	}
	var st unix.Stat_t
	if err := unix.Stat(image, &st); err != nil {
		return StageRecord{}, csierr.Failf(pool.ErrUnavailable, "volume %s: identify its image for this node's records: %w", nv.ID, err)
	}
	rec := StageRecord{Pool: nv.Pool.Name(), Volume: nv.ID.String(), FileDev: st.Dev, FileIno: st.Ino, ReadOnly: readOnlyCaps(nv.Caps), At: time.Now().UTC()}
	var old StageRecord
	if ok, err := d.State.Get(StagesKind, rec.Key(), &old); err == nil && ok {
		// The image is still attached from before (a retried stage): one
		// read-write use of it makes the record read-write.
		rec.ReadOnly = rec.ReadOnly && old.ReadOnly
		rec.Device = old.Device
	}
	if err := d.NotePool(nv.Pool, st.Dev); err != nil {
		return StageRecord{}, err
	}
	if err := d.State.Put(StagesKind, rec.Key(), rec); err != nil {
		return StageRecord{}, csierr.Failf(pool.ErrUnavailable, "volume %s: this node cannot record its stage, so its fence could not find the device: %w", nv.ID, err)
	}
	return rec, nil
}

// notePool adds the pool's filesystem device numbers (its root's and dev's)
// to the pool's record.
func (d *Deps) NotePool(p *pool.Pool, dev uint64) error {
	devs := []uint64{dev}
	var st unix.Stat_t
	if err := unix.Stat(p.Path(), &st); err == nil {
		devs = append(devs, st.Dev)
	}
	recordsMu.Lock()
	defer recordsMu.Unlock()
	var rec poolRecord
	if _, err := d.State.Get(PoolsKind, p.Name(), &rec); err != nil {
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
	if err := d.State.Put(PoolsKind, p.Name(), rec); err != nil {
		return csierr.Failf(pool.ErrUnavailable, "pool %s: this node cannot record its filesystem: %w", p.Name(), err)
	}
	return nil
}

// noteDevice completes rec with the device the image was attached to, as the
// kernel identifies it: should the kernel report another identity than the
// file's stat did, the kernel's is recorded too (the fence matches the
// kernel's).
func (d *Deps) NoteDevice(ctx context.Context, rec StageRecord, dev string) error {
	if rec.Pool == "" || rec.Device == dev {
		return nil
	}
	rec.Device = dev
	if devs, err := d.Loops.List(IdentifyWait); err == nil {
		for _, ld := range devs {
			if ld.Device == dev && ld.Err == nil && (ld.Dev != rec.FileDev || ld.Ino != rec.FileIno) {
				klog.FromContext(ctx).Info("The kernel identifies the image's loop device otherwise than the file's stat did; recording both", "volume", rec.Volume, "device", dev,
					"stat", fmt.Sprintf("%d:%d", rec.FileDev, rec.FileIno), "kernel", fmt.Sprintf("%d:%d", ld.Dev, ld.Ino))
				other := rec
				other.FileDev, other.FileIno = ld.Dev, ld.Ino
				if err := d.State.Put(StagesKind, other.Key(), other); err != nil {
					return csierr.Failf(pool.ErrUnavailable, "volume %s: record its loop device: %w", rec.Volume, err)
				}
			}
		}
	}
	if err := d.State.Put(StagesKind, rec.Key(), rec); err != nil {
		return csierr.Failf(pool.ErrUnavailable, "volume %s: record its loop device: %w", rec.Volume, err)
	}
	return nil
}

// volumeRecords are this node's records of volume vid.
func (d *Deps) VolumeRecords(vid pool.VolumeID) ([]StageRecord, error) {
	keys, err := d.State.Keys(StagesKind)
	if err != nil {
		return nil, err
	}
	var out []StageRecord
	for _, k := range keys {
		if !strings.HasPrefix(k, volumePrefix(vid)+"@") {
			continue
		}
		var r StageRecord
		if ok, err := d.State.Get(StagesKind, k, &r); err != nil {
			return nil, err
		} else if ok {
			out = append(out, r)
		}
	}
	return out, nil
}

// poolRecords are this node's records of images of the pool named name.
func (d *Deps) PoolRecords(name string) ([]StageRecord, error) {
	keys, err := d.State.Keys(StagesKind)
	if err != nil {
		return nil, err
	}
	var out []StageRecord
	var errs []error
	for _, k := range keys {
		var r StageRecord
		if ok, err := d.State.Get(StagesKind, k, &r); err != nil {
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
func (d *Deps) RecordedPools(readWrite bool) ([]string, error) {
	keys, err := d.State.Keys(StagesKind)
	if err != nil {
		return nil, err
	}
	var out []string
	var errs []error
	for _, k := range keys {
		var r StageRecord
		if ok, err := d.State.Get(StagesKind, k, &r); err != nil {
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
func (d *Deps) ForgetStages(ctx context.Context, vid pool.VolumeID) {
	recs, err := d.VolumeRecords(vid)
	if err != nil || len(recs) == 0 {
		if err != nil {
			klog.FromContext(ctx).Error(err, "Reading this node's stage records", "volume", vid)
		}
		return
	}
	devs, err := d.Loops.List(IdentifyWait)
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
			if !r.Holds(ld) && (ld.Err == nil || r.Device == "" && !strings.HasSuffix(ld.Backing, "/"+vid.Key+"/disk.img")) {
				continue
			}
			// This node's fenced device of the image: let go of it here,
			// where its backing file may not be found any more (a FUSE
			// daemon killed, a client evicted: the file answers neither by
			// path nor by identity).
			if ld.Fenced {
				if err := d.Loops.DetachFenced(ld.Device); err == nil {
					klog.FromContext(ctx).Info("Detached this node's fenced loop device of the volume", "volume", vid, "device", ld.Device)
					continue
				}
			}
			still = true
		}
		if still {
			continue
		}
		if err := d.State.Delete(StagesKind, r.Key()); err != nil {
			klog.FromContext(ctx).Error(err, "Dropping this node's stage record", "volume", vid)
		}
	}
}

// recordedDevice tells whether dev is a loop device that this node's records
// name for volume vid and that still holds the recorded file, or whose backing
// file the kernel cannot identify while sysfs shows the volume's image.
func (d *Deps) RecordedDevice(vid pool.VolumeID, dev string) bool {
	if d.State == nil || !strings.HasPrefix(dev, "/dev/") {
		return false
	}
	recs, err := d.VolumeRecords(vid)
	if err != nil || !slices.ContainsFunc(recs, func(r StageRecord) bool { return r.Device == dev }) {
		return false
	}
	devs, err := d.Loops.List(IdentifyWait)
	if err != nil {
		return false
	}
	for _, ld := range devs {
		if ld.Device != dev {
			continue
		}
		for _, r := range recs {
			if r.Device == dev && (r.Holds(ld) || ld.Err != nil && strings.HasSuffix(ld.Backing, "/"+vid.Key+"/disk.img")) {
				return true
			}
		}
	}
	return false
}

// poolDevs are the device numbers this node saw the pool's filesystem answer
// with.
func (d *Deps) PoolDevs(name string) []uint64 {
	var rec poolRecord
	if _, err := d.State.Get(PoolsKind, name, &rec); err != nil {
		klog.ErrorS(err, "Reading this node's record of a pool", "pool", name)
	}
	return rec.Devs
}
