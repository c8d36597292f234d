package driver

import (
	"fmt"
	"slices"
)

// setBlockReadOnly makes a block publish's read-only request real. A read-only
// bind mount of a device node does not stop writes through it, so read-only
// needs the kernel's read-only flag on the loop device — and that flag is per
// device: it covers every publish of the volume on this node. Read-only and
// read-write publishes of one block volume on one node therefore cannot be
// honoured together, and the second is refused rather than silently weakened
// (read-write made read-only, or read-only made writable). A flag left by an
// earlier read-only publish is cleared by the next read-write publish once no
// other publish remains, and by Attach on the next stage.
func (d *Driver) setBlockReadOnly(dev, target string, readOnly bool) error {
	points, err := d.mounts.MountPoints(dev)
	if err != nil {
		return fmt.Errorf("list mounts of %s: %w", dev, err)
	}
	points = slices.DeleteFunc(points, func(p string) bool { return p == target })
	// The device's flag, not the mounts' flags, tells what the other publishes are:
	// kubelet bind-mounts every block publish again under its global map path
	// (volumeDevices/<pv>/dev/<pod>) read-write whatever the publish was, and a mount
	// flag on a device node restricts nothing anyway.
	ro, err := d.devs.ReadOnly(dev)
	if err != nil {
		return err
	}
	if readOnly {
		if ro {
			return nil // every publish on this node is read-only already
		}
		if len(points) > 0 {
			return failf(errInUse, "block device %s is published read-write at %s; a read-only publish on the same node cannot be enforced beside it", dev, points[0])
		}
		if err := d.devs.SetReadOnly(dev, true); err != nil {
			return err
		}
		return nil
	}
	if !ro {
		return nil
	}
	if len(points) > 0 {
		return failf(errInUse, "block device %s is published read-only at %s; a read-write publish on the same node would make that one writable", dev, points[0])
	}
	if err := d.devs.SetReadOnly(dev, false); err != nil {
		return err
	}
	return nil
}
