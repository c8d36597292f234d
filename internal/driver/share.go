package driver

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// Shares a StorageClass names (docs/pools.md, "Shares named by a
// StorageClass"): the driver mounts the share itself, on the controller and on
// each node that stages a volume of it, and keeps a pool on it like any shared
// pool. The pool's name and the volume IDs are derived from the share's type
// and source (internal/pool/share.go), so calls that bring only an ID find the
// share after a restart anywhere; options and secrets come with the requests.

// StorageClass parameters naming a share.
// They are parsed in internal/params.
const (
	ParamShareType     = params.ParamShareType
	ParamShareSource   = params.ParamShareSource
	ParamShareOptions  = params.ParamShareOptions
	ParamServer        = params.ParamServer
	ParamShare         = params.ParamShare
	SecretMountOptions = params.SecretMountOptions
)

// DefaultShareTypes are the share types allowed when --share-types is not
// given: kernel network filesystems whose source names a server. A bind mount
// of a node directory would let a StorageClass reach into the node; fuse.ceph
// runs ceph-fuse, a root daemon whose every configuration option is a flag (a
// log file, an admin socket, a keyring path, each a path it writes or
// unlinks): the driver builds its argv from a checked source and a short
// allow-list, but an operator who does not use it should not carry it. Both
// are allowed by name (--share-types).
var DefaultShareTypes = []string{"nfs", "nfs4", "ceph"}

// ShareMounter mounts shares; internal/poolmount.Shares is the real one.
type ShareMounter interface {
	Ensure(ctx context.Context, sh poolmount.Share) (path string, mountedNow bool, err error)
	Release(ctx context.Context, r pool.ShareRef) error
	Known() (map[pool.ShareRef]string, error)
	// Recorded tells whether this node has mounted the share before (its
	// record, kept on the node's own disk, says so).
	Recorded(r pool.ShareRef) bool
	RequireMount() bool
}

// shareState is the driver's share machinery.
type shareState struct {
	m     ShareMounter
	types map[string]bool
	// keys are the cluster's share keys: the first tags the IDs this driver
	// makes, any of them verifies a tag (so a key can be rotated).
	keys  [][]byte
	locks sync.Map // pool name → chan struct{}: one mount of a share at a time
}

// MinShareKeyLength is the least a share key may hold.
const MinShareKeyLength = 32

func (s *shareState) init(opts Options) error {
	s.m = opts.Shares
	s.types = map[string]bool{}
	types := opts.ShareTypes
	if types == nil {
		types = DefaultShareTypes
	}
	known := poolmount.ShareTypes()
	for _, t := range types {
		if err := pool.ValidateShareType(t); err != nil {
			return fmt.Errorf("%w (a mount type such as nfs, ceph, fuse.ceph or bind)", err)
		}
		if !slices.Contains(known, t) {
			return fmt.Errorf("share type %q: the driver has no grammar for it, so it never passes anything to its mount helper (known: %s)", t, strings.Join(known, ", "))
		}
		s.types[t] = true
	}
	for i, k := range opts.ShareKeys {
		if len(k) < MinShareKeyLength {
			return fmt.Errorf("share key %d is %d bytes, want at least %d", i+1, len(k), MinShareKeyLength)
		}
	}
	s.keys = opts.ShareKeys
	return nil
}

func (s *shareState) typeList() []string {
	if s.m == nil {
		return nil
	}
	out := make([]string, 0, len(s.types))
	for t := range s.types {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

// tag is the tag of share r under key: 8 bytes of HMAC-SHA256 over the share.
func shareTag(key []byte, r pool.ShareRef) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte("poolcsi share tag v1\x00" + r.Type + "\x00" + r.Source))
	return base64.RawURLEncoding.EncodeToString(mac.Sum(nil)[:8])
}

// tag is the tag this driver puts on the IDs of share r's volumes.
func (s *shareState) tag(r pool.ShareRef) string {
	if len(s.keys) == 0 {
		return ""
	}
	return shareTag(s.keys[0], r)
}

// verified tells whether tag proves that a driver holding one of the
// cluster's keys made an ID on share r (from a StorageClass that named it).
func (s *shareState) verified(r pool.ShareRef, tag string) bool {
	if tag == "" {
		return false
	}
	for _, k := range s.keys {
		if hmac.Equal([]byte(shareTag(k, r)), []byte(tag)) {
			return true
		}
	}
	return false
}

// config is what the request parsers know of the share machinery.
func (s *shareState) config() params.Shares {
	return params.Shares{Enabled: s.m != nil, Types: s.typeList(), Keyed: len(s.keys) > 0}
}

// allowed checks a share against the allow-list and its type's grammar
// (params.Shares.Allowed).
func (s *shareState) allowed(r pool.ShareRef) error { return s.config().Allowed(r) }

