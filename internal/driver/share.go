package driver

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/mount"
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
const (
	ParamShareType    = "shareType"
	ParamShareSource  = "shareSource"
	ParamShareOptions = "shareOptions"
	ParamServer       = "server" // NFS: server and share, as csi-driver-nfs has them
	ParamShare        = "share"
	// SecretMountOptions is the secret key whose comma-separated options are
	// added to a share's mount as sensitive options.
	SecretMountOptions = "mountOptions"
)

// DefaultShareTypes are the share types allowed when --share-types is not
// given: network filesystems whose source names a server. A bind mount of a
// node directory, or a filesystem type that mounts a device or file, would let
// a StorageClass (or a forged volume ID) reach into the node: an operator
// allows them by name.
var DefaultShareTypes = []string{"nfs", "nfs4", "ceph", "fuse.ceph"}

// ShareMounter mounts shares; internal/poolmount.Shares is the real one.
type ShareMounter interface {
	Ensure(ctx context.Context, sh poolmount.Share) (path string, mountedNow bool, err error)
	Release(ctx context.Context, r pool.ShareRef) error
	Known() (map[pool.ShareRef]string, error)
	RequireMount() bool
}

// shareState is the driver's share machinery.
type shareState struct {
	m     ShareMounter
	types map[string]bool
	locks sync.Map // pool name → chan struct{}: one mount of a share at a time
}

