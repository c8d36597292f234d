package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// snapshotCaps are the controller capabilities of snapshots and clones.
var snapshotCaps = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
}

// parseSnapshotRef validates a snapshot ID from the wire. A well-formed ID is
// returned with known=true. An ID of another form cannot name a poolcsi snapshot:
// the CSI spec wants it treated as not found (known=false), unless it is hostile
// (path characters, control characters, over-long), which is INVALID_ARGUMENT.
func parseSnapshotRef(field, raw string) (id pool.SnapshotID, known bool, err error) {
	if raw == "" {
		return id, false, status.Errorf(codes.InvalidArgument, "%s is required", field)
	}
	id, perr := pool.ParseSnapshotID(raw)
	if perr == nil {
		return id, true, nil
	}
	if pool.HostileID(raw) {
		return id, false, status.Errorf(codes.InvalidArgument, "%s: %v", field, perr)
	}
	return id, false, nil
}

// csiSnapshot is a snapshot as the CO knows it: its ID and its source's (in
// the same pool) with the pool's share tag, and a member's group's.
func (d *Driver) csiSnapshot(p *pool.Pool, s *pool.Snapshot) *csi.Snapshot {
	out := &csi.Snapshot{
		SnapshotId:     d.pools.WireID(p, s.ID),
		SourceVolumeId: d.pools.WireID(p, s.SourceVolumeID),
		SizeBytes:      s.SizeBytes,
		CreationTime:   timestamppb.New(s.CreatedAt),
		ReadyToUse:     s.ReadyToUse,
	}
	if s.GroupSnapshotID != "" {
		out.GroupSnapshotId = d.pools.WireID(p, s.GroupSnapshotID)
	}
	return out
}

// checkSnapshotParams accepts only the csi.storage.k8s.io/* keys the snapshotter
// adds: poolcsi has no VolumeSnapshotClass parameters, and a typo must not pass.
func checkSnapshotParams(in map[string]string) error {
	for k := range in {
		if !strings.HasPrefix(k, params.K8sPrefix) {
			return status.Errorf(codes.InvalidArgument, "unknown snapshot parameter %q (poolcsi takes none)", k)
		}
	}
	return nil
}

// CreateSnapshot copies a volume's data into <pool>/snapshots/<key>/: a reflink
// where the pool's filesystem has them, a sparse copy otherwise. The snapshot is
// as consistent as a crash at that instant (crash-consistent); an image volume's
// filesystem is frozen around the copy on whichever node has it staged
// (quiesce.go), which makes it a clean filesystem image.
func (d *Driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (_ *csi.CreateSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	name := req.GetName()
	if err := params.CheckRequestName("snapshot", name); err != nil {
		return nil, err
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "source_volume_id is required")
	}
	if err := checkSnapshotParams(req.GetParameters()); err != nil {
		return nil, err
	}
	src, err := d.resolve(ctx, rpcCreateSnapshotSource, req.GetSourceVolumeId(), poolset.Access{Secrets: req.GetSecrets()}, nil)
	if err != nil {
		return nil, err
	}
	vid, p := src.id, src.pool
	sid := p.Snapshots().NewID(name)
	for _, pn := range d.pools.Names() {
		if other := d.pools.Pool(pn); other != p {
			if other.Snapshots().Exists(other.Snapshots().NewID(name)) {
				return nil, csierr.Failf(pool.ErrExists, "snapshot %q already exists in pool %s", name, pn)
			}
		}
	}
	release, err := d.hold(sid.String(), holdCreateSnapshot)
	if err != nil {
		return nil, err
	}
	defer release()
	// A retry of a finished snapshot answers from snapshot.json alone: its
	// source may be busy, or deleted since.
	if s, err := p.Snapshots().Load(sid); err == nil && s.Name == name {
		if s.SourceVolumeID != vid.String() {
			return nil, csierr.Failf(pool.ErrExists, "snapshot %q already exists of volume %s", name, s.SourceVolumeID)
		}
		if s.GroupSnapshotID != "" {
			return nil, csierr.Failf(pool.ErrExists, "snapshot %q already exists, a member of group snapshot %s", name, s.GroupSnapshotID)
		}
		if s.ReadyToUse {
			return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(p, s)}, nil
		}
	}

	v, releaseSrc, err := d.holdVolume(ctx, holdCreateSnapshot, p, vid)
	if err != nil {
		return nil, err
	}
	defer releaseSrc()
	need, err := p.VolumeAllocated(vid, v)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return nil, csierr.Failf(pool.ErrNotFound, "volume %s: its data is missing: %w", vid, err)
	case err != nil:
		// An I/O error or a pool gone is not a missing volume: its own code.
		return nil, fmt.Errorf("volume %s: measure its data: %w", vid, err)
	}
	s, err := p.Snapshots().Reserve(ctx, name, v, need)
	if err != nil {
		return nil, err
	}
	if !s.ReadyToUse {
		if err := d.copySnapshot(ctx, p, vid, v, sid, s); err != nil {
			return nil, err
		}
	}
	return &csi.CreateSnapshotResponse{Snapshot: d.csiSnapshot(p, s)}, nil
}

