// Package debian reads Debian's archive without apt or dpkg: the Packages index of a
// suite and architecture, .deb files, and the shared libraries an ELF binary loads, so that
// `make image` can take each platform's tools from Debian packages of that architecture on
// any machine, without changing the machine's dpkg architectures.
package debian

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/ulikunitz/xz"
)

// Suite is one apt source: an archive and a distribution in it.
type Suite struct{ Archive, Dist string }

// Bookworm is what debian:bookworm-slim's apt sources name (the Dockerfile's route); as
// apt does, the newest version of a package in any of them wins.
var Bookworm = []Suite{
	{"https://deb.debian.org/debian-security", "bookworm-security"},
	{"https://deb.debian.org/debian", "bookworm-updates"},
	{"https://deb.debian.org/debian", "bookworm"},
}

// Package is one binary package of an index.
type Package struct {
	Name, Version, Arch string
	URL                 string // of the .deb
	SHA256              string
	Size                int64
	Depends             []string // Pre-Depends and Depends, every alternative, in order
}

// FetchIndex reads the main component's Packages of every suite for arch and merges them,
// the newest version of each package winning (a point release can put a newer version in
// bookworm than bookworm-security still carries). Each InRelease is checked by v (a good
// signature, current), and each Packages file against the SHA256 the signed text lists.
func FetchIndex(ctx context.Context, arch string, suites []Suite, v Verifier) (map[string]Package, error) {
	out := map[string]Package{}
	for _, s := range suites {
		base := s.Archive + "/dists/" + s.Dist
		release, err := get(ctx, base+"/InRelease")
		if err != nil {
			return nil, err
		}
		rel, err := v.Verify(ctx, release, s.Dist)
		if err != nil {
			return nil, fmt.Errorf("%s/InRelease: %w", base, err)
		}
		member := "main/binary-" + arch + "/Packages.xz"
		want, ok := rel.SHA256[member]
		if !ok {
			return nil, fmt.Errorf("%s/InRelease: no SHA256 for %s", base, member)
		}
		compressed, err := get(ctx, base+"/"+member)
		if err != nil {
			return nil, err
		}
		if got := sum(compressed); got != want.SHA256 || int64(len(compressed)) != want.Size {
			return nil, fmt.Errorf("%s/%s: sha256 %s, %d bytes; the signed InRelease says %s, %d bytes", base, member, got, len(compressed), want.SHA256, want.Size)
		}
		r, err := xz.NewReader(bytes.NewReader(compressed))
		if err != nil {
			return nil, fmt.Errorf("%s/%s: %w", base, member, err)
		}
		pkgs, err := ParsePackages(r, s.Archive)
		if err != nil {
			return nil, fmt.Errorf("%s/%s: %w", base, member, err)
		}
		for _, p := range pkgs {
			if old, ok := out[p.Name]; !ok || CompareVersions(p.Version, old.Version) > 0 {
				out[p.Name] = p
			}
		}
	}
	return out, nil
}

// ParsePackages reads a Packages file; archive is the base URL its Filename fields are
// relative to.
func ParsePackages(r io.Reader, archive string) ([]Package, error) {
	var out []Package
	var p Package
	flush := func() {
		if p.Name != "" {
			out = append(out, p)
		}
		p = Package{}
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			flush()
			continue
		}
		if line[0] == ' ' || line[0] == '\t' {
			continue // a continued field (Description)
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Package":
			p.Name = v
		case "Version":
			p.Version = v
		case "Architecture":
			p.Arch = v
		case "Filename":
			p.URL = archive + "/" + v
		case "SHA256":
			p.SHA256 = v
		case "Size":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("package %s: size %q: %w", p.Name, v, err)
			}
			p.Size = n
		case "Depends", "Pre-Depends":
			p.Depends = append(p.Depends, dependencyNames(v)...)
		}
	}
	flush()
	return out, sc.Err()
}

// dependencyNames are the package names of a Depends field, every alternative, without
// versions or architecture qualifiers: "libc6 (>= 2.34), debconf | debconf-2.0" gives
// libc6, debconf, debconf-2.0.
func dependencyNames(field string) []string {
	var out []string
	for _, dep := range strings.Split(field, ",") {
		for _, alt := range strings.Split(dep, "|") {
			name := strings.Fields(alt)
			if len(name) == 0 {
				continue
			}
			n, _, _ := strings.Cut(name[0], ":")
			out = append(out, n)
		}
	}
	return out
}

func get(ctx context.Context, url string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %w", url, &statusError{resp.StatusCode})
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	return b, nil
}

type statusError struct{ code int }

func (e *statusError) Error() string { return "HTTP " + strconv.Itoa(e.code) }

// IsNotFound says whether err is a 404 from the archive: a locked version that a point
// release has since removed from deb.debian.org.
func IsNotFound(err error) bool {
	var se *statusError
	return errors.As(err, &se) && se.code == http.StatusNotFound
}

func sum(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}