func (s *shareState) init(opts Options) error {
	s.m = opts.Shares
	s.types = map[string]bool{}
	types := opts.ShareTypes
	if types == nil {
		types = DefaultShareTypes
	}
	for _, t := range types {
		if err := pool.ValidateShareType(t); err != nil {
			return fmt.Errorf("%w (a mount type such as nfs, ceph, fuse.ceph or bind)", err)
		}
		s.types[t] = true
	}
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

// allowed checks a share against the allow-list and its type's own rules,
// before anything is mounted: a volume ID is request input and can name any
// share.
func (s *shareState) allowed(r pool.ShareRef) error {
	if s.m == nil {
		return status.Errorf(codes.InvalidArgument, "share %s: this driver mounts no shares (serve --share-dir is empty)", r)
	}
	if err := r.Validate(); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if !s.types[r.Type] {
		return status.Errorf(codes.InvalidArgument, "share type %q is not allowed on this driver (serve --share-types: %s)", r.Type, strings.Join(s.typeList(), ","))
	}
	if r.Type == poolmount.BindType && (!filepath.IsAbs(r.Source) || filepath.Clean(r.Source) != r.Source || r.Source == "/") {
		return status.Errorf(codes.InvalidArgument, "share %s: a bind share's source must be a clean absolute path other than /", r)
	}
	return nil
}

// lock takes the driver's lock on one share until ctx ends.
func (s *shareState) lock(ctx context.Context, name string) (func(), error) {
	v, _ := s.locks.LoadOrStore(name, make(chan struct{}, 1))
	ch := v.(chan struct{})
	select {
	case ch <- struct{}{}:
		return func() { <-ch }, nil
	case <-ctx.Done():
		return nil, status.Errorf(codes.Aborted, "share pool %s: another call is mounting the share: %v", name, ctx.Err())
	}
}

// shareAccess is what a request brings to mount a share with.
type shareAccess struct {
	options   []string // from the StorageClass: parameters, mount flags, volume context
	sensitive []string // from the request's secrets
	layOut    bool     // a StorageClass's parameters named the share: lay out its pool if new
	// noMount: only a pool this driver serves already will do. The calls
	// kubelet repeats on staged volumes (stats, health) bring no options
	// and must not start a mount; a staged volume's share was mounted by
	// its stage, or found again at start (recoverShares).
	noMount bool
}

// shareOptionRE is the syntax of one share mount option: nothing a shell or
// mount(8) reads specially, no comma (one option is one option).
var shareOptionRE = regexp.MustCompile(`^[A-Za-z0-9._:/=@+-]{1,256}$`)

// refusedShareOptions would make mount(8) do something other than mount the
// share: move, remount or bind another path, or attach a file.
var refusedShareOptions = map[string]bool{
	"bind": true, "rbind": true, "move": true, "rmove": true, "remount": true,
	"loop": true, "offset": true, "sizelimit": true, "encryption": true, "helper": true,
}

func checkShareOption(o string) error {
	if !shareOptionRE.MatchString(o) {
		return fmt.Errorf("share mount option %q may hold only letters, digits and . _ : / = @ + - (one option, no comma)", o)
	}
	key, _, _ := strings.Cut(o, "=")
	if refusedShareOptions[key] || strings.HasPrefix(key, "x-") {
		return fmt.Errorf("share mount option %q is not passed: it would make mount(8) mount something other than the share", o)
	}
	return nil
}

// splitOptions parses a comma-separated option list (shareOptions, a volume
// context's), each option checked.
func splitOptions(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	var out []string
	for _, o := range strings.Split(s, ",") {
		if err := checkShareOption(o); err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	return out, nil
}

// secretOptions returns the sensitive mount options in a request's secrets.
// Errors never show a secret's value.
func secretOptions(secrets map[string]string) ([]string, error) {
	raw, ok := secrets[SecretMountOptions]
	if !ok || raw == "" {
		return nil, nil
	}
	var out []string
	for i, o := range strings.Split(raw, ",") {
		if checkShareOption(o) != nil {
			return nil, status.Errorf(codes.InvalidArgument, "secret key %s: option %d is not one option of letters, digits and . _ : / = @ + -, or would mount something other than the share (its value is not shown)", SecretMountOptions, i+1)
		}
		out = append(out, o)
	}
	return out, nil
}

// shareFlags are the mount flags of a dir volume on a share (a StorageClass's
// mountOptions) that are the share's: every flag but the generic per-mount
// ones (ro, noexec, nosuid, nodev, atime, …), which stay the volume's own bind
// mount's as on every pool (volumeFlags). nfsvers, hard, rsize and the like
// are the share's, which a bind mount could not honour anyway.
func shareFlags(flags []string) ([]string, error) {
	generic := map[string]bool{}
	for _, o := range mount.BindOptions(flags) {
		generic[o] = true
	}
	var share []string
	for _, o := range flags {
		if generic[o] {
			continue
		}
		if err := checkShareOption(o); err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		share = append(share, o)
	}
	return share, nil
}

// shareParams are the share parameters of a StorageClass.
type shareParams struct {
	ref     pool.ShareRef
	options []string
}

// parseShareParams reads the share parameters out of params (removing them),
// nil when there are none.
func (d *Driver) parseShareParams(params map[string]string) (*shareParams, error) {
	typ, hasType := params[ParamShareType]
	src, hasSource := params[ParamShareSource]
	server, hasServer := params[ParamServer]
	share, hasShare := params[ParamShare]
	opts, hasOpts := params[ParamShareOptions]
	if !hasType && !hasSource && !hasServer && !hasShare && !hasOpts {
		return nil, nil
	}
	for _, k := range []string{ParamShareType, ParamShareSource, ParamServer, ParamShare, ParamShareOptions} {
		delete(params, k)
	}
	var sp shareParams
	switch {
	case hasServer || hasShare:
		if hasSource {
			return nil, status.Errorf(codes.InvalidArgument, "parameters server and share name an NFS share, shareSource another: give one or the other")
		}
		if !hasServer || !hasShare || server == "" || !strings.HasPrefix(share, "/") {
			return nil, status.Errorf(codes.InvalidArgument, "parameters server and share go together: server=<NFS server>, share=<exported path, starting with />")
		}
		if strings.ContainsAny(server, ":/") && !strings.HasPrefix(server, "[") {
			return nil, status.Errorf(codes.InvalidArgument, "parameter server=%q: a host name or address, without a path", server)
		}
		if typ == "" {
			typ = "nfs"
		}
		if typ != "nfs" && typ != "nfs4" {
			return nil, status.Errorf(codes.InvalidArgument, "parameters server and share are for NFS; shareType=%q takes shareSource", typ)
		}
		sp.ref = pool.ShareRef{Type: typ, Source: server + ":" + share}
	case hasType && hasSource:
		sp.ref = pool.ShareRef{Type: typ, Source: src}
	default:
		return nil, status.Errorf(codes.InvalidArgument, "a share is named by shareType and shareSource (or, for NFS, server and share); %s alone names none", ParamShareOptions)
	}
	if err := d.shares.allowed(sp.ref); err != nil {
		return nil, err
	}
	o, err := splitOptions(opts)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "parameter %s: %v", ParamShareOptions, err)
	}
	sp.options = o
	return &sp, nil
}

