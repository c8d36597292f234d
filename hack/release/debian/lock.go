package debian

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// A lock pins the exact .deb files an image is built from, one line per architecture and
// package: make image builds from it (the same bytes every time, checked by SHA256, from
// the cache once fetched) and reads no index; make image-lock writes it again from the
// archive's current indexes.
const lockHeader = `# The Debian packages make image builds from, pinned: architecture, package, version,
# SHA256, size, URL. Written by make image-lock (hack/release/cmd/image -update-lock) from the
# bookworm, bookworm-updates and bookworm-security indexes; do not edit by hand. A point
# release removes superseded versions from deb.debian.org: make image then fails on a 404,
# and make image-lock moves the lock to the current versions (review the diff).
`

// ReadLock reads a lock file.
func ReadLock(file string) ([]Package, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []Package
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 6 {
			return nil, fmt.Errorf("%s: want 6 fields, got %q", file, line)
		}
		size, err := strconv.ParseInt(f[4], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%s: size in %q: %w", file, line, err)
		}
		out = append(out, Package{Arch: f[0], Name: f[1], Version: f[2], SHA256: f[3], Size: size, URL: f[5]})
	}
	return out, sc.Err()
}

// WriteLock writes pkgs as a lock file, sorted by architecture and name.
func WriteLock(file string, pkgs []Package) error {
	pkgs = append([]Package{}, pkgs...)
	sort.Slice(pkgs, func(i, j int) bool {
		if pkgs[i].Arch != pkgs[j].Arch {
			return pkgs[i].Arch < pkgs[j].Arch
		}
		return pkgs[i].Name < pkgs[j].Name
	})
	var b strings.Builder
	b.WriteString(lockHeader)
	for _, p := range pkgs {
		fmt.Fprintf(&b, "%s %s %s %s %d %s\n", p.Arch, p.Name, p.Version, p.SHA256, p.Size, p.URL)
	}
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, []byte(b.String()), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, file)
}

// ErrNotCached is an Offline cache's answer for a .deb it does not hold.
var ErrNotCached = errors.New("not in the cache")

// Cache keeps downloaded .deb files in a directory, named as in the archive; every read
// checks the SHA256 the index or lock gives.
type Cache struct {
	Dir string
	// Offline refuses to download (the tests: they read what make image-debs fetched).
	Offline bool
	Logf    func(string, ...any)
}

// Deb is p's .deb, from the cache or, unless Offline, downloaded into it.
func (c Cache) Deb(ctx context.Context, p Package) ([]byte, error) {
	file := filepath.Join(c.Dir, path.Base(p.URL))
	if b, err := os.ReadFile(file); err == nil && sum(b) == p.SHA256 {
		return b, nil
	}
	if c.Offline {
		return nil, fmt.Errorf("%s (%s %s) is %w %s: make image-debs downloads the pinned packages from deb.debian.org", path.Base(p.URL), p.Name, p.Arch, ErrNotCached, c.Dir)
	}
	if c.Logf != nil {
		c.Logf("downloading %s (%d kB)", p.URL, p.Size/1000)
	}
	b, err := get(ctx, p.URL)
	if IsNotFound(err) {
		return nil, fmt.Errorf("%w: the pinned %s %s is no longer in the archive; run make image-lock to pin the current versions", err, p.Name, p.Version)
	}
	if err != nil {
		return nil, err
	}
	if got := sum(b); got != p.SHA256 {
		return nil, fmt.Errorf("%s: sha256 %s, want %s", p.URL, got, p.SHA256)
	}
	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return nil, err
	}
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return nil, err
	}
	return b, os.Rename(tmp, file)
}

// IndexSource resolves against an archive index, downloading what it loads.
type IndexSource struct {
	Ctx   context.Context
	Index map[string]Package
	Cache Cache
}

func (s IndexSource) Package(name string) (Package, bool) { p, ok := s.Index[name]; return p, ok }
func (s IndexSource) Deb(p Package) ([]byte, error)       { return s.Cache.Deb(s.Ctx, p) }

// LockSource has only the locked packages of one architecture: resolving against it
// loads no other package, so a lock that no longer covers what the tools load fails.
type LockSource struct {
	Ctx   context.Context
	Pkgs  map[string]Package
	Cache Cache
}

// NewLockSource is the lock's packages of arch.
func NewLockSource(ctx context.Context, lock []Package, arch string, c Cache) LockSource {
	m := map[string]Package{}
	for _, p := range lock {
		if p.Arch == arch {
			m[p.Name] = p
		}
	}
	return LockSource{Ctx: ctx, Pkgs: m, Cache: c}
}

func (s LockSource) Package(name string) (Package, bool) { p, ok := s.Pkgs[name]; return p, ok }
func (s LockSource) Deb(p Package) ([]byte, error)       { return s.Cache.Deb(s.Ctx, p) }

// All is every locked package of the architecture, by name.
func (s LockSource) All() []string { return sortedKeys(s.Pkgs) }
