// Package ociimage builds single-layer container images from a list of files, with
// go-containerregistry and no Docker engine: the test harness's images (imported into the
// node's containerd) and `make image`'s multi-platform index share this one layer writer,
// so both routes pack files the same way.
package ociimage

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Image is a single-layer image: Files, and the command it runs.
type Image struct {
	Ref        string
	Files      []File
	Entrypoint []string
	Cmd        []string
}

// File is one entry of an image's layer: a copy of Src (a host file) or Data, a symlink
// to Link, or a directory.
type File struct {
	Path string // absolute path inside the image
	Src  string // host file to copy (its content, symlinks followed)
	Data []byte // the content, when there is no Src (a file read out of a .deb)
	Link string // symlink target
	Dir  bool
	Mode int64 // for directories and Data files; Src files keep the host file's mode
}

// MergedUsr are the links of Debian's merged /usr, so that library paths
// (/lib/x86_64-linux-gnu/..., the loader in /lib64) resolve inside the image as on a
// Debian host, and the directories a container runtime expects to mount over.
var MergedUsr = []File{
	{Path: "/bin", Link: "usr/bin"}, {Path: "/sbin", Link: "usr/sbin"},
	{Path: "/lib", Link: "usr/lib"}, {Path: "/lib64", Link: "usr/lib64"},
	{Path: "/tmp", Dir: true, Mode: 0o1777}, {Path: "/run", Dir: true, Mode: 0o755},
	{Path: "/etc", Dir: true, Mode: 0o755}, {Path: "/proc", Dir: true, Mode: 0o555},
	{Path: "/sys", Dir: true, Mode: 0o555}, {Path: "/dev", Dir: true, Mode: 0o755},
}

// UsrPath maps /lib/x/y to /usr/lib/x/y: in the image /bin, /sbin, /lib and /lib64 are
// links into /usr, as on a merged-/usr host, so a file is stored under /usr once.
func UsrPath(p string) string {
	for _, top := range []string{"/bin/", "/sbin/", "/lib/", "/lib64/"} {
		if strings.HasPrefix(p, top) {
			return "/usr" + p
		}
	}
	return p
}

// Build makes the image for linux/arch with Docker media types (what `ctr images import`
// of a docker archive has always been given by the harness).
func (img Image) Build(arch string) (v1.Image, error) {
	return img.build(arch, false)
}

// BuildOCI makes the image for linux/arch with OCI media types, for an OCI image layout
// and index that registries and skopeo take as they are.
func (img Image) BuildOCI(arch string) (v1.Image, error) {
	return img.build(arch, true)
}

// Layer is the image's one layer as an uncompressed tar: files sorted, parents made,
// fixed times, so the same inputs give the same digest.
func (img Image) Layer() ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	files := append([]File{}, img.Files...)
	sort.SliceStable(files, func(i, j int) bool { return files[i].Path < files[j].Path })
	epoch := time.Unix(0, 0)
	dirs := map[string]bool{"/": true}
	var mkdirs func(string) error
	mkdirs = func(d string) error {
		if dirs[d] {
			return nil
		}
		if err := mkdirs(filepath.Dir(d)); err != nil {
			return err
		}
		dirs[d] = true
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(d, "/") + "/", Mode: 0o755, ModTime: epoch})
	}
	for _, f := range files {
		if err := mkdirs(filepath.Dir(f.Path)); err != nil {
			return nil, err
		}
		name := strings.TrimPrefix(f.Path, "/")
		switch {
		case f.Dir:
			if dirs[f.Path] {
				continue
			}
			dirs[f.Path] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: f.Mode, ModTime: epoch}); err != nil {
				return nil, err
			}
		case f.Link != "":
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: f.Link, Mode: 0o777, ModTime: epoch}); err != nil {
				return nil, err
			}
		default:
			data, mode := f.Data, f.Mode
			if f.Src != "" {
				var err error
				if data, err = os.ReadFile(f.Src); err != nil {
					return nil, err
				}
				st, err := os.Stat(f.Src)
				if err != nil {
					return nil, err
				}
				mode = int64(st.Mode().Perm())
			}
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: int64(len(data)), Mode: mode, ModTime: epoch}); err != nil {
				return nil, err
			}
			if _, err := tw.Write(data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func (img Image) build(arch string, oci bool) (v1.Image, error) {
	layerBytes, err := img.Layer()
	if err != nil {
		return nil, err
	}
	base := empty.Image
	var opts []tarball.LayerOption
	if oci {
		base = mutate.MediaType(base, types.OCIManifestSchema1)
		base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
		opts = append(opts, tarball.WithMediaType(types.OCILayer))
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerBytes)), nil }, opts...)
	if err != nil {
		return nil, err
	}
	v, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, err
	}
	cfg, err := v.ConfigFile()
	if err != nil {
		return nil, err
	}
	epoch := time.Unix(0, 0)
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture = "linux", arch
	cfg.Created = v1.Time{Time: epoch}
	cfg.Config.Entrypoint, cfg.Config.Cmd = img.Entrypoint, img.Cmd
	cfg.Config.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	out, err := mutate.ConfigFile(v, cfg)
	if err != nil {
		return nil, fmt.Errorf("image %s for %s: %w", img.Ref, arch, err)
	}
	return out, nil
}