// sharePool returns the pool on share r, mounting the share on this node if
// it is not, and laying out a new pool when acc.layOut (the request's
// StorageClass named the share). A share mounted only because an ID named it
// must already hold this share's pool (its pool.json, written at the first
// CreateVolume); otherwise it is unmounted again and the answer is NOT_FOUND.
func (d *Driver) sharePool(ctx context.Context, r pool.ShareRef, acc shareAccess) (*pool.Pool, error) {
	name := r.PoolName()
	// A served pool passed allowed when it joined, and the allow-list does
	// not change while the driver runs.
	if p := d.pool(name); p != nil && (acc.noMount || p.MountReady() == nil && (!acc.layOut || p.LaidOut())) {
		return p, nil
	}
	if acc.noMount {
		return nil, status.Errorf(codes.Unavailable, "share %s is not mounted on node %s: the next stage of one of its volumes mounts it", r, d.opts.NodeID)
	}
	if err := d.shares.allowed(r); err != nil {
		return nil, err
	}
	unlock, err := d.shares.lock(ctx, name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	path, mountedNow, err := d.shares.m.Ensure(ctx, poolmount.Share{Ref: r, Options: acc.options, Sensitive: acc.sensitive})
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "share %s cannot be mounted on node %s: %v", r, d.opts.NodeID, err)
	}
	p := d.pool(name)
	if p == nil {
		if p, err = d.openSharePool(r, path); err != nil {
			return nil, grpcError(err)
		}
	}
	if !p.LaidOut() {
		if !acc.layOut {
			if mountedNow && d.pool(name) == nil {
				if err := d.shares.m.Release(ctx, r); err != nil {
					klog.FromContext(ctx).Error(err, "Unmounting a share that holds no pool", "share", r.String())
				}
			}
			return nil, status.Errorf(codes.NotFound, "share %s holds no poolcsi pool (%s): no volume was ever created on it", r, name)
		}
		if err := p.LayOut(); err != nil {
			return nil, grpcError(err)
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
	return pool.Open(pool.Config{Name: r.PoolName(), Path: path, Shared: true, RequireMount: d.shares.m.RequireMount(), Share: &r, NoLayout: true})
}

// poolOf returns the pool of a volume ID: a configured pool, or a share's
// (mounted if it must be, with what acc brings).
func (d *Driver) poolOf(ctx context.Context, vid pool.VolumeID, acc shareAccess) (*pool.Pool, error) {
	r, isShare := vid.ShareRef()
	return d.idPool(ctx, "volume "+vid.String(), vid.Pool, r, isShare, acc)
}

// snapshotPool is poolOf for a snapshot ID.
func (d *Driver) snapshotPool(ctx context.Context, sid pool.SnapshotID, acc shareAccess) (*pool.Pool, error) {
	r, isShare := sid.ShareRef()
	return d.idPool(ctx, "snapshot "+sid.String(), sid.Pool, r, isShare, acc)
}

// idPool is the pool named in an ID (what names the ID in messages).
func (d *Driver) idPool(ctx context.Context, what, poolName string, r pool.ShareRef, isShare bool, acc shareAccess) (*pool.Pool, error) {
	if isShare {
		return d.sharePool(ctx, r, acc)
	}
	p := d.pool(poolName)
	if p == nil {
		return nil, status.Errorf(codes.NotFound, "%s: pool %q is not configured on this driver (pools: %s)", what, poolName, joinNames(d.configured))
	}
	return p, nil
}

// secretAccess is the share access of a call that brings only secrets.
func secretAccess(secrets map[string]string) (shareAccess, error) {
	s, err := secretOptions(secrets)
	return shareAccess{sensitive: s}, err
}

// contextAccess is the share access of a call that brings a volume context
// and a capability (ControllerPublishVolume, NodeStageVolume): the
// StorageClass's shareOptions, kept in the volume context, and for a dir
// volume the capability's non-generic mount flags.
func contextAccess(volumeContext, secrets map[string]string, flags []string) (shareAccess, error) {
	acc, err := secretAccess(secrets)
	if err != nil {
		return acc, err
	}
	if acc.options, err = splitOptions(volumeContext[ParamShareOptions]); err != nil {
		return acc, status.Errorf(codes.InvalidArgument, "volume context %s: %v", ParamShareOptions, err)
	}
	if l := volumeContext[ParamLayout]; l == "" || l == string(pool.LayoutDir) {
		share, err := shareFlags(flags)
		if err != nil {
			return acc, err
		}
		acc.options = append(acc.options, share...)
	}
	return acc, nil
}

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
		log.Info("Serving the pool on a share mounted before", "pool", p.Name, "share", r.String(), "path", path)
	}
}

// volumeFlags are the mount flags of a capability that concern the volume's
// own mount: all of them, except on a dir volume of a share, whose
// non-generic flags are the share's (shareFlags).
func volumeFlags(p *pool.Pool, v *pool.Volume, vc *csi.VolumeCapability) []string {
	flags := vc.GetMount().GetMountFlags()
	if p.Share != nil && v.Layout == pool.LayoutDir {
		return mount.BindOptions(flags)
	}
	return flags
}