// lock takes the driver's lock on one share until ctx ends.
func (s *shareState) lock(ctx context.Context, name string) (func(), error) {
	v, _ := s.locks.LoadOrStore(name, make(chan struct{}, 1))
	ch := v.(chan struct{})
	select {
	case ch <- struct{}{}:
		return func() { <-ch }, nil
	case <-ctx.Done():
		return nil, csierr.Failf(pool.ErrBusy, "share pool %s: another call is mounting the share: %w", name, ctx.Err())
	}
}

// shareAccess is what a call may do about a share that this driver does not
// serve yet, and what it brings to mount it with. The zero value mounts
// nothing: a call that only reads or tears down (ControllerGetVolume, the
// health and stats calls, NodeUnpublish, NodeUnstage, NodeExpand, and the
// snapshot reads) is answered from the pools this driver serves, whatever
// its volume ID says.
type shareAccess struct {
	// mount: the call needs the volume's data on this node (create, delete,
	// publish, unpublish, stage, expand, snapshot, clone) and may mount its
	// share, if mayMount allows: a StorageClass named it, this node mounted
	// it before, or the ID carries a verified tag.
	mount bool
	// fromStorageClass: a StorageClass's parameters named the share (a
	// CreateVolume or GetCapacity): lay out its pool if new, and record its
	// options.
	fromStorageClass bool
	options          []string // from the StorageClass: parameters, mount flags, volume context
	sensitive        []string // from the request's secrets
}

// dataAccess is the access of a call that needs the volume's data and brings
// only secrets (DeleteVolume, ControllerUnpublishVolume, the snapshot and
// expansion calls).
func dataAccess(secrets map[string]string) shareAccess {
	return shareAccess{mount: true, sensitive: splitList(secrets[SecretMountOptions])}
}

