package params

import (
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// StorageClass parameters poolcsi understands. Kubernetes' own csi.storage.k8s.io/*
// keys are accepted as sent; any other key is refused so a typo in a StorageClass
// fails loudly instead of silently giving the default.
const (
	ParamPool   = "pool"
	ParamLayout = "layout"
	ParamFSType = "fsType"
	K8sPrefix   = "csi.storage.k8s.io/"
)

// Layouts are the layouts a StorageClass may name.
var Layouts = []pool.Layout{pool.LayoutImage, pool.LayoutDir}

// Config is what the parsers know of the driver: names, never pools.
type Config struct {
	Pools  []string // the operator's pools, sorted
	Shares Shares
}

// Create is a CreateVolume's (or GetCapacity's) parsed StorageClass
// parameters: a configured pool's name, or a share; the driver resolves it.
type Create struct {
	Pool   string // "" when Share names a share
	Share  *Share
	Layout pool.Layout
	FSType string
	Keep   map[string]string // recorded in volume.json for operators
}

// ParseCreate checks StorageClass parameters; in is not changed.
func ParseCreate(in map[string]string, cfg Config) (Create, error) {
	cp := Create{Layout: pool.LayoutImage, Keep: map[string]string{}}
	params := make(map[string]string, len(in))
	for k, v := range in {
		params[k] = v
	}
	share, err := ParseShare(params, cfg.Shares)
	if err != nil {
		return cp, err
	}
	if share != nil {
		if _, ok := params[ParamPool]; ok {
			return cp, status.Errorf(codes.InvalidArgument, "parameter pool names a configured pool, the share parameters a share: give one or the other")
		}
		cp.Share = share
		cp.Layout = pool.LayoutDir // like every shared pool's RWX volumes; layout: image for an image
		cp.Keep[ParamShareType] = share.Ref.Type
		cp.Keep[ParamShareSource] = share.Ref.Source
		if len(share.Options) > 0 {
			cp.Keep[ParamShareOptions] = strings.Join(share.Options, ",")
		}
	}
	for k, v := range params {
		switch {
		case k == ParamPool:
			if !slices.Contains(cfg.Pools, v) {
				return cp, status.Errorf(codes.InvalidArgument, "parameter pool=%q: no such pool here (pools: %s)", v, strings.Join(cfg.Pools, ", "))
			}
			cp.Pool = v
		case k == ParamLayout:
			if !slices.Contains(Layouts, pool.Layout(v)) {
				return cp, status.Errorf(codes.InvalidArgument, "parameter layout=%q: supported layouts are image and dir", v)
			}
			cp.Layout = pool.Layout(v)
		case k == ParamFSType, k == K8sPrefix+"fstype":
			fs := strings.ToLower(v)
			if !mount.SupportedFS(fs) {
				return cp, status.Errorf(codes.InvalidArgument, "parameter %s=%q: supported filesystems are ext4, xfs, btrfs", k, v)
			}
			cp.FSType = fs
			continue
		case strings.HasPrefix(k, K8sPrefix):
			if strings.HasPrefix(k, K8sPrefix+"pv") { // pv/name, pvc/name, pvc/namespace
				cp.Keep[k] = v
			}
			continue
		default:
			return cp, status.Errorf(codes.InvalidArgument, "unknown parameter %q (known: pool, layout, fsType, shareType, shareSource, shareOptions, server, share, %s*)", k, K8sPrefix)
		}
		cp.Keep[k] = v
	}
	if cp.Pool == "" && cp.Share == nil {
		if len(cfg.Pools) != 1 {
			return cp, status.Errorf(codes.InvalidArgument, "parameter pool is required when several pools are configured (pools: %s)", strings.Join(cfg.Pools, ", "))
		}
		cp.Pool = cfg.Pools[0]
	}
	return cp, nil
}

// NamesShare tells whether StorageClass parameters name a share.
func NamesShare(sc map[string]string) bool {
	for _, k := range []string{ParamShareType, ParamShareSource, ParamServer, ParamShare} {
		if _, ok := sc[k]; ok {
			return true
		}
	}
	return false
}
