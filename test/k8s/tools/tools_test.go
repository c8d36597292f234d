package tools

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/sys/unix"
)

// A second builder (cmd/prebuild beside the tests) that finds the cache entry locked waits,
// and takes the first one's binary instead of building it again.
func TestBuildWaitsForAnotherBuilder(t *testing.T) {
	t.Setenv("POOLCSI_K8S_CACHE", t.TempDir())
	// No module a build could fetch: a build attempt fails instead of passing unseen.
	tl := Tool{Name: "nothing", Module: "poolcsi.test/none", Version: "v0.0.0", Package: "."}
	dir := tl.cacheEntry()
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}

	type result struct {
		bin  string
		took time.Duration
		err  error
	}
	done := make(chan result, 1)
	go func() {
		bin, took, err := tl.Build(t.Context())
		done <- result{bin, took, err}
	}()
	select {
	case r := <-done:
		t.Fatalf("Build returned while another builder held the lock: %+v", r)
	case <-time.After(200 * time.Millisecond):
	}

	// The other builder finishes: its binary appears, then its lock goes.
	bin := filepath.Join(dir, tl.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, []byte("#!/bin/true\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := lock.Close(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.bin != bin || r.took != 0 {
		t.Fatalf("Build after the other builder = %q, %v, %v; want %q, 0, nil", r.bin, r.took, r.err, bin)
	}
}

// Where the sidecars pin one module at different versions, the group builds with the
// highest pin, and never below what one of them requires (a pin below a requirement would
// downgrade that sidecar's dependency).
func TestMergePins(t *testing.T) {
	parse := func(text string) *modfile.File {
		f, err := modfile.Parse("go.mod", []byte(text), nil)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	a := parse("module a\nrequire k8s.io/api v0.36.1\nreplace k8s.io/api => k8s.io/api v0.36.1\nreplace k8s.io/kms => k8s.io/kms v0.36.1\n")
	b := parse("module b\nrequire k8s.io/api v0.37.0\nreplace k8s.io/api => k8s.io/api v0.37.0\n")
	c := parse("module c\nrequire (\n\tk8s.io/api v0.37.1\n\tk8s.io/kms v0.35.0\n)\n")
	got := mergePins([]*modfile.File{a, b, c}, []func(*modfile.File) [][2]string{ownReplaces, ownReplaces, ownReplaces})
	want := map[string]string{"k8s.io/api": "v0.37.1", "k8s.io/kms": "v0.36.1"}
	if !maps.Equal(got, want) {
		t.Fatalf("mergePins = %v, want %v", got, want)
	}
}

// A group's members share one lock and are cached apart from a build of the same tool
// alone; a tool without a group keeps its own entry.
func TestGroupCacheEntries(t *testing.T) {
	t.Setenv("POOLCSI_K8S_CACHE", t.TempDir())
	if Attacher.lockPath() != Resizer.lockPath() {
		t.Errorf("the attacher and the resizer lock %q and %q; one group, one lock", Attacher.lockPath(), Resizer.lockPath())
	}
	alone := Attacher
	alone.Group = ""
	if alone.cacheEntry() == Attacher.cacheEntry() {
		t.Errorf("the grouped attacher is cached where one built alone is: %s", Attacher.cacheEntry())
	}
	var names []string
	for _, m := range Attacher.members() {
		names = append(names, m.Name)
	}
	if want := []string{"csi-attacher", "csi-resizer", "csi-snapshotter", "snapshot-controller"}; !slices.Equal(names, want) {
		t.Errorf("members = %v, want %v", names, want)
	}
	for _, tl := range []Tool{Etcd, Provisioner} {
		if m := tl.members(); len(m) != 1 || m[0].Name != tl.Name || tl.lockPath() != tl.cacheEntry()+".lock" {
			t.Errorf("%s: members %v, lock %s", tl.Name, m, tl.lockPath())
		}
	}
}
