package driver

import (
	"fmt"
	"os"
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

// compatible tells whether an existing volume satisfies a capability spec.
func (d *Driver) compatible(s params.Caps, v *pool.Volume) error {
	if s.Access != v.AccessType {
		return fmt.Errorf("volume %s is a %s volume, the request asks for %s access", v.ID, v.AccessType, s.Access)
	}
	lay := d.layoutOf(v.Layout)
	if !lay.sameFS(s, v.FSType) {
		return fmt.Errorf("volume %s holds %s, the request asks for %s", v.ID, v.FSType, s.FSType)
	}
	if err := lay.allowed(s); err != nil {
		return fmt.Errorf("volume %s: %w", v.ID, err)
	}
	return nil
}

// requestPath validates a staging or target path sent by the CO: absolute,
// clean of "..", strictly below the allowed prefix (never the prefix itself:
// a volume mounted over kubelet's whole directory would hide every pod's
// volumes), and with no symbolic link in any component below it. Kubelet
// never sends a link; a path through one could make a mount or unmount act
// somewhere else. This is the early, readable refusal: the mounter resolves
// the path once more, without links, and acts on what it resolved
// (internal/mount/beneath.go), so a link swapped in after this check moves
// nothing.
func (d *layoutDeps) requestPath(field, p string) (string, error) {
	switch {
	case p == "":
		return "", csierr.Failf(csierr.ErrInvalid, "%s is required", field)
	case !filepath.IsAbs(p):
		return "", csierr.Failf(csierr.ErrInvalid, "%s %q must be absolute", field, p)
	case strings.ContainsRune(p, 0):
		return "", csierr.Failf(csierr.ErrInvalid, "%s contains a NUL byte", field)
	case len(p) > 4096:
		return "", csierr.Failf(csierr.ErrInvalid, "%s is longer than PATH_MAX", field)
	}
	for _, part := range strings.Split(p, "/") {
		if part == ".." {
			return "", csierr.Failf(csierr.ErrInvalid, "%s %q contains '..'", field, p)
		}
	}
	clean := filepath.Clean(p)
	base := "/"
	if prefix := d.pathPrefix; prefix != "" && prefix != "/" {
		if !strings.HasPrefix(clean, prefix+"/") {
			return "", csierr.Failf(csierr.ErrInvalid, "%s %q is not below %s, the only directory this driver mounts in (--allowed-path-prefix)", field, p, prefix)
		}
		base = prefix
	} else if clean == "/" {
		return "", csierr.Failf(csierr.ErrInvalid, "%s is /", field)
	}
	if link := firstLink(base, clean); link != "" {
		return "", csierr.Failf(csierr.ErrInvalid, "%s %q goes through the symbolic link %s; staging and target paths must not", field, p, link)
	}
	return clean, nil
}

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
func (d *Driver) checkNesting(field, path string) error {
	table, err := d.mounts.Table()
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
func (d *Driver) belowPrefix(m string) bool {
	prefix := d.pathPrefix
	if prefix == "" || prefix == "/" {
		return m != "/"
	}
	return strings.HasPrefix(m, prefix+"/")
}

// volumeMount says whether mount table entry e shows a volume: a loop
// device's filesystem, or a directory of one of the pools bound there.
func (d *Driver) volumeMount(table []mount.MountEntry, e mount.MountEntry) bool {
	if e.Major == loopMajor {
		return true
	}
	for _, name := range d.names() {
		p := d.pool(name)
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

// firstLink returns the first component of path below base that is a
// symbolic link, "" if none (components that do not exist yet are fine).
func firstLink(base, path string) string {
	rest := strings.TrimPrefix(strings.TrimPrefix(path, base), "/")
	cur := base
	for _, part := range strings.Split(rest, "/") {
		if part == "" {
			continue
		}
		cur = filepath.Join(cur, part)
		fi, err := os.Lstat(cur)
		if err != nil {
			return ""
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			return cur
		}
	}
	return ""
}

// volumePath validates the volume_path of NodeGetVolumeStats and NodeExpandVolume.
// Kubelet only sends absolute paths, so any other path cannot hold the volume:
// NOT_FOUND, as the CSI sanity suite expects, rather than INVALID_ARGUMENT.
func (d *Driver) volumePath(vid pool.VolumeID, raw string) (string, error) {
	path, err := d.requestPath("volume_path", raw)
	if err != nil {
		return "", csierr.Failf(csierr.ErrNotAtPath, "volume %s is not at %q: %w", vid, raw, err)
	}
	return path, nil
}

// checkCapability refuses an optional capability (ControllerExpandVolume and
// NodeExpandVolume carry one) that the volume cannot honour.
func (d *Driver) checkCapability(v *pool.Volume, vc *csi.VolumeCapability) error {
	if vc == nil {
		return nil
	}
	caps, err := params.ParseCaps([]*csi.VolumeCapability{vc}, "")
	if err != nil {
		return err
	}
	if err := d.compatible(caps, v); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return nil
}
