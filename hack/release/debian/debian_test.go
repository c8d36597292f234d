package debian

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParsePackages(t *testing.T) {
	const index = `Package: mount
Version: 2.38.1-5+deb12u3
Architecture: arm64
Pre-Depends: libblkid1 (>= 2.17.2), libc6 (>= 2.34)
Depends: util-linux (= 2.38.1-5+deb12u3), debconf (>= 0.5) | debconf-2.0
Description: tools for mounting
 a continued line: Depends: not-a-dependency
Filename: pool/main/u/util-linux/mount_2.38.1-5+deb12u3_arm64.deb
Size: 133000
SHA256: abc

Package: libc6
Version: 2.36-9+deb12u14
Architecture: arm64
Depends: libgcc-s1:any
Filename: pool/main/g/glibc/libc6_2.36-9+deb12u14_arm64.deb
Size: 1
SHA256: def
`
	got, err := ParsePackages(strings.NewReader(index), "https://deb.debian.org/debian")
	if err != nil {
		t.Fatal(err)
	}
	want := []Package{
		{Name: "mount", Version: "2.38.1-5+deb12u3", Arch: "arm64", Size: 133000, SHA256: "abc",
			URL:     "https://deb.debian.org/debian/pool/main/u/util-linux/mount_2.38.1-5+deb12u3_arm64.deb",
			Depends: []string{"libblkid1", "libc6", "util-linux", "debconf", "debconf-2.0"}},
		{Name: "libc6", Version: "2.36-9+deb12u14", Arch: "arm64", Size: 1, SHA256: "def",
			URL:     "https://deb.debian.org/debian/pool/main/g/glibc/libc6_2.36-9+deb12u14_arm64.deb",
			Depends: []string{"libgcc-s1"}},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("ParsePackages =\n%+v\nwant\n%+v", got, want)
	}
}

