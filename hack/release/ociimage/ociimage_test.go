package ociimage

import (
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/types"
)

// The same files give the same digest whatever their order; Build keeps the Docker media
// types the harness's imports always had, BuildOCI has OCI's throughout.
func TestBuild(t *testing.T) {
	files := []File{
		{Path: "/usr/bin/a", Data: []byte("a"), Mode: 0o755},
		{Path: "/bin", Link: "usr/bin"},
		{Path: "/tmp", Dir: true, Mode: 0o1777},
	}
	reversed := []File{files[2], files[1], files[0]}
	for _, tt := range []struct {
		name            string
		oci             bool
		manifest, layer types.MediaType
	}{
		{"docker", false, types.DockerManifestSchema2, types.DockerLayer},
		{"oci", true, types.OCIManifestSchema1, types.OCILayer},
	} {
		t.Run(tt.name, func(t *testing.T) {
			build := func(fs []File) (string, types.MediaType, types.MediaType) {
				img := Image{Files: fs, Entrypoint: []string{"/usr/bin/a"}}
				v, err := img.Build("arm64")
				if tt.oci {
					v, err = img.BuildOCI("arm64")
				}
				if err != nil {
					t.Fatal(err)
				}
				d, err := v.Digest()
				if err != nil {
					t.Fatal(err)
				}
				m, err := v.Manifest()
				if err != nil {
					t.Fatal(err)
				}
				cfg, err := v.ConfigFile()
				if err != nil || cfg.Architecture != "arm64" || cfg.OS != "linux" {
					t.Fatalf("config %+v, %v: want linux/arm64", cfg, err)
				}
				return d.String(), m.MediaType, m.Layers[0].MediaType
			}
			d1, mt, lt := build(files)
			d2, _, _ := build(reversed)
			if d1 != d2 {
				t.Errorf("digests differ with the files' order: %s, %s", d1, d2)
			}
			if mt != tt.manifest || lt != tt.layer {
				t.Errorf("media types %s, %s; want %s, %s", mt, lt, tt.manifest, tt.layer)
			}
		})
	}
}
