package freeze

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// clearFreeze removes this node's record of a freeze after its thaw. A
// record left behind is harmless (the next start finds the filesystem thawed)
// but is logged.
func (f *Freezer) clearFreeze(ctx context.Context, vid pool.VolumeID) {
	if err := f.deps.Node.State.Delete(RecordKind, vid.String()); err != nil {
		klog.FromContext(ctx).Error(err, "Removing a freeze record failed", "volume", vid)
	}
}

// ThawAfterCrash thaws, in the background, filesystems a previous process
// froze for a snapshot and died before thawing: otherwise every write of the
// pods using them would hang until someone ran fsfreeze -u by hand. It
// returns at once: serving (Probe first) never waits for it, whatever a pool
// or a mount does. The freeze agent and local freezes start freezing only
// once it is done, so its thaws never end a new freeze.
func (f *Freezer) ThawAfterCrash(ctx context.Context) {
	var pools []*pool.Pool
	for _, pn := range f.deps.Names() {
		if p := f.deps.Pool(pn); p != nil {
			pools = append(pools, p)
		}
	}
	f.ThawAfterCrashOf(ctx, pools)
}

// ThawAfterCrashOf is ThawAfterCrash over the pools given: a pool that did
// not answer at start gets its part later, before it serves (ThawPool).
// What this node's own records say it froze is thawed whatever pools are
// given.
func (f *Freezer) ThawAfterCrashOf(ctx context.Context, pools []*pool.Pool) {
	if !f.deps.NodePlugin {
		return
	}
	done := make(chan struct{})
	f.mu.Lock()
	f.recovered = done
	f.mu.Unlock()
	timeout := f.RecoveryTimeout
	go func() {
		defer close(done)
		f.recoverFreezes(context.WithoutCancel(ctx), pools, timeout)
	}()
}

// recoverFreezes is ThawAfterCrash's work, given up after timeout (what is
// still running then goes on, holding its volume's lock). First every shared
// pool's "frozen" answers of this node are rewritten "thawed" (before any
// thaw: the controller must not take a thaw it was not told of for a
// freeze); then what this node's own records say it froze is thawed, through
// the same checks as a freeze. A pool's records are never opened as paths:
// a "frozen" file an older version left in a volume's directory only selects
// which of this node's own mounts of that volume is thawed.
func (f *Freezer) recoverFreezes(ctx context.Context, pools []*pool.Pool, timeout time.Duration) {
	log := klog.FromContext(ctx)
	deadline := time.Now().Add(timeout)
	var answers []func()
	for _, p := range pools {
		answers = append(answers, func() { f.abandonFreezeAnswers(ctx, p) })
	}
	if !runUntil(deadline, answers) {
		log.Info("A pool did not answer while the thaws of a crashed freeze were written down; thawing all the same", "timeout", timeout)
	}
	var thaws []func()
	keys, err := f.deps.Node.State.Keys(RecordKind)
	if err != nil {
		log.Error(err, "Cannot read this node's freeze records; nothing left frozen by a crash is thawed")
	}
	for _, key := range keys {
		var rec Record
		ok, err := f.deps.Node.State.Get(RecordKind, key, &rec)
		if err != nil || !ok {
			log.Error(err, "Unreadable freeze record", "record", key)
			continue
		}
		thaws = append(thaws, f.recoveryThaw(ctx, key, func() (string, error) {
			return rec.Path, f.deps.Node.FS.ThawMount(f.deps.Node.PathPrefix, rec.Path, rec.Device)
		}))
	}
	// Older versions recorded freezes in the pool: only which volume is
	// taken from those, never a path.
	for _, p := range pools {
		thaws = append(thaws, func() { f.thawOlderRecords(ctx, p) })
	}
	if !runUntil(deadline, thaws) {
		log.Info("Thawing what a crash left frozen has not finished; the freeze agent starts all the same (a volume still being thawed stays locked)", "timeout", timeout)
	}
}

