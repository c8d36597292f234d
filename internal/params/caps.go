// Package params parses what a CSI request asks for: StorageClass and
// VolumeAttributesClass parameters, share parameters and mount option syntax,
// inline-volume attributes and volume capabilities. Each parser is a pure
// function returning one parsed request, or INVALID_ARGUMENT; it names pools
// and shares, and never opens, mounts or locks anything: the driver resolves
// the names afterwards.
package params

import (
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// DefaultFSType is used when neither the capability nor the parameters name one.
const DefaultFSType = "ext4"

// Caps is what a set of volume capabilities asks of a volume.
type Caps struct {
	Access pool.AccessType
	FSType string
	Modes  []csi.VolumeCapability_AccessMode_Mode
}

// ParseCaps checks a capability list and folds it into one spec; which access
// modes a volume allows depends on its layout (layout.allowed). defaultFS
// applies when no capability names a filesystem.
func ParseCaps(caps []*csi.VolumeCapability, defaultFS string) (Caps, error) {
	var s Caps
	if len(caps) == 0 {
		return s, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	for i, c := range caps {
		if c == nil {
			return s, status.Errorf(codes.InvalidArgument, "volume_capabilities[%d] is empty", i)
		}
		var access pool.AccessType
		switch {
		case c.GetBlock() != nil:
			access = pool.AccessBlock
		case c.GetMount() != nil:
			access = pool.AccessFilesystem
			fs := strings.ToLower(c.GetMount().GetFsType())
			if fs != "" {
				if !mount.SupportedFS(fs) {
					return s, status.Errorf(codes.InvalidArgument, "volume_capabilities[%d]: fs_type %q is not supported (ext4, xfs, btrfs)", i, fs)
				}
				if s.FSType != "" && s.FSType != fs {
					return s, status.Errorf(codes.InvalidArgument, "volume_capabilities ask for two filesystems, %s and %s", s.FSType, fs)
				}
				s.FSType = fs
			}
		default:
			return s, status.Errorf(codes.InvalidArgument, "volume_capabilities[%d] has no access type (mount or block)", i)
		}
		if s.Access != "" && s.Access != access {
			return s, status.Error(codes.InvalidArgument, "volume_capabilities mix block and mount access; a volume is one or the other")
		}
		s.Access = access
		mode := c.GetAccessMode().GetMode()
		if mode == csi.VolumeCapability_AccessMode_UNKNOWN {
			return s, status.Errorf(codes.InvalidArgument, "volume_capabilities[%d] has no access mode", i)
		}
		if _, known := csi.VolumeCapability_AccessMode_Mode_name[int32(mode)]; !known {
			return s, status.Errorf(codes.InvalidArgument, "volume_capabilities[%d]: unknown access mode %d", i, mode)
		}
		s.Modes = append(s.Modes, mode)
	}
	if s.Access == pool.AccessFilesystem && s.FSType == "" {
		s.FSType = defaultFS
	}
	return s, nil
}

// CheckRequestName checks the name of a CreateVolume, CreateSnapshot or
// CreateVolumeGroupSnapshot request: required, and a name the pool can key
// (kind says whose, in the message).
func CheckRequestName(kind, name string) error {
	if name == "" {
		return status.Error(codes.InvalidArgument, "name is required")
	}
	if err := pool.ValidateVolumeName(name); err != nil {
		return status.Error(codes.InvalidArgument, strings.Replace(err.Error(), "volume name", kind+" name", 1))
	}
	return nil
}
