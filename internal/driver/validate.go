package driver

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// loopMajor is the block device major number of loop devices.
const loopMajor = 7

// nestedIn says how a and b nest: "inside" when a is below b, "over" when b is
// below a, "onto" when they are one path, "" when neither holds the other.
func nestedIn(a, b string) string {
	switch {
	case a == b:
		return "onto"
	case strings.HasPrefix(a, b+"/"):
		return "inside"
	case strings.HasPrefix(b, a+"/"):
		return "over"
	}
	return ""
}

// checkNesting refuses a staging or target path (clean, from requestPath)
// that is inside the mount of a volume, or holds one below it: a stage or
// publish there would make a mount point, and a pod's data, inside another
// volume (a shared pool's, on every node), or hide a mount kubelet still
// uses. Kubelet never nests them. A volume's mount is one of a loop device
// (an image volume's, this driver's or another's) or a bind of a directory of
// a pool (a dir volume's), strictly below --allowed-path-prefix, as the
// node's mount table shows it (node-local, trusted); the mount at the path
// itself is left to the layout (a retried call finds its own mount there).
func (d *core) checkNesting(field, path string) error {
	table, err := d.Mounts.Table()
	if err != nil {
		return fmt.Errorf("%s %s: read the mount table: %w", field, path, err)
	}
	for _, e := range table {
		m := filepath.Clean(e.Mountpoint)
		how := nestedIn(path, m)
		if (how != "inside" && how != "over") || !d.belowPrefix(m) {
			continue
		}
		if d.volumeMount(table, e) {
			return csierr.Failf(csierr.ErrInvalid, "%s %q is %s %s, where a volume is mounted (%s): a staging or target path is never inside another volume's mount, nor over one", field, path, how, m, e.Source)
		}
	}
	return nil
}

// belowPrefix says whether m is strictly below --allowed-path-prefix (any
// path but / without one).
func (d *core) belowPrefix(m string) bool {
	prefix := d.PathPrefix
	if prefix == "" || prefix == "/" {
		return m != "/"
	}
	return strings.HasPrefix(m, prefix+"/")
}

// volumeMount says whether mount table entry e shows a volume: a loop
// device's filesystem, or a directory of one of the pools bound there.
func (d *core) volumeMount(table []mount.MountEntry, e mount.MountEntry) bool {
	if e.Major == loopMajor {
		return true
	}
	for _, name := range d.pools.Names() {
		p := d.pools.Pool(name)
		if p == nil {
			continue
		}
		root := filepath.Clean(p.Path())
		// A table that names a bind by its source directory.
		if nestedIn(e.Source, root) == "inside" {
			return true
		}
		// A bind from the pool's filesystem, rooted in the pool. The pool's
		// filesystem is the mount its path is on, from the table alone: the
		// pool itself (a share that may hang) is not touched.
		var fs *mount.MountEntry
		for i := range table {
			if c := nestedIn(root, filepath.Clean(table[i].Mountpoint)); c == "onto" || c == "inside" || table[i].Mountpoint == "/" {
				if fs == nil || len(table[i].Mountpoint) >= len(fs.Mountpoint) {
					fs = &table[i]
				}
			}
		}
		if fs == nil || fs.Major != e.Major || fs.Minor != e.Minor || fs.Root == "" {
			continue
		}
		within := filepath.Join(fs.Root, strings.TrimPrefix(root, filepath.Clean(fs.Mountpoint)))
		if c := nestedIn(filepath.Clean(e.Root), within); c == "onto" || c == "inside" {
			return true
		}
	}
	return false
}

// volumePath validates the volume_path of NodeGetVolumeStats and NodeExpandVolume.
// Kubelet only sends absolute paths, so any other path cannot hold the volume:
// NOT_FOUND, as the CSI sanity suite expects, rather than INVALID_ARGUMENT.
func (d *core) volumePath(vid pool.VolumeID, raw string) (string, error) {
	path, err := d.RequestPath("volume_path", raw)
	if err != nil {
		return "", csierr.Failf(csierr.ErrNotAtPath, "volume %s is not at %q: %w", vid, raw, err)
	}
	return path, nil
}

// checkCapability refuses an optional capability (ControllerExpandVolume and
// NodeExpandVolume carry one) that the volume cannot honour.
func (d *core) checkCapability(v *pool.Volume, vc *csi.VolumeCapability) error {
	if vc == nil {
		return nil
	}
	caps, err := params.ParseCaps([]*csi.VolumeCapability{vc}, "")
	if err != nil {
		return err
	}
	if err := d.Compatible(caps, v); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return nil
}