// copySnapshot fills a reserved snapshot with the source's data and marks it
// ready; an image volume's filesystem is frozen around its copy on whichever
// node has it staged (quiesce.go).
func (d *Driver) copySnapshot(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume, sid pool.SnapshotID, s *pool.Snapshot) error {
	quiesce := func() (func() error, error) { return d.quiesceCopy(ctx, p, vid, v) }
	if err := p.Snapshots().Fill(ctx, s, v, quiesce); err != nil {
		return err
	}
	klog.FromContext(ctx).Info("Created snapshot", "snapshot", sid, "name", s.Name, "source", vid, "size", s.SizeBytes, "allocated", s.AllocatedBytes, "copy", s.CopyMethod)
	return nil
}

// freezeIfStagedHere is quiesceAll's part on this node: it freezes the
// filesystem of an image volume staged here, so its image is clean while it is
// copied, and returns the thaw, which fails (ABORTED, retried) if the freeze's
// bound (--freeze-max-hold) thawed it first. Other nodes are asked through
// their freeze inboxes (quiesce.go). The filesystem is found as the agent
// finds it (ownDevice, freezeVolumeHere): this node's own mount of the loop
// device it staged the volume on, never the staging path the pool records. A stage it cannot tell is
// the volume's mount is not frozen, never a wrong filesystem. Callers hold
// the volume's in-process lock, so no unstage runs meanwhile.
func (d *Driver) freezeIfStagedHere(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (thaw func() error) {
	noop := func() error { return nil }
	if !freezable(v) || !slices.ContainsFunc(v.Staged, func(st pool.StageRecord) bool { return st.Node == d.opts.NodeID }) {
		return noop
	}
	log := klog.FromContext(ctx)
	if !d.freezer.isRecovered() {
		log.Info("Not freezing: the thaws after this node plugin's restart are not done yet; the snapshot is crash-consistent", "volume", vid)
		return noop
	}
	start := time.Now()
	dev, _, err := d.ownDevice(p, vid)
	if err != nil {
		log.Info("Cannot freeze the filesystem; the snapshot is crash-consistent", "volume", vid, "err", err)
		return noop
	}
	h, why, err := d.freezeVolumeHere(ctx, vid, dev, d.freezeTiming.MaxHold)
	if err != nil || h == nil {
		// Not known to be the volume's mount: not frozen (the snapshot is
		// then crash-consistent), never a wrong filesystem frozen.
		log.Info("Cannot freeze the filesystem; the snapshot is crash-consistent", "volume", vid, "why", why, "err", err)
		return noop
	}
	log.Info("Froze filesystem for a snapshot", "volume", vid, "path", h.path)
	return func() error {
		expired := h.fs.Expired()
		if err := d.thawHere(ctx, h); err != nil {
			log.Error(err, "Thawing the filesystem after a snapshot failed; its bound thaws it", "volume", vid, "path", h.path)
		} else {
			log.Info("Thawed filesystem", "volume", vid, "path", h.path)
		}
		if expired {
			return csierr.Failf(pool.ErrBusy, "the filesystem of volume %s was thawed at its bound of %s (--freeze-max-hold) before the copy ended (it took %s), so the copy is not of one point in time: retry (raise --freeze-max-hold for copies this long)",
				vid, d.freezeTiming.MaxHold, time.Since(start).Round(time.Millisecond))
		}
		return nil
	}
}

// DeleteSnapshot is idempotent: an unknown or already deleted snapshot is success.
// Volumes made from a snapshot are independent copies, so nothing refuses it,
// except that a member of a group snapshot that still exists is deleted only
// with its group: INVALID_ARGUMENT, as CSI says (the snapshotter never asks).
func (d *Driver) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (_ *csi.DeleteSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	sid, known, err := parseSnapshotRef("snapshot_id", req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	if !known {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	p, err := d.pools.Ensure(ctx, poolset.SnapshotRef(sid), poolset.Access{Secrets: req.GetSecrets()})
	if errors.Is(err, csierr.ErrNoPool) {
		return &csi.DeleteSnapshotResponse{}, nil // no such pool, or a share without one
	} else if err != nil {
		return nil, err
	}
	release, err := d.hold(sid.String(), holdDeleteSnapshot)
	if err != nil {
		return nil, err
	}
	defer release()
	if s, err := p.Snapshots().Load(sid); err == nil {
		group, err := liveGroupOf(p, s)
		if err != nil {
			return nil, fmt.Errorf("snapshot %s: its group snapshot: %w", sid, err)
		}
		if group != "" {
			return nil, csierr.Failf(csierr.ErrInvalid, "snapshot %s is a member of group snapshot %s; delete the group (DeleteVolumeGroupSnapshot), which deletes its members", sid, group)
		}
	}
	if err := p.Snapshots().Delete(ctx, sid); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Deleted snapshot", "snapshot", sid)
	return &csi.DeleteSnapshotResponse{}, nil
}

// loadSnapshot reads a ready snapshot, or NOT_FOUND; acc, where not nil,
// lets the call mount the snapshot's share (poolset.Ensure).
func (d *Driver) loadSnapshot(ctx context.Context, sid pool.SnapshotID, acc *poolset.Access) (*pool.Pool, *pool.Snapshot, error) {
	var p *pool.Pool
	var err error
	if acc != nil {
		p, err = d.pools.Ensure(ctx, poolset.SnapshotRef(sid), *acc)
	} else {
		p, err = d.pools.Lookup(poolset.SnapshotRef(sid))
	}
	if err != nil {
		return nil, nil, err
	}
	s, err := p.Snapshots().Load(sid)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return nil, nil, csierr.Failf(pool.ErrNotFound, "snapshot %s does not exist", sid)
	case err != nil:
		return nil, nil, fmt.Errorf("snapshot %s: %w", sid, err)
	case !s.ReadyToUse:
		return nil, nil, csierr.Failf(pool.ErrNotReady, "snapshot %s is still being cut", sid)
	}
	return p, s, nil
}

func (d *Driver) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (_ *csi.GetSnapshotResponse, err error) {
	defer csierr.ToStatus(&err)
	sid, known, err := parseSnapshotRef("snapshot_id", req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	if !known {
		return nil, csierr.Failf(pool.ErrNotFound, "snapshot %q does not exist (not a poolcsi snapshot ID)", req.GetSnapshotId())
	}
	p, s, err := d.loadSnapshot(ctx, sid, nil)
	if err != nil {
		return nil, err
	}
	return &csi.GetSnapshotResponse{Snapshot: d.csiSnapshot(p, s)}, nil
}

// ListSnapshots pages by snapshot ID, like ListVolumes: the token is the ID of the
// first snapshot of the next page.
func (d *Driver) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (_ *csi.ListSnapshotsResponse, err error) {
	defer csierr.ToStatus(&err)
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max_entries must not be negative")
	}
	var start pool.SnapshotID
	if token := req.GetStartingToken(); token != "" {
		id, err := pool.ParseSnapshotID(token)
		if err != nil {
			return nil, status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token)
		}
		start = id
	}
	if raw := req.GetSnapshotId(); raw != "" {
		sid, known, err := parseSnapshotRef("snapshot_id", raw)
		if err != nil || !known {
			return &csi.ListSnapshotsResponse{}, err
		}
		p, s, err := d.loadSnapshot(ctx, sid, nil)
		if err != nil || (req.GetSourceVolumeId() != "" && s.SourceVolumeID != volumeIdentity(req.GetSourceVolumeId())) {
			return &csi.ListSnapshotsResponse{}, nil
		}
		return &csi.ListSnapshotsResponse{Entries: []*csi.ListSnapshotsResponse_Entry{{Snapshot: d.csiSnapshot(p, s)}}}, nil
	}
	source := req.GetSourceVolumeId()
	if source != "" && pool.HostileID(source) {
		return nil, status.Errorf(codes.InvalidArgument, "source_volume_id %q is not a poolcsi volume ID", source)
	}
	source = volumeIdentity(source)
	// Paged like ListVolumes, reading only the page's snapshot.json files.
	all, next, err := walkPools(d, start.Pool, start.Key, int(req.GetMaxEntries()), func(p *pool.Pool, from string, limit int) ([]*pool.Snapshot, string, error) {
		page, next, err := p.Snapshots().ListPage(from, limit, func(e pool.SnapshotEntry) bool {
			if e.Err != nil {
				klog.FromContext(ctx).Error(e.Err, "Snapshot metadata unreadable", "snapshot", e.ID)
				return false
			}
			return e.Snapshot.ReadyToUse && (source == "" || e.Snapshot.SourceVolumeID == source)
		})
		out := make([]*pool.Snapshot, len(page))
		for i, e := range page {
			out[i] = e.Snapshot
		}
		if next != "" {
			next = p.Snapshots().IDOf(next).String()
		}
		return out, next, err
	}, func(s *pool.Snapshot) string { return s.ID })
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, s := range all {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: d.csiSnapshot(d.pools.Pool(s.Pool), s)})
	}
	return resp, nil
}

