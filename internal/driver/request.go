package driver

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/ephemeral"
	"github.com/poolcsi/poolcsi/internal/freeze"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// The front hall: every call that names a volume by its ID passes here once,
// in resolve, which parses the ID (once; the ID keeps the share it names),
// runs the call's own argument checks, takes the volume's in-process lock,
// finds the pool (mounting its share only where the table below allows it)
// and reads the volume's record. What each call takes, and in which order,
// is the table below, not the handlers' choice.

// holder names who holds a volume's in-process lock: what a call that finds
// the volume busy is told (ABORTED, "busy with <holder>").
type holder string

// The RPCs that resolve a volume ID; each holds the lock under its own name.
const (
	rpcDeleteVolume               holder = "DeleteVolume"
	rpcValidateVolumeCapabilities holder = "ValidateVolumeCapabilities"
	rpcControllerGetVolume        holder = "ControllerGetVolume"
	rpcControllerGetVolumeHealth  holder = "ControllerGetVolumeHealth"
	rpcControllerPublishVolume    holder = "ControllerPublishVolume"
	rpcControllerUnpublishVolume  holder = "ControllerUnpublishVolume"
	rpcControllerExpandVolume     holder = "ControllerExpandVolume"
	rpcControllerModifyVolume     holder = "ControllerModifyVolume"
	rpcCreateSnapshotSource       holder = "CreateSnapshot (source)"
	rpcCloneSource                holder = "CreateVolume (source)"
	rpcNodeStageVolume            holder = "NodeStageVolume"
	rpcNodeUnstageVolume          holder = "NodeUnstageVolume"
	rpcNodePublishVolume          holder = "NodePublishVolume"
	rpcNodeUnpublishVolume        holder = "NodeUnpublishVolume"
	rpcNodeExpandVolume           holder = "NodeExpandVolume"
	rpcNodeGetVolumeStats         holder = "NodeGetVolumeStats"
	rpcNodeGetVolumeHealth        holder = "NodeGetVolumeHealth"
)

// The other holders: calls that lock an ID they made or already parsed
// (a new volume, a snapshot, a group, a clone's or a snapshot's source), and
// the driver's own passes. They lock through hold and holdVolume.
const (
	holdCreateVolume       holder = "CreateVolume"
	holdCloneSource        holder = "CreateVolume (clone source)"
	holdCreateSnapshot     holder = "CreateSnapshot"
	holdDeleteSnapshot     holder = "DeleteSnapshot"
	holdCreateGroup        holder = "CreateVolumeGroupSnapshot"
	holdDeleteGroup        holder = "DeleteVolumeGroupSnapshot"
	holdEphemeralPublish   holder = ephemeral.HolderPublish
	holdEphemeralUnpublish holder = ephemeral.HolderUnpublish
	holdSweep              holder = ephemeral.HolderSweep
	holdDropStaleRecords   holder = "dropStaleRecords"
	holdAdoptDevices       holder = "adoptDevices"
	holdFreeze             holder = freeze.HolderFreeze
	holdThaw               holder = freeze.HolderThaw
)

// poolNeed is what a call does when the ID's pool is not served here; the
// zero value is needPool.
type poolNeed int

const (
	// needPool (the zero value): the call fails (NOT_FOUND for a pool not configured or a
	// share without a pool, UNAVAILABLE for a share that cannot be mounted).
	needPool poolNeed = iota
	// noPoolIsGone: a pool not here holds no volume, so the call has
	// nothing to do (a delete or unpublish succeeds); other failures stand.
	noPoolIsGone
	// poolIfServed: the pool if served here, nil otherwise, never an error.
	poolIfServed
)

// route is one row of the lock table: what resolve does for a call.
type route struct {
	// lock: the call holds the volume's in-process lock (under its name)
	// until it returns. Lock before pool: a share is mounted under it.
	lock bool
	// mount: the call needs the data on this node and may mount the share
	// its ID names (with what it brings, if mayMount allows); otherwise the
	// pool is looked up among those served, and nothing is mounted.
	mount bool
	pool  poolNeed
	// load: the call reads the volume's record (a ready volume, or NOT_FOUND).
	load bool
	// foreignIsNotFound: an ID of another format names no volume of this
	// driver, NOT_FOUND; a hostile one is still INVALID_ARGUMENT.
	foreignIsNotFound bool
	// whileHeld: the call goes through at once on a pool held for its
	// start-up passes (start.go), which it does not need: kubelet's
	// teardown of a pod's volume on this node, which must not wait for a
	// pool that may never answer again (a CephFS client the MDS evicted
	// while the node plugin restarted) and works from this node's own
	// records and mounts, as it does on any pool that does not answer.
	whileHeld bool
}

