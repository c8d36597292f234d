package layout

import (
	"os"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/poolcsi/poolcsi/internal/csierr"
	"golang.org/x/sys/unix"
)

// requestPath validates a staging or target path sent by the CO: absolute,
// clean of "..", strictly below the allowed prefix (never the prefix itself:
// a volume mounted over kubelet's whole directory would hide every pod's
// volumes), and with no symbolic link in any component below it. Kubelet
// never sends a link; a path through one could make a mount or unmount act
// somewhere else. This is the early, readable refusal: the mounter resolves
// the path once more, without links, and acts on what it resolved
// (internal/mount/beneath.go), so a link swapped in after this check moves
// nothing.
func (d *Deps) RequestPath(field, p string) (string, error) {
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
	if prefix := d.PathPrefix; prefix != "" && prefix != "/" {
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

// filesystemStats is the usage of the filesystem mounted at path.
func (d *Deps) FilesystemStats(path string) (*csi.NodeGetVolumeStatsResponse, error) {
	var st unix.Statfs_t
	if err := d.FS.Statfs(path, &st); err != nil {
		return nil, err
	}
	bs := st.Bsize
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(st.Blocks) * bs, Available: int64(st.Bavail) * bs, Used: int64(st.Blocks-st.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree), Used: int64(st.Files - st.Ffree)},
	}}, nil
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
