package imagebuild

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/poolcsi/poolcsi/hack/release/ociimage"
)

// WriteLayout replaces an earlier layout and refuses any other directory.
func TestWriteLayout(t *testing.T) {
	img, err := ociimage.Image{Files: []ociimage.File{{Path: "/x", Data: []byte("x"), Mode: 0o644}}}.BuildOCI("amd64")
	if err != nil {
		t.Fatal(err)
	}
	idx := Index([]Platform{{Arch: "amd64", Image: img}}, map[string]string{"org.opencontainers.image.version": "v"})
	for _, tt := range []struct {
		name    string
		prepare func(dir string)
		wantErr string
	}{
		{"absent", func(string) {}, ""},
		{"empty", func(dir string) { must(t, os.MkdirAll(dir, 0o755)) }, ""},
		{"an earlier layout", func(dir string) {
			must(t, WriteLayout(dir, idx, "old"))
			must(t, os.WriteFile(filepath.Join(dir, "blobs", "stale"), nil, 0o644))
		}, ""},
		{"something else", func(dir string) {
			must(t, os.MkdirAll(dir, 0o755))
			must(t, os.WriteFile(filepath.Join(dir, "precious"), nil, 0o644))
		}, "not an OCI image layout"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "image")
			tt.prepare(dir)
			err := WriteLayout(dir, idx, "v1")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("WriteLayout = %v, want %q", err, tt.wantErr)
				}
				if _, err := os.Stat(filepath.Join(dir, "precious")); err != nil {
					t.Errorf("the directory's file is gone: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(dir, "blobs", "stale")); err == nil {
				t.Error("a file of the earlier layout is left")
			}
			l, err := layout.ImageIndexFromPath(dir)
			if err != nil {
				t.Fatal(err)
			}
			m, err := l.IndexManifest()
			if err != nil {
				t.Fatal(err)
			}
			if len(m.Manifests) != 1 || m.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "v1" || !m.Manifests[0].MediaType.IsIndex() {
				t.Fatalf("index.json = %+v, want one index named v1", m.Manifests)
			}
			want, _ := idx.Digest()
			if m.Manifests[0].Digest != want {
				t.Errorf("index digest %v, want %v", m.Manifests[0].Digest, want)
			}
		})
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