// routes is the lock table, in one place.
var routes = map[holder]route{
	rpcDeleteVolume:               {lock: true, mount: true, pool: noPoolIsGone},
	rpcValidateVolumeCapabilities: {load: true},
	rpcControllerGetVolume:        {load: true, pool: needPool},
	rpcControllerGetVolumeHealth:  {},
	rpcControllerPublishVolume:    {lock: true, mount: true},
	rpcControllerUnpublishVolume:  {lock: true, mount: true, pool: noPoolIsGone},
	rpcControllerExpandVolume:     {lock: true, mount: true, load: true},
	rpcControllerModifyVolume:     {lock: true, mount: true, load: true, foreignIsNotFound: true},
	rpcCreateSnapshotSource:       {mount: true},
	rpcCloneSource:                {mount: true, load: true},
	rpcNodeStageVolume:            {lock: true, mount: true, load: true},
	// The stage mounted the share; publish, unstage, expand and the reads
	// are answered from the pools served here.
	rpcNodeUnstageVolume:   {lock: true, whileHeld: true},
	rpcNodePublishVolume:   {lock: true, load: true},
	rpcNodeUnpublishVolume: {lock: true, pool: poolIfServed, whileHeld: true},
	rpcNodeExpandVolume:    {lock: true, load: true},
	rpcNodeGetVolumeStats:  {},
	rpcNodeGetVolumeHealth: {},
}

// volumeRequest is a resolved volume: its parsed ID (with its share), its
// pool, and its record where the route loads it. The caller defers release.
type volumeRequest struct {
	id      pool.VolumeID
	pool    *pool.Pool   // nil only where the route lets a missing pool pass
	vol     *pool.Volume // where the route loads it
	release func()       // never nil
}

func noRelease() {}

// resolve turns the volume ID of call into a volumeRequest, in the table's
// order: parse, the call's own checks (check, nil for none: run after the ID
// parses, before anything is locked or mounted), lock, pool, record. acc is
// what the call brings to mount a share; it is used only on a mount route.
func (d *core) resolve(ctx context.Context, call holder, rawID string, acc poolset.Access, check func() error) (volumeRequest, error) {
	r, ok := routes[call]
	if !ok {
		return volumeRequest{}, status.Errorf(codes.Internal, "%s has no row in the lock table", call)
	}
	rq := volumeRequest{release: noRelease}
	var err error
	if rawID == "" {
		return rq, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if rq.id, err = pool.ParseVolumeID(rawID); err != nil {
		switch {
		case !r.foreignIsNotFound:
			return rq, status.Error(codes.InvalidArgument, err.Error())
		case pool.HostileID(rawID):
			return rq, status.Errorf(codes.InvalidArgument, "volume_id: %v", err)
		}
		return rq, status.Errorf(codes.NotFound, "volume %q does not exist (not a poolcsi volume ID)", rawID)
	}
	if check != nil {
		if err := check(); err != nil {
			return rq, err
		}
	}
	if r.lock {
		if rq.release, err = d.locks.acquire(rq.id.String(), call); err != nil {
			rq.release = noRelease
			return rq, err
		}
	}
	fail := func(err error) (volumeRequest, error) {
		rq.release()
		return volumeRequest{release: noRelease}, err
	}
	switch {
	case r.whileHeld:
		rq.pool, err = d.pools.LookupHeld(ctx, poolset.VolumeRef(rq.id))
	case r.mount:
		rq.pool, err = d.pools.Ensure(ctx, poolset.VolumeRef(rq.id), acc)
	default:
		rq.pool, err = d.pools.Lookup(ctx, poolset.VolumeRef(rq.id))
	}
	switch {
	case err == nil:
	case errors.Is(err, poolset.ErrStarting):
		// Served here, its start-up passes not run yet: every other call
		// waited for them at most poolset's HeldWait (UNAVAILABLE).
		return fail(err)
	case r.pool == poolIfServed, r.pool == noPoolIsGone && errors.Is(err, csierr.ErrNoPool):
		rq.pool = nil
		return rq, nil
	default:
		return fail(err)
	}
	if r.load {
		if rq.vol, err = loadVolume(rq.pool, rq.id); err != nil {
			return fail(err)
		}
	}
	return rq, nil
}

// hold takes the in-process lock of an ID a call made or parsed itself (a new
// volume, a snapshot, a group); the caller defers release.
func (d *core) hold(id string, h holder) (func(), error) {
	return d.locks.acquire(id, h)
}

// holdVolume takes a volume's in-process lock for h, then its cross-process
// lock, and loads it (NOT_FOUND when it does not exist): what a call that
// reads a volume's data (a clone's or a snapshot's source) holds while it
// reads. The caller defers release.
func (d *core) holdVolume(ctx context.Context, h holder, p *pool.Pool, vid pool.VolumeID) (*pool.Volume, func(), error) {
	release, err := d.locks.acquire(vid.String(), h)
	if err != nil {
		return nil, nil, err
	}
	unlock, err := p.LockVolume(ctx, vid)
	if errors.Is(err, pool.ErrNotFound) {
		release()
		return nil, nil, csierr.Failf(pool.ErrNotFound, "volume %s does not exist", vid)
	} else if err != nil {
		release()
		return nil, nil, err
	}
	v, err := loadVolume(p, vid)
	if err != nil {
		unlock()
		release()
		return nil, nil, err
	}
	return v, func() { unlock(); release() }, nil
}

// loadVolume reads a ready volume's volume.json; a volume still being created
// is NOT_FOUND, like one that does not exist.
func loadVolume(p *pool.Pool, vid pool.VolumeID) (*pool.Volume, error) {
	v, err := p.Load(vid)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return nil, csierr.Failf(pool.ErrNotFound, "volume %s does not exist in pool %s", vid, p.Name())
	case err != nil:
		return nil, err
	case v.State != pool.StateReady:
		return nil, csierr.Failf(pool.ErrNotReady, "volume %s is still being created", vid)
	}
	return v, nil
}
