package driver

import (
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// Shares a StorageClass names (docs/pools.md, "Shares named by a
// StorageClass") are mounted and served by internal/poolset.

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
// given (poolset.DefaultShareTypes).
var DefaultShareTypes = poolset.DefaultShareTypes

// ShareMounter mounts shares; internal/poolmount.Shares is the real one.
type ShareMounter = poolset.ShareMounter

// MinShareKeyLength is the least a share key may hold.
const MinShareKeyLength = poolset.MinShareKeyLength

// volumeIdentity is a volume ID from the wire without its tag: what
// volume.json and snapshot.json record. An ID that does not parse is
// returned as it is (it matches nothing).
func volumeIdentity(wire string) string {
	if vid, err := pool.ParseVolumeID(wire); err == nil {
		return vid.String()
	}
	return wire
}
