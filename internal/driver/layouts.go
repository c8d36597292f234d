package driver

import "github.com/poolcsi/poolcsi/internal/layout"

// The layouts and the Host seam live in internal/layout; these names keep the
// handlers' and the callers' spelling.
type (
	nodeVolume    = layout.NodeVolume
	contentSource = layout.ContentSource

	// Host is how a Driver reaches the node's kernel (layout.Host).
	Host = layout.Host
	// MountTable is the node's mounts (layout.MountTable).
	MountTable = layout.MountTable
	// LoopDevices attaches image files as block devices (layout.LoopDevices).
	LoopDevices = layout.LoopDevices
	// BlockDevices formats, sizes and grows devices (layout.BlockDevices).
	BlockDevices = layout.BlockDevices
	// Filesystems answers statfs and freezes mounted filesystems (layout.Filesystems).
	Filesystems = layout.Filesystems
	// Cgroups holds pods' I/O to limits (layout.Cgroups).
	Cgroups = layout.Cgroups
)
