package debian

import (
	"bufio"
	"bytes"
	"debug/elf"
	"fmt"
	"os"
	"path"
	"sort"
	"strings"

	"github.com/poolcsi/poolcsi/hack/release/ociimage"
)

// Tool is one line of deploy/image-tools.txt: a command poolcsi runs in its container
// and the Debian package it comes from.
type Tool struct{ Path, Package string }

// ReadTools reads a tool list: "/path package" lines, # comments.
func ReadTools(file string) ([]Tool, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []Tool
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 || !strings.HasPrefix(fields[0], "/") {
			return nil, fmt.Errorf("%s: want \"/path package\", got %q", file, line)
		}
		out = append(out, Tool{Path: fields[0], Package: fields[1]})
	}
	return out, sc.Err()
}

// Arch is what an architecture's binaries look like.
type Arch struct {
	Name    string // Debian's: amd64
	Triplet string // the multiarch library directory: x86_64-linux-gnu
	Machine elf.Machine
}

// Arches are the architectures images are built for.
var Arches = map[string]Arch{
	"amd64": {"amd64", "x86_64-linux-gnu", elf.EM_X86_64},
	"arm64": {"arm64", "aarch64-linux-gnu", elf.EM_AARCH64},
}

// Source gives packages by name and their .deb files.
type Source interface {
	Package(name string) (Package, bool)
	Deb(p Package) ([]byte, error)
}

// Result is what Resolve found: the image's files and the packages they came from.
type Result struct {
	Files    []ociimage.File
	Packages []Package // sorted by name
}

// Resolve collects the tools from their packages for arch, and everything they load: the
// libraries of each ELF file's DT_NEEDED entries, searched as the dynamic loader would
// (the architecture's multiarch directory, then /usr/lib) in the tree of that
// architecture's packages, and its PT_INTERP loader. A library missing from the packages
// loaded so far is looked for in their dependencies: first the package Debian's library
// naming gives (libfoo.so.1 in libfoo1), then each dependency in breadth-first order. Each
// file lands where ldd would have named it on a Debian host (a library at its soname, the
// loader at its PT_INTERP path), with symlinks followed, plus the copyright file of every
// package that gave one.
func Resolve(a Arch, tools []Tool, src Source) (Result, error) {
	r := &resolver{arch: a, src: src, tree: NewTree(), loaded: map[string]bool{}, placed: map[string]string{}, interps: map[string]bool{}}
	// A lock's packages are all there is: load them after the tools' own, and look
	// nowhere else.
	var preload []string
	for _, tl := range tools {
		preload = append(preload, tl.Package)
	}
	if all, ok := src.(interface{ All() []string }); ok {
		preload = append(preload, all.All()...)
	}
	for _, n := range preload {
		if err := r.load(n); err != nil {
			return Result{}, err
		}
	}
	var queue []string
	for _, tl := range tools {
		if err := r.load(tl.Package); err != nil {
			return Result{}, err
		}
		p := ociimage.UsrPath(tl.Path)
		real, e, ok := r.tree.Lookup(p)
		if !ok || e.Dir {
			return Result{}, fmt.Errorf("%s: not a file of %s (%s)", tl.Path, tl.Package, a.Name)
		}
		if e.Pkg != tl.Package {
			return Result{}, fmt.Errorf("%s comes from %s for %s, deploy/image-tools.txt says %s", tl.Path, e.Pkg, a.Name, tl.Package)
		}
		r.place(p, real)
		queue = append(queue, p)
	}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		more, err := r.needs(p)
		if err != nil {
			return Result{}, err
		}
		queue = append(queue, more...)
	}
	return r.result()
}

type resolver struct {
	arch   Arch
	src    Source
	tree   *Tree
	order  []string        // packages in the order loaded
	loaded map[string]bool // by name
	placed map[string]string
	// interps are the base names of the loaders placed: a library that names the loader
	// (libc.so.6 needs ld-linux-x86-64.so.2) has it already, as ldd shows.
	interps map[string]bool
}

func (r *resolver) load(name string) error {
	if r.loaded[name] {
		return nil
	}
	p, ok := r.src.Package(name)
	if !ok {
		return fmt.Errorf("package %s (%s): not found", name, r.arch.Name)
	}
	deb, err := r.src.Deb(p)
	if err != nil {
		return err
	}
	if err := r.tree.Add(name, deb); err != nil {
		return err
	}
	r.loaded[name] = true
	r.order = append(r.order, name)
	return nil
}

// place puts the file found at real (links followed) at p in the image.
func (r *resolver) place(p, real string) { r.placed[p] = real }

