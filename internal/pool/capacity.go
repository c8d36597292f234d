package pool

import (
	"fmt"
	"math"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Size units and limits of volume capacities.
const (
	MiB = int64(1) << 20
	GiB = int64(1) << 30
	// DefaultCapacity is used when a request names no size at all.
	DefaultCapacity = 1 * GiB
	// MaxCapacity bounds one volume; beyond it a request is OUT_OF_RANGE rather than a
	// sparse file no filesystem here could ever back.
	MaxCapacity = 64 << 40
)

// Capacity turns a CSI capacity range into the size to allocate: the required size
// (or DefaultCapacity when none is asked), raised to minimum, rounded up to whole MiB,
// and never above limit. Rounding keeps image files, loop devices and filesystems on
// boundaries every tool agrees on.
func Capacity(required, limit, minimum int64) (int64, error) {
	if required < 0 || limit < 0 {
		return 0, fmt.Errorf("%w: negative size (required %d, limit %d)", ErrBadRange, required, limit)
	}
	if limit > 0 && required > limit {
		return 0, fmt.Errorf("%w: required_bytes %d is above limit_bytes %d", ErrBadRange, required, limit)
	}
	// Before any arithmetic: rounding a size near 2^63 up to whole MiB wraps
	// it negative.
	if required > MaxCapacity || minimum > MaxCapacity {
		return 0, fmt.Errorf("%w: %d bytes is above the largest volume poolcsi makes (%d bytes)", ErrOutOfRange, max(required, minimum), int64(MaxCapacity))
	}
	size := required
	if size == 0 {
		size = DefaultCapacity
		if limit > 0 && limit < size {
			size = limit / MiB * MiB // the largest whole-MiB size the limit allows
		}
	}
	size = max(size, minimum)
	size = (size + MiB - 1) / MiB * MiB
	if limit > 0 && size > limit {
		return 0, fmt.Errorf("%w: the smallest size this volume can have is %d bytes (whole MiB, at least %d for its filesystem), above limit_bytes %d", ErrOutOfRange, size, minimum, limit)
	}
	if size > MaxCapacity {
		return 0, fmt.Errorf("%w: %d bytes is above the largest volume poolcsi makes (%d bytes)", ErrOutOfRange, size, int64(MaxCapacity))
	}
	return size, nil
}

// Usage is the pool's space as capacity accounting sees it.
type Usage struct {
	TotalBytes int64 // size of the pool's filesystem
	FreeBytes  int64 // bytes an unprivileged writer can still use
	// ProvisionedBytes is the sum of the volumes' capacities.
	ProvisionedBytes int64
	// UnbackedBytes is what sparse images may still grow into: the sum over volumes of
	// capacity minus the blocks already allocated. Writes fail with ENOSPC inside a
	// pod when this exceeds FreeBytes.
	UnbackedBytes int64
	Volumes       int
	// Snapshots and SnapshotBytes count the pool's snapshots and the blocks their
	// copies allocated (or share with their source, for reflinked copies). A
	// reflinked snapshot's blocks are also counted in UnbackedBytes: writing to
	// the source unshares them, and that allocation must fit too.
	Snapshots     int
	SnapshotBytes int64
	// ReflinkedBytes is the part of SnapshotBytes that reflinked snapshots
	// share with their sources (counted in UnbackedBytes too).
	ReflinkedBytes int64
}

// AvailableBytes is how large a new volume (or a growth) may be under the pool's
// overcommit policy: free space times the overcommit ratio, less every promise
// already made and not yet backed by allocated blocks.
func (lg Ledger) AvailableBytes(u Usage) int64 {
	avail := float64(u.FreeBytes)*lg.p.cfg.Overcommit - float64(u.UnbackedBytes)
	if avail <= 0 {
		return 0
	}
	return int64(math.Min(avail, float64(math.MaxInt64)))
}

// Usage measures the pool: it stats every image and reads every snapshot.json
// (volume.json only when it changed). Capacity decisions use the ledger
// (ledger.go), and measure only a pool the ledger's bound would refuse.
func (lg Ledger) Usage() (Usage, error) {
	lg.p.settleTrash()
	var st unix.Statfs_t
	if err := unix.Statfs(lg.p.cfg.Path, &st); err != nil {
		return Usage{}, fmt.Errorf("%w: statfs pool %s: %w", ErrUnavailable, lg.p.cfg.Name, err)
	}
	u := Usage{
		TotalBytes: int64(st.Blocks) * st.Bsize,
		FreeBytes:  int64(st.Bavail) * st.Bsize,
	}
	keys, err := lg.p.volumeKeys()
	if err != nil {
		return Usage{}, err
	}
	for _, key := range keys {
		id := lg.p.IDOf(key)
		v, err := lg.loadForUsage(id)
		if err != nil {
			continue // deleted meanwhile, or damaged: health reports it
		}
		u.Volumes++
		u.ProvisionedBytes += v.capacity
		u.UnbackedBytes += max(v.capacity-lg.allocatedBytes(id, v.layout), 0)
	}
	lg.pruneMeta(keys)
	snaps, err := lg.p.Snapshots().List()
	if err != nil {
		return Usage{}, err
	}
	for _, e := range snaps {
		if e.Err != nil {
			continue
		}
		u.Snapshots++
		u.SnapshotBytes += e.Snapshot.AllocatedBytes
		u.UnbackedBytes += reflinked(e.Snapshot)
		u.ReflinkedBytes += reflinked(e.Snapshot)
	}
	return u, nil
}

// allocatedBytes is what a volume already holds on the pool's filesystem.
func (lg Ledger) allocatedBytes(id VolumeID, layout Layout) int64 {
	if layout != LayoutImage {
		return 0
	}
	var st unix.Stat_t
	if err := unix.Stat(lg.p.ImagePath(id), &st); err != nil {
		return 0 // a missing image backs nothing; health checks report it
	}
	return st.Blocks * 512
}

// metaStamp identifies one version of a volume.json: every write renames a new
// file into place, so a new version has a new inode.
type metaStamp struct {
	ino, size uint64
	mtime     unix.Timespec
}

// usageMeta is what capacity accounting needs of a volume.json. Only this is
// cached, not the parsed volume: with 10,000 volumes the whole records (names,
// parameters, topology, stage and publish records) would be megabytes kept
// for two fields.
type usageMeta struct {
	capacity int64
	layout   Layout
}

type cachedMeta struct {
	stamp metaStamp
	usageMeta
}

// loadForUsage is Load for capacity accounting, which reads every volume on
// every decision: a volume.json unchanged since it was last read (same inode,
// size and mtime: one stat) is not read and parsed again. Only the capacity
// and layout are used from it.
func (lg Ledger) loadForUsage(id VolumeID) (usageMeta, error) {
	var st unix.Stat_t
	if err := unix.Lstat(lg.p.MetadataPath(id), &st); err != nil {
		return usageMeta{}, err
	}
	stamp := metaStamp{ino: st.Ino, size: uint64(st.Size), mtime: st.Mtim}
	if c, ok := lg.p.meta.Load(id.Key); ok && c.(cachedMeta).stamp == stamp {
		return c.(cachedMeta).usageMeta, nil
	}
	v, err := lg.p.Load(id)
	if err != nil {
		lg.p.meta.Delete(id.Key)
		return usageMeta{}, err
	}
	m := usageMeta{capacity: v.CapacityBytes, layout: v.Layout}
	lg.p.meta.Store(id.Key, cachedMeta{stamp: stamp, usageMeta: m})
	return m, nil
}

// pruneMeta forgets the cached metadata of volumes no longer in the pool.
func (lg Ledger) pruneMeta(keys []string) {
	lg.p.meta.Range(func(k, _ any) bool {
		if i := sort.SearchStrings(keys, k.(string)); i == len(keys) || keys[i] != k.(string) {
			lg.p.meta.Delete(k)
		}
		return true
	})
}

// capacityTTL is how long GetCapacity reuses its measurement of the images'
// allocated blocks while the ledger shows no change. csi-provisioner asks for
// every topology segment and StorageClass in one poll (every minute by
// default): the calls of one poll share one measurement.
const capacityTTL = 10 * time.Second

// capacityCache is the images' allocated bytes as last measured, with the
// ledger state they were measured against.
type capacityCache struct {
	mu        sync.Mutex
	ledger    ledger // its tally, pending entry and stamps; Sum cleared
	at        time.Time
	allocated int64 // Σ over volumes of min(allocated, capacity)
}

// Capacity is what GetCapacity reports: AvailableBytes of the pool, computed
// from the capacity ledger when it can be trusted (no volume.json or
// snapshot.json read: the counts are the ledger's), with the blocks the images
// already hold measured at most once per capacityTTL while the ledger does not
// change. A ledger that is missing, damaged or older than the pool's
// directories is not trusted, and the pool is measured exactly (Usage), as
// every admission the ledger cannot decide does.
//
// Between measurements, writes inside a volume only lower the figure against
// the truth (the free space they take is seen at once, the blocks they fill
// only at the next measurement); a create, growth, snapshot or delete changes
// the ledger and so measures again.
func (lg Ledger) Capacity() (int64, error) {
	u, _, err := lg.capacityUsage()
	if err != nil {
		return 0, err
	}
	return lg.AvailableBytes(u), nil
}

// capacityUsage is the free and unbacked bytes Capacity decides from, and
// whether they came from the ledger (else from a measurement of the pool).
func (lg Ledger) capacityUsage() (Usage, bool, error) {
	lg.p.settleTrash()
	l, err := lg.read()
	if err != nil || !lg.decides() {
		u, err := lg.Usage()
		return u, false, err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(lg.p.cfg.Path, &st); err != nil {
		return Usage{}, false, fmt.Errorf("%w: statfs pool %s: %w", ErrUnavailable, lg.p.cfg.Name, err)
	}
	allocated, err := lg.allocatedFor(l)
	if err != nil {
		return Usage{}, false, err
	}
	unbacked := max(l.ProvisionedBytes-allocated, 0) + l.ReflinkedBytes
	return Usage{FreeBytes: int64(st.Bavail) * st.Bsize, UnbackedBytes: unbacked}, true, nil
}

// allocatedFor is Σ min(allocated, capacity) over the pool's volumes, reused
// while the ledger is l and the measurement is younger than capacityTTL.
func (lg Ledger) allocatedFor(l ledger) (int64, error) {
	l.Sum = ""
	c := &lg.p.capacity
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ledger == l && time.Since(c.at) < capacityTTL {
		return c.allocated, nil
	}
	keys, err := lg.p.volumeKeys()
	if err != nil {
		return 0, err
	}
	at := time.Now()
	var sum int64
	for _, key := range keys {
		id := lg.p.IDOf(key)
		v, err := lg.loadForUsage(id)
		if err != nil {
			continue // as Usage: deleted meanwhile, or damaged
		}
		sum += min(lg.allocatedBytes(id, v.layout), v.capacity)
	}
	c.ledger, c.at, c.allocated = l, at, sum
	return sum, nil
}