// splitList splits a comma-separated option list (a secret's, a volume
// context's), unchecked: the share type's allow-list checks each option when
// the share is mounted (never showing a secret one).
func splitList(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

// mayMount tells whether a call may mount share r on this node: a call that
// needs the data (acc.mount), and a share that a StorageClass names in this
// very call, or that this node mounted before (its record), or whose ID
// carries a tag that one of the cluster's keys verifies. An ID alone, forged
// or from before the key, never starts a mount.
func (d *Driver) mayMount(r pool.ShareRef, tag string, acc shareAccess) error {
	switch {
	case !acc.mount:
		return csierr.Failf(pool.ErrUnavailable, "share %s is not mounted on node %s, and this call does not mount shares: the next create, publish, stage or delete of one of its volumes does", r, d.opts.NodeID)
	case acc.fromStorageClass, d.shares.m.Recorded(r), d.shares.verified(r, tag):
		return nil
	case tag != "":
		return status.Errorf(codes.InvalidArgument, "the tag of the ID naming share %s does not verify under this driver's share keys (serve --share-key-file): the ID was not made by this cluster's poolcsi; nothing is mounted", r)
	}
	return csierr.Failf(csierr.ErrShareUnknown, "share %s is not known on node %s (never mounted here) and the volume ID carries no share tag to prove a StorageClass named it: nothing is mounted. IDs made before the share key was set are served where their share is mounted", r, d.opts.NodeID)
}

// sharePool returns the pool on share r, mounting the share on this node when
// acc allows it and it is not mounted, and laying out a new pool when a
// StorageClass names the share. A share mounted for an ID must already hold
// the share's pool (its pool.json, written at the first CreateVolume);
// otherwise it is unmounted again, nothing of it stays, and the answer is
// NOT_FOUND.
func (d *Driver) sharePool(ctx context.Context, r pool.ShareRef, tag string, acc shareAccess) (*pool.Pool, error) {
	name := r.PoolName()
	// What the call brings is checked whether or not it is needed: a bad
	// option is refused the same way every time.
	if err := params.CheckShareOptions(r.Type, acc.options, acc.sensitive); err != nil {
		return nil, err
	}
	// A served pool passed allowed when it joined, and the allow-list does
	// not change while the driver runs.
	if p := d.pool(name); p != nil && (!acc.mount || p.MountReady() == nil && (!acc.fromStorageClass || p.LaidOut())) {
		return p, nil
	}
	if d.shares.m == nil {
		return nil, csierr.Failf(csierr.ErrNoPool, "share %s: this driver mounts no shares (serve --share-dir is empty)", r)
	}
	if err := d.shares.allowed(r); err != nil {
		return nil, err
	}
	if err := d.mayMount(r, tag, acc); err != nil {
		return nil, err
	}
	unlock, err := d.shares.lock(ctx, name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	path, mountedNow, err := d.shares.m.Ensure(ctx, poolmount.Share{Ref: r, Options: acc.options, Sensitive: acc.sensitive, FromStorageClass: acc.fromStorageClass})
	if err != nil {
		return nil, csierr.Failf(pool.ErrUnavailable, "share %s cannot be mounted on node %s: %w", r, d.opts.NodeID, err)
	}
	p := d.pool(name)
	if p == nil {
		if p, err = d.openSharePool(r, path); err != nil {
			return nil, err
		}
	}
	if !p.LaidOut() {
		if !acc.fromStorageClass {
			if mountedNow && d.pool(name) == nil {
				if err := d.shares.m.Release(ctx, r); err != nil {
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
	if d.pool(name) == nil {
		p = d.addPool(p)
		klog.FromContext(ctx).Info("Serving the pool on a share", "pool", name, "share", r.String(), "path", path)
		d.registerNode(ctx)
	}
	return p, nil
}

// openSharePool opens the pool on share r, mounted at path. Only LayOut lays
// it out: a share is a pool once its pool.json says so.
func (d *Driver) openSharePool(r pool.ShareRef, path string) (*pool.Pool, error) {
	return pool.Open(pool.Config{Name: r.PoolName(), Path: path, Shared: true, RequireMount: d.shares.m.RequireMount(), Share: &r, NoLayout: true}, pool.WithNode(d.opts.NodeID))
}

// poolOf returns the pool of a volume ID: a configured pool, or a share's
// (mounted if acc allows and it must be).
func (d *Driver) poolOf(ctx context.Context, vid pool.VolumeID, acc shareAccess) (*pool.Pool, error) {
	r, isShare := vid.ShareRef()
	return d.idPool(ctx, "volume "+vid.String(), vid.Pool, r, vid.Tag, isShare, acc)
}

// snapshotPool is poolOf for a snapshot ID.
func (d *Driver) snapshotPool(ctx context.Context, sid pool.SnapshotID, acc shareAccess) (*pool.Pool, error) {
	r, isShare := sid.ShareRef()
	return d.idPool(ctx, "snapshot "+sid.String(), sid.Pool, r, sid.Tag, isShare, acc)
}

// idPool is the pool named in an ID (what names the ID in messages).
func (d *Driver) idPool(ctx context.Context, what, poolName string, r pool.ShareRef, tag string, isShare bool, acc shareAccess) (*pool.Pool, error) {
	if isShare {
		return d.sharePool(ctx, r, tag, acc)
	}
	p := d.pool(poolName)
	if p == nil {
		return nil, csierr.Failf(csierr.ErrNoPool, "%s: pool %q is not configured on this driver (pools: %s)", what, poolName, joinNames(d.configured))
	}
	return p, nil
}

// contextAccess is the share access of a call that brings a volume context
// and a capability and needs the data (ControllerPublishVolume,
// NodeStageVolume): the StorageClass's shareOptions, kept in the volume
// context, and for a dir volume the capability's non-generic mount flags.
// They are used only where the share has no record on this node yet; a
// recorded share is mounted again with its recorded options.
func contextAccess(volumeContext, secrets map[string]string, flags []string) shareAccess {
	acc := dataAccess(secrets)
	acc.options = splitList(volumeContext[ParamShareOptions])
	if l := volumeContext[ParamLayout]; l == "" || l == string(pool.LayoutDir) {
		acc.options = append(acc.options, params.ShareFlags(flags)...)
	}
	return acc
}

// wireVolumeID is the ID of a volume as the CO gets it: on a share, tagged
// (when the driver has a share key).
func (d *Driver) wireVolumeID(p *pool.Pool, id string) string {
	if p == nil || p.Config().Share == nil {
		return id
	}
	if tag := d.shares.tag(*p.Config().Share); tag != "" {
		return id + "." + tag
	}
	return id
}

// volumeIdentity is a volume ID from the wire without its tag: what
// volume.json and snapshot.json record. An ID that does not parse is
// returned as it is (it matches nothing).
func volumeIdentity(wire string) string {
	if vid, err := pool.ParseVolumeID(wire); err == nil {
		return vid.String()
	}
	return wire
}

// wireSnapshotID is wireVolumeID for a snapshot.
func (d *Driver) wireSnapshotID(p *pool.Pool, id string) string { return d.wireVolumeID(p, id) }

// recoverShares serves, after a restart, the pools on the shares this node
// has mounted (found through the records next to their mount points), so
// ListVolumes and the health calls see them before any call names them.
func (d *Driver) recoverShares(ctx context.Context) {
	if d.shares.m == nil {
		return
	}
	log := klog.FromContext(ctx)
	known, err := d.shares.m.Known()
	if err != nil {
		log.Error(err, "Looking for shares mounted before a restart")
		return
	}
	for r, path := range known {
		if d.shares.allowed(r) != nil {
			log.Info("A share mounted before is not of an allowed type now; not served", "share", r.String())
			continue
		}
		p, err := d.openSharePool(r, path)
		if err != nil || !p.LaidOut() {
			continue
		}
		d.addPool(p)
		log.Info("Serving the pool on a share mounted before", "pool", p.Name(), "share", r.String(), "path", path)
	}
}

// volumeFlags are the mount flags of a capability that concern the volume's
// own mount: all of them, except on a dir volume of a share, whose
// non-generic flags are the share's (shareFlags).
func volumeFlags(p *pool.Pool, v *pool.Volume, vc *csi.VolumeCapability) []string {
	flags := vc.GetMount().GetMountFlags()
	if p.Config().Share != nil && v.Layout == pool.LayoutDir {
		return mount.BindOptions(flags)
	}
	return flags
}