// ThawPool is the part of ThawAfterCrash that reads pool p, for a pool that
// did not answer when ThawAfterCrashOf ran: this node's "frozen" answers in it
// are rewritten "thawed", then what an older version recorded there as frozen
// by this node is thawed. It returns when done; the caller keeps the pool
// from every call (and from the freeze agent) until then.
func (f *Freezer) ThawPool(ctx context.Context, p *pool.Pool) {
	if !f.deps.NodePlugin {
		return
	}
	f.abandonFreezeAnswers(ctx, p)
	f.thawOlderRecords(ctx, p)
}

// thawOlderRecords thaws what an older version recorded in p as frozen by
// this node: only which volume is taken from those records, never a path.
func (f *Freezer) thawOlderRecords(ctx context.Context, p *pool.Pool) {
	log := klog.FromContext(ctx)
	freezes, err := p.Freezes().Records()
	if err != nil {
		log.V(2).Info("Cannot look for freezes an older version recorded in the pool", "pool", p.Name(), "err", err)
		return
	}
	for _, old := range freezes {
		if old.Node != f.deps.NodeID {
			continue // another node's freeze, on a shared pool
		}
		f.recoveryThaw(ctx, old.Volume.String(), func() (string, error) { return f.thawVolumeHere(p, old.Volume) })()
		if err := p.Freezes().ClearRecord(old.Volume); err != nil {
			log.Error(err, "Removing an older version's freeze record failed", "volume", old.Volume)
		}
	}
}

// recoveryLockPoll is how often a recovery thaw tries a busy volume's lock.
const recoveryLockPoll = 20 * time.Millisecond

// recoveryThaw is one thaw of recoverFreezes, under the volume's lock.
func (f *Freezer) recoveryThaw(ctx context.Context, volume string, thaw func() (path string, err error)) func() {
	return func() {
		log := klog.FromContext(ctx).WithValues("volume", volume)
		// Waited for, never skipped: other start-up work (the lease keeper's
		// dropStaleRecords) or a call may hold the volume a moment. A thaw
		// skipped leaves the filesystem frozen for good (the next freeze
		// fails on it and drops the record), and an unstage then unmounts it
		// frozen: its superblock keeps the loop device open, attached.
		var release func()
		busy := false
		_ = wait.PollUntilContextCancel(ctx, recoveryLockPoll, true, func(context.Context) (bool, error) {
			r, err := f.deps.Lock(volume, HolderThaw)
			if err != nil && !busy {
				busy = true
				log.Info("Waiting to thaw a filesystem left frozen by a crash: the volume is busy", "reason", err.Error())
			}
			release = r
			return err == nil, nil
		})
		if release == nil {
			return
		}
		defer release()
		path, err := thaw()
		if err != nil {
			log.Error(err, "Thawing a filesystem left frozen by a crash failed", "path", path)
			if !errors.Is(err, mount.ErrNotTheMount) {
				return // kept for the next start
			}
		} else if path != "" {
			log.Info("Thawed a filesystem left frozen by a crash during a snapshot", "path", path)
		}
		if id, err := pool.ParseVolumeID(volume); err == nil {
			f.clearFreeze(ctx, id)
		} else if err := f.deps.Node.State.Delete(RecordKind, volume); err != nil {
			log.Error(err, "Removing a freeze record failed")
		}
	}
}

// thawVolumeHere thaws this node's own mount of volume id of p, found as
// FreezeVolumeHere finds it (ownDevice); "" when the volume has none here.
func (f *Freezer) thawVolumeHere(p *pool.Pool, id pool.VolumeID) (string, error) {
	dev, _, err := f.ownDevice(p, id)
	if err != nil || dev == "" {
		return "", err
	}
	points, err := f.deps.Node.Mounts.MountPoints(dev)
	if err != nil {
		return "", fmt.Errorf("read the mount table: %w", err)
	}
	for _, path := range points {
		if err := f.deps.Node.FS.ThawMount(f.deps.Node.PathPrefix, path, dev); !errors.Is(err, mount.ErrNotTheMount) {
			return path, err
		}
	}
	return "", nil
}

// runUntil runs every f on a goroutine of its own and waits until all have
// returned or deadline passes; true when all returned.
func runUntil(deadline time.Time, fs []func()) bool {
	var wg sync.WaitGroup
	for _, f := range fs {
		wg.Add(1)
		go func() { defer wg.Done(); f() }()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}
