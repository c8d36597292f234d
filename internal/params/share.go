package params

import (
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// StorageClass parameters naming a share (docs/pools.md, "Shares named by a
// StorageClass").
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

// Shares is what the parsers know of the driver's share machinery.
type Shares struct {
	Enabled bool     // the driver mounts shares (serve --share-dir)
	Types   []string // the share types allowed (serve --share-types), sorted
	Keyed   bool     // the driver holds the cluster's share key
}

// Allowed checks a share against the allow-list and its type's grammar,
// before anything is mounted: a volume ID is request input and can name any
// share.
func (s Shares) Allowed(r pool.ShareRef) error {
	if !s.Enabled {
		return status.Errorf(codes.InvalidArgument, "share %s: this driver mounts no shares (serve --share-dir is empty)", r)
	}
	if !containsString(s.Types, r.Type) {
		return status.Errorf(codes.InvalidArgument, "share type %q is not allowed on this driver (serve --share-types: %s)", r.Type, strings.Join(s.Types, ","))
	}
	if err := poolmount.CheckShare(r); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return nil
}

func containsString(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Share is the share a StorageClass's parameters name.
type Share struct {
	Ref     pool.ShareRef
	Options []string // shareOptions, each checked against the type's allow-list
}

// ParseShare reads the share parameters out of params (removing them), nil
// when there are none.
func ParseShare(params map[string]string, shares Shares) (*Share, error) {
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
	var sp Share
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
		sp.Ref = pool.ShareRef{Type: typ, Source: server + ":" + share}
	case hasType && hasSource:
		sp.Ref = pool.ShareRef{Type: typ, Source: src}
	default:
		return nil, status.Errorf(codes.InvalidArgument, "a share is named by shareType and shareSource (or, for NFS, server and share); %s alone names none", ParamShareOptions)
	}
	if err := shares.Allowed(sp.Ref); err != nil {
		return nil, err
	}
	if !shares.Keyed {
		return nil, status.Errorf(codes.InvalidArgument, "share %s: StorageClasses can name shares only on a driver with the cluster's share key (serve --share-key-file; the chart makes one): the key tags each volume ID, so that no ID can name a share by itself", sp.Ref)
	}
	sp.Options = SplitOptions(opts)
	if err := CheckShareOptions(sp.Ref.Type, sp.Options, nil); err != nil {
		return nil, csierr.Failf(csierr.ErrInvalid, "parameter %s: %w", ParamShareOptions, err)
	}
	return &sp, nil
}

// CheckShareOptions checks the mount options a call brings for a share of type
// typ (options from a StorageClass or a volume context, sensitive ones from
// its secrets) against the type's allow-list: INVALID_ARGUMENT, the secret
// values never shown.
func CheckShareOptions(typ string, options, sensitive []string) error {
	for _, o := range options {
		if err := poolmount.CheckOption(typ, o, false); err != nil {
			return csierr.Failf(csierr.ErrInvalid, "%w", err)
		}
	}
	for _, o := range sensitive {
		if err := poolmount.CheckOption(typ, o, true); err != nil {
			return csierr.Failf(csierr.ErrInvalid, "secret key %s: %w", SecretMountOptions, err)
		}
	}
	return nil
}

// SplitOptions splits a comma-separated option list (shareOptions, a volume
// context's); the share type's allow-list checks each later.
func SplitOptions(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

// ShareFlags are the mount flags of a dir volume on a share (a StorageClass's
// mountOptions) that are the share's: every flag but the generic per-mount
// ones (ro, noexec, nosuid, nodev, atime, …), which stay the volume's own bind
// mount's as on every pool. nfsvers, hard, rsize and the like are the
// share's, which a bind mount could not honour anyway.
func ShareFlags(flags []string) []string {
	generic := map[string]bool{}
	for _, o := range mount.BindOptions(flags) {
		generic[o] = true
	}
	var share []string
	for _, o := range flags {
		if !generic[o] {
			share = append(share, o)
		}
	}
	return share
}