// needs places what the ELF file at p loads and returns those not placed before (an
// ELF file can need more); nothing for a script or a static binary.
func (r *resolver) needs(p string) ([]string, error) {
	_, e, _ := r.tree.Lookup(r.placed[p])
	f, err := elf.NewFile(bytes.NewReader(e.Data))
	if err != nil {
		return nil, nil // not ELF: a script or a data file (mke2fs.conf)
	}
	defer func() { _ = f.Close() }() // over a bytes.Reader: nothing to flush
	if f.Machine != r.arch.Machine {
		return nil, fmt.Errorf("%s from %s is %s, not %s", p, e.Pkg, f.Machine, r.arch.Machine)
	}
	var wants []string // image paths, or bare sonames to search for
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			b := make([]byte, prog.Filesz)
			if _, err := prog.ReadAt(b, 0); err != nil {
				return nil, fmt.Errorf("%s: PT_INTERP: %w", p, err)
			}
			interp := strings.TrimRight(string(b), "\x00")
			r.interps[path.Base(interp)] = true
			wants = append(wants, interp)
		}
	}
	if rp, _ := f.DynString(elf.DT_RUNPATH); len(rp) > 0 {
		return nil, fmt.Errorf("%s has a RUNPATH (%v), which this resolver does not follow", p, rp)
	}
	if rp, _ := f.DynString(elf.DT_RPATH); len(rp) > 0 {
		return nil, fmt.Errorf("%s has an RPATH (%v), which this resolver does not follow", p, rp)
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return nil, fmt.Errorf("%s: DT_NEEDED: %w", p, err)
	}
	wants = append(wants, libs...)
	var out []string
	for _, w := range wants {
		if r.interps[w] {
			continue
		}
		dst, err := r.find(w)
		if err != nil {
			return nil, fmt.Errorf("%s (%s, from %s): %w", p, r.arch.Name, e.Pkg, err)
		}
		if dst != "" {
			out = append(out, dst)
		}
	}
	return out, nil
}

// find places the library or loader w and returns its image path, or "" when it was
// placed already.
func (r *resolver) find(w string) (string, error) {
	candidates := []string{ociimage.UsrPath(w)}
	if !strings.HasPrefix(w, "/") {
		candidates = []string{"/usr/lib/" + r.arch.Triplet + "/" + w, "/usr/lib/" + w}
	}
	lookup := func() (string, bool) {
		for _, c := range candidates {
			if _, done := r.placed[c]; done {
				return "", true
			}
			if real, e, ok := r.tree.Lookup(c); ok && !e.Dir {
				r.place(c, real)
				return c, true
			}
		}
		return "", false
	}
	if dst, ok := lookup(); ok {
		return dst, nil
	}
	deps := r.dependencies()
	soname := path.Base(w)
	if guess := sonamePackage(soname); guess != "" {
		for i, d := range deps {
			if d == guess {
				deps = append([]string{guess}, append(deps[:i:i], deps[i+1:]...)...)
				break
			}
		}
	}
	for _, d := range deps {
		if err := r.load(d); err != nil {
			return "", err
		}
		if dst, ok := lookup(); ok {
			return dst, nil
		}
	}
	return "", fmt.Errorf("%s is in none of the packages loaded (%s) nor their dependencies", w, strings.Join(r.order, " "))
}

// dependencies are the packages the loaded ones depend on, directly or not, that are not
// loaded yet, breadth first, each once; those the source does not have (virtual
// packages) are left out.
func (r *resolver) dependencies() []string {
	seen := map[string]bool{}
	var out []string
	queue := append([]string{}, r.order...)
	for _, n := range queue {
		seen[n] = true
	}
	for len(queue) > 0 {
		n := queue[0]
		queue = queue[1:]
		p, ok := r.src.Package(n)
		if !ok {
			continue
		}
		for _, d := range p.Depends {
			if seen[d] {
				continue
			}
			seen[d] = true
			if _, ok := r.src.Package(d); !ok {
				continue
			}
			queue = append(queue, d)
			if !r.loaded[d] {
				out = append(out, d)
			}
		}
	}
	return out
}

// sonamePackage is the package Debian's policy (8.1) names for a library: libfoo.so.1 in
// libfoo1, libfoo2.so.0 in libfoo2-0, with _ as -. Not every package follows it (libz.so.1
// is in zlib1g): it only orders the search.
func sonamePackage(soname string) string {
	base, ver, ok := strings.Cut(soname, ".so.")
	if !ok || ver == "" {
		return ""
	}
	name := strings.ToLower(strings.ReplaceAll(base, "_", "-"))
	if last := name[len(name)-1]; last >= '0' && last <= '9' {
		return name + "-" + ver
	}
	return name + ver
}

func (r *resolver) result() (Result, error) {
	var res Result
	used := map[string]bool{}
	for _, p := range sortedKeys(r.placed) {
		_, e, _ := r.tree.Lookup(r.placed[p])
		res.Files = append(res.Files, ociimage.File{Path: p, Data: e.Data, Mode: e.Mode})
		used[e.Pkg] = true
	}
	// The licence of each package that gave a file: Debian's copyright file, which a
	// published image of GPL tools must carry.
	for _, n := range sortedKeys(used) {
		doc := "/usr/share/doc/" + n + "/copyright"
		_, e, ok := r.tree.Lookup(doc)
		if !ok || e.Dir {
			return Result{}, fmt.Errorf("package %s (%s) has no %s", n, r.arch.Name, doc)
		}
		res.Files = append(res.Files, ociimage.File{Path: doc, Data: e.Data, Mode: 0o644})
		p, _ := r.src.Package(n)
		res.Packages = append(res.Packages, p)
	}
	return res, nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