func TestParseRelease(t *testing.T) {
	const release = `Origin: Debian
Codename: bookworm
Date: Sat, 11 Jul 2026 10:16:37 UTC
MD5Sum:
 0123 50060337 main/binary-arm64/Packages.xz
SHA256:
 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa 50060337 main/binary-amd64/Packages.xz
 bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb 8689464 main/binary-arm64/Packages.xz
`
	rel, err := parseRelease([]byte(release))
	must(t, err)
	if got := rel.SHA256["main/binary-arm64/Packages.xz"]; got.SHA256[0] != 'b' || got.Size != 8689464 { // the SHA256 line, not the MD5 one
		t.Errorf("arm64: %+v", got)
	}
	if _, ok := rel.SHA256["main/binary-riscv64/Packages.xz"]; ok || rel.Codename != "bookworm" ||
		!rel.Date.Equal(time.Date(2026, 7, 11, 10, 16, 37, 0, time.UTC)) || !rel.ValidUntil.IsZero() {
		t.Errorf("parseRelease = %+v", rel)
	}
	// Anything a reader would have to choose between is refused.
	for name, bad := range map[string]string{
		"a second SHA256 list": release + "SHA256:\n aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa 1 x\n",
		"a file listed twice":  release + " cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc 1 main/binary-amd64/Packages.xz\n",
		"a second paragraph":   release + "\nSHA256:\n",
		"a bad sum":            release + " abc 1 x\n",
		"a bad date":           strings.Replace(release, "UTC", "EST", 1),
		"a field twice":        release + "codename: bookworm-updates\n",
	} {
		if _, err := parseRelease([]byte(bad)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestParseReleaseDate(t *testing.T) {
	want := time.Date(2026, 7, 1, 10, 16, 37, 0, time.UTC)
	for _, s := range []string{"Wed, 01 Jul 2026 10:16:37 UTC", "Wed, 1 Jul 2026 10:16:37 UTC", "Wed, 01 Jul 2026 10:16:37 GMT",
		"Wed, 01 Jul 2026 10:16:37 +0000", "Wed, 01 Jul 2026 12:16:37 +0200"} {
		if got, err := parseReleaseDate(s); err != nil || !got.Equal(want) {
			t.Errorf("parseReleaseDate(%q) = %v, %v; want %v", s, got, err, want)
		}
	}
	for _, s := range []string{"", "Wed, 01 Jul 2026 10:16:37 EST", "Wed, 01 Jul 2026 10:16:37", "2026-07-01T10:16:37Z", "Wed, 01 Jul 2026 10:16:37 UTC junk"} {
		if got, err := parseReleaseDate(s); err == nil {
			t.Errorf("parseReleaseDate(%q) = %v, want an error", s, got)
		}
	}
}

func TestSonamePackage(t *testing.T) {
	for soname, want := range map[string]string{
		"libc.so.6":            "libc6",
		"libcom_err.so.2":      "libcom-err2",
		"liblzo2.so.2":         "liblzo2-2",
		"libpcre2-8.so.0":      "libpcre2-8-0",
		"libz.so.1":            "libz1", // zlib1g: found through the dependencies instead
		"ld-linux-x86-64.so.2": "ld-linux-x86-64-2",
		"libfoo.so":            "",
	} {
		if got := sonamePackage(soname); got != want {
			t.Errorf("sonamePackage(%s) = %q, want %q", soname, got, want)
		}
	}
}

// fakeDeb is a .deb (an ar archive) whose data.tar.gz holds files: "path" = content,
// "path -> target" a symlink.
func fakeDeb(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var data bytes.Buffer
	gz := gzip.NewWriter(&data)
	tw := tar.NewWriter(gz)
	var names []string
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		if p, target, ok := strings.Cut(n, " -> "); ok {
			must(t, tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "." + p, Linkname: target}))
			continue
		}
		must(t, tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "." + n, Size: int64(len(files[n])), Mode: 0o755}))
		_, err := tw.Write([]byte(files[n]))
		must(t, err)
	}
	must(t, tw.Close())
	must(t, gz.Close())
	var deb bytes.Buffer
	deb.WriteString("!<arch>\n")
	for _, m := range []struct {
		name string
		body []byte
	}{{"debian-binary", []byte("2.0\n")}, {"control.tar.gz", nil}, {"data.tar.gz", data.Bytes()}} {
		fmt.Fprintf(&deb, "%-16s%-12s%-6s%-6s%-8s%-10d`\n", m.name, "0", "0", "0", "100644", len(m.body))
		deb.Write(m.body)
		if len(m.body)%2 == 1 {
			deb.WriteByte('\n')
		}
	}
	return deb.Bytes()
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// Links resolve as dpkg would lay them out, under merged /usr: relative ones from the
// link's own directory in the package, absolute ones from the root.
func TestTreeLookup(t *testing.T) {
	tr := NewTree()
	must(t, tr.Add("libc6", fakeDeb(t, map[string]string{
		"/lib/x86_64-linux-gnu/libc.so.6":                                           "libc",
		"/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2":                                "ld",
		"/lib64/ld-linux-x86-64.so.2 -> /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2": "",
		"/usr/lib/x86_64-linux-gnu/libz.so.1 -> libz.so.1.2.13":                     "",
		"/usr/lib/x86_64-linux-gnu/libz.so.1.2.13":                                  "zlib",
		"/lib/loop -> loop": "",
	})))
	for _, tt := range []struct{ path, wantPath, wantData string }{
		{"/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "libc"},
		{"/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "libc"},
		{"/lib64/ld-linux-x86-64.so.2", "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "ld"},
		{"/usr/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1.2.13", "zlib"},
		{"/lib/loop", "", ""}, // a loop ends
		{"/lib/missing", "", ""},
	} {
		p, e, ok := tr.Lookup(tt.path)
		if !ok {
			if tt.wantPath != "" {
				t.Errorf("Lookup(%s): not found", tt.path)
			}
			continue
		}
		if p != tt.wantPath || string(e.Data) != tt.wantData || e.Pkg != "libc6" {
			t.Errorf("Lookup(%s) = %s %q %s, want %s %q", tt.path, p, e.Data, e.Pkg, tt.wantPath, tt.wantData)
		}
	}
}

// fakeSource packs its packages' files into .debs when asked.
type fakeSource struct {
	t    *testing.T
	pkgs map[string]fakePkg
}

type fakePkg struct {
	deps  []string
	files map[string]string
}

func (s fakeSource) Package(name string) (Package, bool) {
	p, ok := s.pkgs[name]
	return Package{Name: name, Depends: p.deps}, ok
}

func (s fakeSource) Deb(p Package) ([]byte, error) { return fakeDeb(s.t, s.pkgs[p.Name].files), nil }

// Resolve, on this machine's own binaries packed as packages: the tool, its libraries
// found through the dependencies (libz.so.1 in zlib1g, not in "libz1"), the loader once,
// at its PT_INTERP path, and the copyright files; a binary of another architecture is
// refused.
func TestResolve(t *testing.T) {
	const tool, libc, ld = "/usr/bin/true", "/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
	read := map[string]string{}
	for _, p := range []string{tool, libc, ld} {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Skipf("needs this machine's %s (an amd64 Debian machine): %v", p, err)
		}
		read[p] = string(b)
	}
	src := fakeSource{t: t, pkgs: map[string]fakePkg{
		"coreutils": {deps: []string{"libunrelated", "libc6"}, files: map[string]string{
			"/bin/true": read[tool], "/usr/share/doc/coreutils/copyright": "GPL",
		}},
		"libunrelated": {files: map[string]string{"/usr/lib/x86_64-linux-gnu/libother.so.1": "x"}},
		"libc6": {files: map[string]string{
			libc: read[libc], ld: read[ld],
			"/lib64/ld-linux-x86-64.so.2 -> /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2": "",
			"/usr/share/doc/libc6/copyright":                                            "LGPL",
		}},
	}}
	res, err := Resolve(Arches["amd64"], []Tool{{"/usr/bin/true", "coreutils"}}, src)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, f := range res.Files {
		got = append(got, f.Path)
	}
	want := []string{"/usr/bin/true", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/ld-linux-x86-64.so.2",
		"/usr/share/doc/coreutils/copyright", "/usr/share/doc/libc6/copyright"}
	if !slices.Equal(got, want) {
		t.Errorf("files %v, want %v", got, want)
	}
	var pkgs []string
	for _, p := range res.Packages {
		pkgs = append(pkgs, p.Name)
	}
	if !slices.Equal(pkgs, []string{"coreutils", "libc6"}) {
		t.Errorf("packages %v, want coreutils and libc6 (not the unrelated one it looked in)", pkgs)
	}

	// The tool from the wrong package, and the wrong architecture.
	if _, err := Resolve(Arches["amd64"], []Tool{{"/usr/bin/true", "libc6"}}, src); err == nil {
		t.Error("a tool that is not in its package was accepted")
	}
	if _, err := Resolve(Arches["arm64"], []Tool{{"/usr/bin/true", "coreutils"}}, src); err == nil || !strings.Contains(err.Error(), "EM_X86_64") {
		t.Errorf("an amd64 binary in the arm64 image: %v", err)
	}
}
