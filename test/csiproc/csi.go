package csiproc

import (
	"github.com/container-storage-interface/spec/lib/go/csi"
)

// MountCap is a filesystem capability with the given fs type and access mode.
func MountCap(fsType string, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// BlockCap is a raw block capability.
func BlockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// RWO is the access mode of a ReadWriteOnce PVC.
const RWO = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
