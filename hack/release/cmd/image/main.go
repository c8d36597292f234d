// Command image writes poolcsi's multi-platform image as an OCI image layout (make image),
// downloads the pinned Debian packages it is made of (make image-debs), or pins them again
// from the archive's current indexes (make image-lock). No Docker engine, no registry, no
// apt: Debian's archive is read over HTTPS. Flags and wiring only: package imagebuild
// builds, package debian reads the archive.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/poolcsi/poolcsi/hack/release/debian"
	"github.com/poolcsi/poolcsi/hack/release/imagebuild"
)

func main() {
	root := repoRoot()
	var (
		arches     = flag.String("arches", "amd64,arm64", "architectures, comma separated")
		binDir     = flag.String("bin-dir", filepath.Join(root, "_output", "bin"), "holds linux-<arch>/poolcsi, the static binaries")
		out        = flag.String("out", filepath.Join(root, "_output", "image"), "the OCI image layout to write (replaced)")
		cacheDir   = flag.String("cache", filepath.Join(root, ".cache", "image-debs"), "downloaded .deb files")
		lockFile   = flag.String("lock", filepath.Join(root, "deploy", "image-packages.lock"), "the pinned Debian packages")
		toolsFile  = flag.String("tools", filepath.Join(root, "deploy", "image-tools.txt"), "the tools the image carries")
		ref        = flag.String("ref", "latest", "the layout's name for the index (org.opencontainers.image.ref.name); make image gives the version")
		version    = flag.String("version", "", "annotation org.opencontainers.image.version")
		revision   = flag.String("revision", "", "annotation org.opencontainers.image.revision")
		updateLock = flag.Bool("update-lock", false, "resolve from the archive's current indexes and rewrite the lock; build nothing")
		fetchOnly  = flag.Bool("fetch-only", false, "download the locked packages into the cache; build nothing")
		keyring    = flag.String("keyring", debian.Keyring, "the OpenPGP keyring -update-lock checks the archive's InRelease signatures with (gpgv)")
	)
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("image: ")
	ctx := context.Background()
	start := time.Now()
	tools, err := debian.ReadTools(*toolsFile)
	if err != nil {
		log.Fatal(err)
	}
	cache := debian.Cache{Dir: *cacheDir, Logf: log.Printf}
	archList := strings.Split(*arches, ",")

	switch {
	case *updateLock:
		var pinned []debian.Package
		for _, name := range archList {
			a, ok := debian.Arches[name]
			if !ok {
				log.Fatalf("architecture %q: want one of amd64, arm64", name)
			}
			log.Printf("%s: reading the bookworm indexes", name)
			idx, err := debian.FetchIndex(ctx, name, debian.Bookworm, debian.Verifier{Keyring: *keyring})
			if err != nil {
				log.Fatal(err)
			}
			res, err := debian.Resolve(a, tools, debian.IndexSource{Ctx: ctx, Index: idx, Cache: cache})
			if err != nil {
				log.Fatal(err)
			}
			pinned = append(pinned, res.Packages...)
		}
		if err := debian.WriteLock(*lockFile, pinned); err != nil {
			log.Fatal(err)
		}
		log.Printf("pinned %d packages in %s (%s)", len(pinned), *lockFile, time.Since(start).Round(time.Second))
		return
	case *fetchOnly:
		lock, err := debian.ReadLock(*lockFile)
		if err != nil {
			log.Fatal(err)
		}
		for _, p := range lock {
			if _, err := cache.Deb(ctx, p); err != nil {
				log.Fatal(err)
			}
		}
		log.Printf("%d pinned packages in %s (%s)", len(lock), *cacheDir, time.Since(start).Round(time.Second))
		return
	}

	lock, err := debian.ReadLock(*lockFile)
	if err != nil {
		log.Fatal(err)
	}
	platforms, err := imagebuild.Build(imagebuild.Options{
		Tools:  tools,
		Arches: archList,
		Binary: func(arch string) string { return filepath.Join(*binDir, "linux-"+arch, "poolcsi") },
		Source: func(a debian.Arch) (debian.Source, error) {
			return debian.NewLockSource(ctx, lock, a.Name, cache), nil
		},
	})
	if err != nil {
		// The lock holds the packages the tools needed when it was written, nothing more.
		log.Fatalf("%v\n(after a change to %s, make image-lock pins the packages the tools now need)", err, *toolsFile)
	}
	annotations := map[string]string{"org.opencontainers.image.source": "https://github.com/poolcsi/poolcsi"}
	if *version != "" {
		annotations["org.opencontainers.image.version"] = *version
	}
	if *revision != "" {
		annotations["org.opencontainers.image.revision"] = *revision
	}
	idx := imagebuild.Index(platforms, annotations)
	if err := imagebuild.WriteLayout(*out, idx, *ref); err != nil {
		log.Fatal(err)
	}
	for _, p := range platforms {
		size, err := compressedSize(p)
		if err != nil {
			log.Fatal(err)
		}
		d, _ := p.Image.Digest()
		log.Printf("linux/%s: %s, %d files, %.1f MB compressed (%d Debian packages)", p.Arch, d, len(p.Files), float64(size)/1e6, len(p.Packages))
	}
	d, _ := idx.Digest()
	fmt.Printf("wrote %s: OCI image index %s (%s) in %s\npush: skopeo copy --all oci:%s docker://REGISTRY/poolcsi:%s\n",
		*out, d, *ref, time.Since(start).Round(100*time.Millisecond), *out, *ref)
}

// compressedSize is what a registry stores and a node pulls for the platform: its layers
// and config as written.
func compressedSize(p imagebuild.Platform) (int64, error) {
	m, err := p.Image.Manifest()
	if err != nil {
		return 0, err
	}
	n := m.Config.Size
	for _, l := range m.Layers {
		n += l.Size
	}
	return n, nil
}

// repoRoot is the repository this command's source lies in (hack/release/cmd/image).
func repoRoot() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		fmt.Fprintln(os.Stderr, "image: cannot find the repository")
		os.Exit(2)
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", "..", ".."))
}