// clearFreeze removes this node's record of a freeze after its thaw. A
// record left behind is harmless (the next start finds the filesystem thawed)
// but is logged.
func (d *Driver) clearFreeze(ctx context.Context, vid pool.VolumeID) {
	if err := d.opts.State.Delete(freezeKind, vid.String()); err != nil {
		klog.FromContext(ctx).Error(err, "Removing a freeze record failed", "volume", vid)
	}
}

// thawAfterCrash thaws, in the background, filesystems a previous process
// froze for a snapshot and died before thawing: otherwise every write of the
// pods using them would hang until someone ran fsfreeze -u by hand. It
// returns at once: serving (Probe first) never waits for it, whatever a pool
// or a mount does. The freeze agent and local freezes start freezing only
// once it is done, so its thaws never end a new freeze.
func (d *Driver) thawAfterCrash(ctx context.Context) {
	if !d.opts.Mode.node() {
		return
	}
	done := make(chan struct{})
	d.freezer.mu.Lock()
	d.freezer.recovered = done
	d.freezer.mu.Unlock()
	timeout := freezeRecoveryTimeout
	go func() {
		defer close(done)
		d.recoverFreezes(context.WithoutCancel(ctx), timeout)
	}()
}

// recoverFreezes is thawAfterCrash's work, given up after timeout (what is
// still running then goes on, holding its volume's lock). First every shared
// pool's "frozen" answers of this node are rewritten "thawed" (before any
// thaw: the controller must not take a thaw it was not told of for a
// freeze); then what this node's own records say it froze is thawed, through
// the same checks as a freeze. A pool's records are never opened as paths:
// a "frozen" file an older version left in a volume's directory only selects
// which of this node's own mounts of that volume is thawed.
func (d *Driver) recoverFreezes(ctx context.Context, timeout time.Duration) {
	log := klog.FromContext(ctx)
	deadline := time.Now().Add(timeout)
	var pools []func()
	for _, pn := range d.pools.Names() {
		if p := d.pools.Pool(pn); p != nil {
			pools = append(pools, func() { d.abandonFreezeAnswers(ctx, p) })
		}
	}
	if !runUntil(deadline, pools) {
		log.Info("A pool did not answer while the thaws of a crashed freeze were written down; thawing all the same", "timeout", timeout)
	}
	var thaws []func()
	keys, err := d.opts.State.Keys(freezeKind)
	if err != nil {
		log.Error(err, "Cannot read this node's freeze records; nothing left frozen by a crash is thawed")
	}
	for _, key := range keys {
		var rec freezeRecord
		ok, err := d.opts.State.Get(freezeKind, key, &rec)
		if err != nil || !ok {
			log.Error(err, "Unreadable freeze record", "record", key)
			continue
		}
		thaws = append(thaws, d.recoveryThaw(ctx, key, func() (string, error) {
			return rec.Path, d.FS.ThawMount(d.opts.PathPrefix, rec.Path, rec.Device)
		}))
	}
	// Older versions recorded freezes in the pool: only which volume is
	// taken from those, never a path.
	for _, pn := range d.pools.Names() {
		p := d.pools.Pool(pn)
		if p == nil {
			continue
		}
		thaws = append(thaws, func() {
			freezes, err := p.Freezes().Records()
			if err != nil {
				log.V(2).Info("Cannot look for freezes an older version recorded in the pool", "pool", pn, "err", err)
				return
			}
			for _, f := range freezes {
				if f.Node != d.opts.NodeID {
					continue // another node's freeze, on a shared pool
				}
				d.recoveryThaw(ctx, f.Volume.String(), func() (string, error) { return d.thawVolumeHere(p, f.Volume) })()
				if err := p.Freezes().ClearRecord(f.Volume); err != nil {
					log.Error(err, "Removing an older version's freeze record failed", "volume", f.Volume)
				}
			}
		})
	}
	if !runUntil(deadline, thaws) {
		log.Info("Thawing what a crash left frozen has not finished; the freeze agent starts all the same (a volume still being thawed stays locked)", "timeout", timeout)
	}
}

// recoveryLockPoll is how often a recovery thaw tries a busy volume's lock.
const recoveryLockPoll = 20 * time.Millisecond

// recoveryThaw is one thaw of recoverFreezes, under the volume's lock.
func (d *Driver) recoveryThaw(ctx context.Context, volume string, thaw func() (path string, err error)) func() {
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
			r, err := d.hold(volume, holdThaw)
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
			d.clearFreeze(ctx, id)
		} else if err := d.opts.State.Delete(freezeKind, volume); err != nil {
			log.Error(err, "Removing a freeze record failed")
		}
	}
}

// thawVolumeHere thaws this node's own mount of volume id of p, found as
// freezeVolumeHere finds it (ownDevice); "" when the volume has none here.
func (d *Driver) thawVolumeHere(p *pool.Pool, id pool.VolumeID) (string, error) {
	dev, _, err := d.ownDevice(p, id)
	if err != nil || dev == "" {
		return "", err
	}
	points, err := d.Mounts.MountPoints(dev)
	if err != nil {
		return "", fmt.Errorf("read the mount table: %w", err)
	}
	for _, path := range points {
		if err := d.FS.ThawMount(d.opts.PathPrefix, path, dev); !errors.Is(err, mount.ErrNotTheMount) {
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
