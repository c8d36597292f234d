package poolset

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// Ref is the pool an ID names: a configured pool, or the pool on a share.
type Ref struct {
	what  string // the ID, as messages name it
	pool  string
	share pool.ShareRef
	// isShare: the ID names a share; tag is the ID's share tag, if any.
	isShare bool
	tag     string
}

// VolumeRef is the pool a volume ID names.
func VolumeRef(vid pool.VolumeID) Ref {
	r, isShare := vid.ShareRef()
	return Ref{what: "volume " + vid.String(), pool: vid.Pool, share: r, isShare: isShare, tag: vid.Tag}
}

// SnapshotRef is the pool a snapshot ID names.
func SnapshotRef(sid pool.SnapshotID) Ref {
	r, isShare := sid.ShareRef()
	return Ref{what: "snapshot " + sid.String(), pool: sid.Pool, share: r, isShare: isShare, tag: sid.Tag}
}

// ShareRef is the pool on share r, as a StorageClass names it (no ID, no tag).
func ShareRef(r pool.ShareRef) Ref { return Ref{share: r, isShare: true} }

// Lookup returns the pool ref names among those served here; it never
// mounts anything. A share not served is UNAVAILABLE: the next call that may
// mount it does. A pool held for its start-up passes is waited for as ready
// says, at most until ctx ends.
func (s *Set) Lookup(ctx context.Context, ref Ref) (*pool.Pool, error) {
	return s.get(ctx, ref, Access{}, false)
}

// LookupHeld is Lookup for a call that needs none of a pool's start-up
// passes (kubelet's teardown on this node, which works from the node's own
// records and mounts): a pool held for them (Hold) is returned at once,
// never waited for, as it may never answer again (a CephFS client the MDS
// evicted while the node plugin restarted).
func (s *Set) LookupHeld(ctx context.Context, ref Ref) (*pool.Pool, error) {
	return s.get(ctx, ref, Access{evenHeld: true}, false)
}

// Ensure returns the pool ref names, mounting its share on this node when
// it is not mounted and mayMount allows it, with what the call brings (acc),
// and laying out a new pool when a StorageClass names the share. A share
// mounted for an ID must already hold the share's pool (its pool.json,
// written at the first CreateVolume); otherwise it is unmounted again,
// nothing of it stays, and the answer is NOT_FOUND.
func (s *Set) Ensure(ctx context.Context, ref Ref, acc Access) (*pool.Pool, error) {
	return s.get(ctx, ref, acc, true)
}

func (s *Set) get(ctx context.Context, ref Ref, acc Access, mount bool) (*pool.Pool, error) {
	if !ref.isShare {
		p := s.Pool(ref.pool)
		if p == nil {
			return nil, csierr.Failf(csierr.ErrNoPool, "%s: pool %q is not configured on this driver (pools: %s)", ref.what, ref.pool, JoinNames(s.configured))
		}
		return s.readyFor(ctx, p, acc)
	}
	r := ref.share
	name := r.PoolName()
	// What the call brings is checked whether or not it is needed: a bad
	// option is refused the same way every time.
	options, sensitive := acc.options()
	if err := params.CheckShareOptions(r.Type, options, sensitive); err != nil {
		return nil, err
	}
	// A served pool passed allowed when it joined, and the allow-list does
	// not change while the driver runs.
	if p := s.Pool(name); p != nil && s.Held(name) {
		return s.readyFor(ctx, p, acc)
	} else if p != nil && (!mount || p.MountReady() == nil && (!acc.fromStorageClass || p.LaidOut())) {
		return p, nil
	}
	if s.shares.m == nil {
		return nil, csierr.Failf(csierr.ErrNoPool, "share %s: this driver mounts no shares (serve --share-dir is empty)", r)
	}
	if err := s.shares.allowed(r); err != nil {
		return nil, err
	}
	if err := s.mayMount(r, ref.tag, acc, mount); err != nil {
		return nil, err
	}
	return s.mountShare(ctx, poolmount.Share{Ref: r, Options: options, Sensitive: sensitive, FromStorageClass: acc.fromStorageClass})
}

// mayMount tells whether a call may mount share r on this node: a call that
// needs the data (mount), and a share that a StorageClass names in this very
// call, or that this node mounted before (its record), or whose ID carries a
// tag that one of the cluster's keys verifies. An ID alone, forged or from
// before the key, never starts a mount.
func (s *Set) mayMount(r pool.ShareRef, tag string, acc Access, mount bool) error {
	switch {
	case !mount:
		return csierr.Failf(pool.ErrUnavailable, "share %s is not mounted on node %s, and this call does not mount shares: the next create, publish, stage or delete of one of its volumes does", r, s.deps.NodeID)
	case acc.fromStorageClass, s.shares.m.Recorded(r), s.shares.verified(r, tag):
		return nil
	case tag != "":
		return status.Errorf(codes.InvalidArgument, "the tag of the ID naming share %s does not verify under this driver's share keys (serve --share-key-file): the ID was not made by this cluster's poolcsi; nothing is mounted", r)
	}
	return csierr.Failf(csierr.ErrShareUnknown, "share %s is not known on node %s (never mounted here) and the volume ID carries no share tag to prove a StorageClass named it: nothing is mounted. IDs made before the share key was set are served where their share is mounted", r, s.deps.NodeID)
}

// mountShare mounts share r (one call at a time per share), opens its pool,
// lays it out if a StorageClass names it, and serves it.
func (s *Set) mountShare(ctx context.Context, sh poolmount.Share) (*pool.Pool, error) {
	r := sh.Ref
	name := r.PoolName()
	unlock, err := s.shares.lock(ctx, name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	path, mountedNow, err := s.shares.m.Ensure(ctx, sh)
	if err != nil {
		return nil, csierr.Failf(pool.ErrUnavailable, "share %s cannot be mounted on node %s: %w", r, s.deps.NodeID, err)
	}
	p := s.Pool(name)
	if p == nil {
		if p, err = s.openSharePool(r, path); err != nil {
			return nil, err
		}
	}
	if !p.LaidOut() {
		if !sh.FromStorageClass {
			if mountedNow && s.Pool(name) == nil {
				if err := s.shares.m.Release(ctx, r); err != nil {
					klog.FromContext(ctx).Error(err, "Unmounting a share that holds no pool", "share", r.String())
				}
			}
			return nil, csierr.Failf(csierr.ErrNoPool, "share %s holds no poolcsi pool (%s): no volume was ever created on it", r, name)
		}
		if err := p.LayOut(); err != nil {
			return nil, err
		}
		klog.FromContext(ctx).Info("Laid out a pool on a share", "pool", name, "share", r.String(), "path", path)
	}
	if s.Pool(name) == nil {
		p = s.Add(p)
		klog.FromContext(ctx).Info("Serving the pool on a share", "pool", name, "share", r.String(), "path", path)
		if s.deps.Joined != nil {
			s.deps.Joined(ctx)
		}
	}
	return p, nil
}
