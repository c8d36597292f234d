package fence

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// A lease renewed into whatever shows at a pool's path says "this node is
// alive and fences itself if cut off" to the nodes that read that
// filesystem. Where the path no longer shows the filesystem this node's loop
// devices write to (an empty filesystem mounted over it, its mount gone, the
// export replaced), such a renewal keeps this node's own fence quiet while
// the pool's other nodes see its lease go stale and take its volumes: two
// writers. So before each renewal the keeper checks, from this node's own
// records and the kernel (never from the pool's path alone), that each image
// it has attached read from the pool is still the file the path shows.

// ErrWritersElsewhere marks a renewal refused because the pool's path does
// not show an image this node's loop device writes to (missing there, or
// another file): the path shows another filesystem than the node's writers.
// It wraps pool.ErrUnavailable, so the renewal is cut off, and the node
// fences at the lease's duration.
var ErrWritersElsewhere = fmt.Errorf("%w: this node's loop devices write to a filesystem the pool's path no longer shows", pool.ErrUnavailable)

// named are the records of recs that a loop device of devs stands for
// (StageRecord.Names), a fenced device only if withFenced.
func named(recs []layout.StageRecord, devs []mount.LoopDevice, withFenced bool) []layout.StageRecord {
	var out []layout.StageRecord
	for _, r := range recs {
		if slices.ContainsFunc(devs, func(ld mount.LoopDevice) bool { return (withFenced || !ld.Fenced) && r.Names(ld) }) {
			out = append(out, r)
		}
	}
	return out
}

// attached are the records of recs whose loop device the kernel shows
// attached and not fenced: the images this node writes (or reads) now. A
// record without a device attached (a stale one, its image rightly deleted
// since) does not count.
func attached(recs []layout.StageRecord, devs []mount.LoopDevice) []layout.StageRecord {
	return named(recs, devs, false)
}

// identityWait bounds the kernel's identification of loop devices during
// a renewal: a renewal does not wait longer on a hung backing filesystem than
// the fence would (a pool that hangs is the renewal's timeout anyway).
func (k *Keeper) identityWait() time.Duration {
	return min(layout.IdentifyWait, max(k.timing.Interval/2, time.Millisecond))
}

// VerifyWriters fails (ErrWritersElsewhere) when pool p's path does not show
// an image this node has a loop device attached from: resolved below the
// pool's root without links, it is missing, or not the file the device
// holds (st_dev, st_ino). nil when it does, or this node holds no device of
// the pool. Records that cannot be read are left out (the fence fails closed
// on them when it runs); a kernel list that fails fails the check.
func (k *Keeper) VerifyWriters(p *pool.Pool) error {
	recs, _ := k.deps.Node.PoolRecords(p.Name())
	if len(recs) == 0 {
		return nil
	}
	devs, err := k.deps.Node.Loops.List(k.identityWait())
	if err != nil {
		return fmt.Errorf("pool %s: listing the kernel's loop devices to check that the pool's path shows this node's images: %w", p.Name(), err)
	}
	var wrong []string
	for _, r := range attached(recs, devs) {
		vid, err := pool.ParseVolumeID(r.Volume)
		if err != nil {
			continue
		}
		dev, ino, err := p.Images().Identity(vid)
		switch {
		case err != nil && !errors.Is(err, pool.ErrNotFound):
			// The pool does not answer, or answers with an error: the
			// renewal is classified by it (cut off, or another cause).
			return fmt.Errorf("pool %s: checking that the path shows the image of volume %s (loop device %s): %w", p.Name(), r.Volume, r.Device, err)
		case err != nil:
			wrong = append(wrong, fmt.Sprintf("volume %s (loop device %s): no image at the pool's path", r.Volume, r.Device))
		case !sameImage(recs, r, dev, ino):
			wrong = append(wrong, fmt.Sprintf("volume %s (loop device %s): the pool's path shows another file (%d:%d, the device holds %d:%d)", r.Volume, r.Device, dev, ino, r.FileDev, r.FileIno))
		}
	}
	if len(wrong) > 0 {
		return fmt.Errorf("%w: pool %s at %s (covered by another mount, its mount gone, or replaced): %s", ErrWritersElsewhere, p.Name(), p.Path(), strings.Join(wrong, "; "))
	}
	return nil
}

// sameImage tells whether the path's identity (dev, ino) is the image of
// record r: r's own, or that of another record of the same volume and
// device (the file's stat and the kernel differ on some filesystems, btrfs
// subvolumes among them, and the node records both: layout.NoteDevice).
func sameImage(recs []layout.StageRecord, r layout.StageRecord, dev, ino uint64) bool {
	if r.FileDev == dev && r.FileIno == ino {
		return true
	}
	return r.Device != "" && slices.ContainsFunc(recs, func(o layout.StageRecord) bool {
		return o.Volume == r.Volume && o.Device == r.Device && o.FileDev == dev && o.FileIno == ino
	})
}

// LayoutGuard is the node plugin's guard over laying out pool name by itself
// (pool.WithLayoutGuard): it refuses while this node's records hold a loop
// device attached from an image of the pool. The pool was there, so a path
// that shows no pool.json is the pool lost, not a pool mounted late, even to a
// process that has not seen it (a restart with the path covered). Once the
// devices are detached, the records go, and so does the refusal.
func LayoutGuard(deps *layout.Deps, name string) func() error {
	return func() error {
		recs, _ := deps.PoolRecords(name)
		if len(recs) == 0 {
			return nil
		}
		devs, err := deps.Loops.List(layout.IdentifyWait)
		if err != nil {
			return fmt.Errorf("%w: pool %s: not laid out: listing the kernel's loop devices to check this node's records of the pool: %w", pool.ErrUnavailable, name, err)
		}
		var held []string
		for _, r := range named(recs, devs, true) {
			if !slices.Contains(held, r.Volume) {
				held = append(held, r.Volume)
			}
		}
		if len(held) == 0 {
			return nil
		}
		return fmt.Errorf("%w: pool %s: not laid out: this node holds loop devices attached from the pool's images (volumes %s, by its records), so a path without the pool's pool.json is the pool's filesystem gone from the path (covered, unmounted, replaced), not a new pool",
			pool.ErrUnavailable, name, strings.Join(held, ", "))
	}
}
