// Package imagebuild makes poolcsi's published image: an OCI image index with one image
// per platform, each the static poolcsi binary of that architecture plus the tools of
// deploy/image-tools.txt and what they load, taken from Debian bookworm packages of that
// architecture. The test harness packs its single-arch test image from the host's files;
// both write their layer with package ociimage.
package imagebuild

import (
	"fmt"
	"os"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/poolcsi/poolcsi/hack/release/debian"
	"github.com/poolcsi/poolcsi/hack/release/ociimage"
)

// Binary is where the poolcsi binary sits in the image, as in deploy/Dockerfile.
const Binary = "/usr/local/bin/poolcsi"

// Platform is one architecture's image and what went into it.
type Platform struct {
	Arch     string
	Image    v1.Image
	Files    []ociimage.File
	Packages []debian.Package
}

// Options say what to build.
type Options struct {
	Tools  []debian.Tool
	Arches []string
	// Binary is the static poolcsi binary built for arch.
	Binary func(arch string) string
	// Source gives arch's Debian packages (a lock, or the archive's index).
	Source func(a debian.Arch) (debian.Source, error)
}

// Build makes each platform's image.
func Build(o Options) ([]Platform, error) {
	var out []Platform
	for _, name := range o.Arches {
		a, ok := debian.Arches[name]
		if !ok {
			return nil, fmt.Errorf("architecture %q: want one of amd64, arm64", name)
		}
		src, err := o.Source(a)
		if err != nil {
			return nil, err
		}
		res, err := debian.Resolve(a, o.Tools, src)
		if err != nil {
			return nil, err
		}
		bin := o.Binary(name)
		if _, err := os.Stat(bin); err != nil {
			return nil, fmt.Errorf("poolcsi binary for %s: %w", name, err)
		}
		img := ociimage.Image{
			Entrypoint: []string{Binary}, Cmd: []string{"serve", "--help"},
			Files: append(append([]ociimage.File{{Path: Binary, Src: bin}}, ociimage.MergedUsr...), res.Files...),
		}
		v, err := img.BuildOCI(name)
		if err != nil {
			return nil, err
		}
		out = append(out, Platform{Arch: name, Image: v, Files: img.Files, Packages: res.Packages})
	}
	return out, nil
}

// Index is the platforms' images in one OCI image index, with annotations (version,
// revision, source).
func Index(platforms []Platform, annotations map[string]string) v1.ImageIndex {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, p := range platforms {
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add:        p.Image,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: p.Arch}},
		})
	}
	if len(annotations) > 0 {
		idx = mutate.Annotations(idx, annotations).(v1.ImageIndex)
	}
	return idx
}

// WriteLayout writes idx as the one entry of a fresh OCI image layout in dir, named ref
// (org.opencontainers.image.ref.name), so that `skopeo copy --all oci:<dir> ...` needs no
// name and `oci:<dir>:<ref>` works too.
func WriteLayout(dir string, idx v1.ImageIndex, ref string) error {
	// The layout is replaced whole, so that no blob of an earlier build lingers; a
	// directory that is not a layout (a mistyped -out) is never removed.
	if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
		if _, err := os.Stat(filepath.Join(dir, "oci-layout")); err != nil {
			return fmt.Errorf("%s is not empty and not an OCI image layout: not replacing it", dir)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("OCI layout %s: %w", dir, err)
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": ref})); err != nil {
		return fmt.Errorf("OCI layout %s: %w", dir, err)
	}
	return nil
}
