package poolset

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

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// Shares a StorageClass names: the driver mounts the share itself, on the
// controller and on each node that stages a volume of it, and keeps a pool on
// it like any shared pool. The pool's name and the volume IDs are derived from
// the share's type and source (internal/pool/share.go), so calls that bring
// only an ID find the share after a restart anywhere; options and secrets come
// with the requests.

// DefaultShareTypes are the share types allowed when --share-types is not
// given: kernel network filesystems whose source names a server. A bind mount
// of a node directory would let a StorageClass reach into the node; fuse.ceph
// runs ceph-fuse, a root daemon whose every configuration option is a flag (a
// log file, an admin socket, a keyring path, each a path it writes or
// unlinks): the driver builds its argv from a checked source and a short
// allow-list, but an operator who does not use it should not carry it. Both
// are allowed by name (--share-types).
var DefaultShareTypes = []string{"nfs", "nfs4", "ceph"}

// MinShareKeyLength is the least a share key may hold.
const MinShareKeyLength = 32

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

// shareState is the set's share machinery.
type shareState struct {
	m     ShareMounter
	types map[string]bool
	// keys are the cluster's share keys: the first tags the IDs this driver
	// makes, any of them verifies a tag (so a key can be rotated).
	keys  [][]byte
	locks sync.Map // pool name → chan struct{}: one mount of a share at a time
}

func (s *shareState) init(deps Deps) error {
	s.m = deps.Shares
	s.types = map[string]bool{}
	types := deps.ShareTypes
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
	for i, k := range deps.ShareKeys {
		if len(k) < MinShareKeyLength {
			return fmt.Errorf("share key %d is %d bytes, want at least %d", i+1, len(k), MinShareKeyLength)
		}
	}
	s.keys = deps.ShareKeys
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

// Tag is the tag of share r under key: 8 bytes of HMAC-SHA256 over the share.
func Tag(key []byte, r pool.ShareRef) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte("poolcsi share tag v1\x00" + r.Type + "\x00" + r.Source))
	return base64.RawURLEncoding.EncodeToString(mac.Sum(nil)[:8])
}

// tag is the tag this driver puts on the IDs of share r's volumes.
func (s *shareState) tag(r pool.ShareRef) string {
	if len(s.keys) == 0 {
		return ""
	}
	return Tag(s.keys[0], r)
}

// verified tells whether tag proves that a driver holding one of the
// cluster's keys made an ID on share r (from a StorageClass that named it).
func (s *shareState) verified(r pool.ShareRef, tag string) bool {
	if tag == "" {
		return false
	}
	for _, k := range s.keys {
		if hmac.Equal([]byte(Tag(k, r)), []byte(tag)) {
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

// lock takes the set's lock on one share until ctx ends.
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

// Access is what a call that may mount a share (Ensure) brings to mount it
// with, as it came in the request; Ensure reads it. A call that only reads
// or tears down (ControllerGetVolume, the health and stats calls,
// NodeUnpublish, NodeUnstage, NodeExpand, and the snapshot reads) brings
// none: it uses Lookup, answered from the pools this driver serves, whatever
// its volume ID says.
type Access struct {
	// Secrets are the request's secrets: their mountOptions are the share's
	// sensitive options (every call that needs the data).
	Secrets map[string]string
	// VolumeContext and MountFlags, of a call that brings a volume context
	// and a capability (ControllerPublishVolume, NodeStageVolume): the
	// StorageClass's shareOptions, kept in the volume context, and for a dir
	// volume the capability's non-generic mount flags. They are used only
	// where the share has no record on this node yet; a recorded share is
	// mounted again with its recorded options.
	VolumeContext map[string]string
	MountFlags    []string
	// evenHeld: a pool held for its start-up passes is returned at once
	// (LookupHeld).
	evenHeld bool

	// fromStorageClass: a StorageClass's parameters named the share (a
	// CreateVolume or GetCapacity, ForCreate): lay out its pool if new, and
	// record its options (scOptions: its parameters' and mount flags').
	fromStorageClass bool
	scOptions        []string
}

// options are the share's options and sensitive options the call brings.
func (a Access) options() (options, sensitive []string) {
	sensitive = splitList(a.Secrets[params.SecretMountOptions])
	options = splitList(a.VolumeContext[params.ParamShareOptions])
	if l := a.VolumeContext[params.ParamLayout]; l == "" || l == string(pool.LayoutDir) {
		options = append(options, params.ShareFlags(a.MountFlags)...)
	}
	return append(options, a.scOptions...), sensitive
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

// openSharePool opens the pool on share r, mounted at path. Only LayOut lays
// it out: a share is a pool once its pool.json says so.
func (s *Set) openSharePool(r pool.ShareRef, path string) (*pool.Pool, error) {
	opts := []pool.Option{pool.WithNode(s.deps.NodeID)}
	if s.deps.LayoutGuard != nil {
		opts = append(opts, pool.WithLayoutGuard(s.deps.LayoutGuard(r.PoolName())))
	}
	return pool.Open(pool.Config{Name: r.PoolName(), Path: path, Shared: true, RequireMount: s.shares.m.RequireMount(), Share: &r, NoLayout: true}, opts...)
}
