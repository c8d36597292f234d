package params

import (
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// CheckVolumeName checks a CreateVolume's name: a request name (CheckRequestName)
// that is not one of the names of ephemeral inline volumes.
func CheckVolumeName(name string) error {
	if err := CheckRequestName("volume", name); err != nil {
		return err
	}
	if strings.HasPrefix(name, pool.EphemeralPrefix) {
		return status.Errorf(codes.InvalidArgument, "name %q: names beginning %s are those of ephemeral inline volumes", name, pool.EphemeralPrefix)
	}
	return nil
}

// Source is what a new volume's content source (a snapshot or a volume)
// brings to its parameters: a copy stays in its source's pool, with its
// layout, and its filesystem is the default.
type Source struct {
	Pool   string
	Share  *pool.ShareRef // the source's pool is on this share
	Layout pool.Layout
	FSType string
}

// Volume is a CreateVolume request parsed: its StorageClass parameters, its
// mutable parameters and its capabilities.
type Volume struct {
	Params  Create
	Mutable pool.Volume // the IOLimits and Preallocate of a VolumeAttributesClass
	Caps    Caps
}

// ParseVolume parses what a CreateVolume asks for, src its content source
// (nil for none); req is not changed.
func ParseVolume(req *csi.CreateVolumeRequest, src *Source, cfg Config) (Volume, error) {
	var out Volume
	var err error
	if out.Params, err = ParseCreate(WithSource(req.GetParameters(), src), cfg); err != nil {
		return out, err
	}
	sc := out.Params
	if out.Mutable, err = CreateMutable(req.GetMutableParameters(), sc.Layout); err != nil {
		return out, err
	}
	fsType := DefaultFSType
	switch {
	case sc.FSType != "":
		fsType = sc.FSType
	case src != nil && src.FSType != "":
		fsType = src.FSType
	}
	if out.Caps, err = ParseCaps(req.GetVolumeCapabilities(), fsType); err != nil {
		return out, err
	}
	if sc.FSType != "" && out.Caps.Access == pool.AccessFilesystem && out.Caps.FSType != sc.FSType {
		return out, status.Errorf(codes.InvalidArgument, "parameter fsType=%s contradicts fs_type %s of the capabilities", sc.FSType, out.Caps.FSType)
	}
	return out, nil
}

// WithSource defaults the pool and layout of a volume made from src to src's:
// a copy stays in its source's pool, and a StorageClass need not repeat them.
// scParams is not changed.
func WithSource(scParams map[string]string, src *Source) map[string]string {
	if src == nil {
		return scParams
	}
	out := map[string]string{ParamPool: src.Pool, ParamLayout: string(src.Layout)}
	if r := src.Share; r != nil {
		// A copy stays on its source's share: named by the share, as a
		// StorageClass names it, unless the parameters name it themselves.
		delete(out, ParamPool)
		if !NamesShare(scParams) {
			out[ParamShareType], out[ParamShareSource] = r.Type, r.Source
		}
	}
	for k, v := range scParams {
		out[k] = v
	}
	return out
}
