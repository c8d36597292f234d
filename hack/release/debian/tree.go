package debian

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"path"
	"strconv"
	"strings"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"

	"github.com/poolcsi/poolcsi/hack/release/ociimage"
)

// Tree is the files of some .deb packages, as dpkg-deb -x would lay them out, kept in
// memory and keyed by their merged-/usr path (/lib/x is /usr/lib/x).
type Tree struct{ m map[string]*Entry }

// Entry is a file, a symlink or a directory of a package.
type Entry struct {
	Pkg  string
	Orig string // the path in the package, before /usr merging: where relative links start
	Mode int64
	Data []byte
	Link string
	Dir  bool
}

// NewTree is an empty tree.
func NewTree() *Tree { return &Tree{m: map[string]*Entry{}} }

// Add unpacks a .deb's data archive into the tree; a path another package already gave
// keeps its first owner.
func (t *Tree) Add(pkg string, deb []byte) error {
	data, name, err := dataMember(deb)
	if err != nil {
		return fmt.Errorf("%s: %w", pkg, err)
	}
	var r io.Reader
	switch {
	case strings.HasSuffix(name, ".xz"):
		if r, err = xz.NewReader(bytes.NewReader(data)); err != nil {
			return fmt.Errorf("%s: %s: %w", pkg, name, err)
		}
	case strings.HasSuffix(name, ".gz"):
		if r, err = gzip.NewReader(bytes.NewReader(data)); err != nil {
			return fmt.Errorf("%s: %s: %w", pkg, name, err)
		}
	case strings.HasSuffix(name, ".zst"):
		d, err := zstd.NewReader(bytes.NewReader(data))
		if err != nil {
			return fmt.Errorf("%s: %s: %w", pkg, name, err)
		}
		defer d.Close()
		r = d
	case name == "data.tar":
		r = bytes.NewReader(data)
	default:
		return fmt.Errorf("%s: unknown data member %s", pkg, name)
	}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: %w", pkg, err)
		}
		orig := path.Clean("/" + h.Name)
		e := &Entry{Pkg: pkg, Orig: orig, Mode: h.Mode & 0o7777}
		switch h.Typeflag {
		case tar.TypeDir:
			e.Dir = true
		case tar.TypeSymlink:
			e.Link = h.Linkname
		case tar.TypeLink:
			// A hard link (mkfs.ext4 and mke2fs): the same content under a second name.
			target, ok := t.m[ociimage.UsrPath(path.Clean("/"+h.Linkname))]
			if !ok {
				return fmt.Errorf("%s: hard link %s to %s, which comes later or not at all", pkg, orig, h.Linkname)
			}
			e.Data = target.Data
		case tar.TypeReg:
			if e.Data, err = io.ReadAll(tr); err != nil {
				return fmt.Errorf("%s: %s: %w", pkg, orig, err)
			}
		default:
			continue
		}
		key := ociimage.UsrPath(orig)
		if _, ok := t.m[key]; !ok {
			t.m[key] = e
		}
	}
}

// Lookup follows symlinks from p (a merged-/usr path) to a file or directory of the tree.
func (t *Tree) Lookup(p string) (string, *Entry, bool) {
	p = ociimage.UsrPath(path.Clean(p))
	for range 40 {
		e, ok := t.m[p]
		if !ok {
			return "", nil, false
		}
		if e.Link == "" {
			return p, e, true
		}
		target := e.Link
		if !strings.HasPrefix(target, "/") {
			target = path.Join(path.Dir(e.Orig), target)
		}
		p = ociimage.UsrPath(path.Clean(target))
	}
	return "", nil, false
}

// dataMember finds data.tar.* in a .deb, an ar archive.
func dataMember(deb []byte) ([]byte, string, error) {
	const magic = "!<arch>\n"
	if !bytes.HasPrefix(deb, []byte(magic)) {
		return nil, "", fmt.Errorf("not a .deb (no ar header)")
	}
	off := len(magic)
	for off+60 <= len(deb) {
		h := deb[off : off+60]
		name := strings.TrimRight(strings.TrimSpace(string(h[0:16])), "/")
		size, err := strconv.ParseInt(strings.TrimSpace(string(h[48:58])), 10, 64)
		if err != nil || size < 0 || off+60+int(size) > len(deb) {
			return nil, "", fmt.Errorf("bad ar member header at %d", off)
		}
		body := deb[off+60 : off+60+int(size)]
		if strings.HasPrefix(name, "data.tar") {
			return body, name, nil
		}
		off += 60 + int(size) + int(size%2)
	}
	return nil, "", fmt.Errorf("no data.tar member")
}
