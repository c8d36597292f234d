package fsx

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// hostile lays out, under a fresh root, what someone who can write a shared
// pool may put where a small file is expected; each case names the entry.
type hostile struct {
	name  string
	root  bool                           // needs root (mknod)
	setup func(t *testing.T, dir string) // makes dir/f (and what it needs)
}

var hostiles = []hostile{
	{name: "link to /dev/zero", setup: func(t *testing.T, dir string) { must(t, os.Symlink("/dev/zero", filepath.Join(dir, "f"))) }},
	{name: "link to a file outside", setup: func(t *testing.T, dir string) {
		must(t, os.WriteFile(filepath.Join(dir, "..", "outside"), []byte(`{"secret":1}`), 0o600))
		must(t, os.Symlink("../outside", filepath.Join(dir, "f")))
	}},
	{name: "link in a parent component", setup: func(t *testing.T, dir string) {
		must(t, os.Mkdir(filepath.Join(dir, "..", "elsewhere"), 0o755))
		must(t, os.WriteFile(filepath.Join(dir, "..", "elsewhere", "f"), []byte("x"), 0o600))
		must(t, os.Symlink("../elsewhere", filepath.Join(dir, "sub")))
	}},
	{name: "FIFO", setup: func(t *testing.T, dir string) { must(t, unix.Mkfifo(filepath.Join(dir, "f"), 0o600)) }},
	{name: "socket-like: a directory", setup: func(t *testing.T, dir string) { must(t, os.Mkdir(filepath.Join(dir, "f"), 0o755)) }},
	{name: "100 MB sparse file", setup: func(t *testing.T, dir string) {
		f, err := os.Create(filepath.Join(dir, "f"))
		must(t, err)
		must(t, f.Truncate(100<<20))
		must(t, f.Close())
	}},
	{name: "char device /dev/zero's numbers", root: true, setup: func(t *testing.T, dir string) {
		must(t, unix.Mknod(filepath.Join(dir, "f"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 5))))
	}},
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// within fails the test if f does not return within a few seconds: a FIFO
// opened for reading blocks forever.
func within(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s did not return within 5 s", what)
	}
}

// TestHostileFilesAreRefused: every reader refuses each hostile entry with
// ErrUnsafe (a missing file stays fs.ErrNotExist), never blocks, never follows
// a link, and never reads more than its cap.
func TestHostileFilesAreRefused(t *testing.T) {
	for _, h := range hostiles {
		t.Run(h.name, func(t *testing.T) {
			if h.root {
				testutil.RequireRoot(t)
			}
			base := t.TempDir()
			root := filepath.Join(base, "root")
			must(t, os.Mkdir(root, 0o755))
			h.setup(t, root)
			rel := "f"
			if h.name == "link in a parent component" {
				rel = "sub/f"
			}
			within(t, "ReadFile", func() {
				if _, err := ReadFile(root, rel, 4096); !errors.Is(err, ErrUnsafe) {
					t.Errorf("ReadFile: %v, want ErrUnsafe", err)
				}
			})
			within(t, "OpenRegular O_RDWR|O_CREAT", func() {
				f, err := OpenRegular(root, rel, unix.O_RDWR|unix.O_CREAT, 0o600)
				if h.name == "100 MB sparse file" { // a regular file: fine to open, only reads are capped
					if err != nil {
						t.Errorf("OpenRegular of a large regular file: %v", err)
					}
					f.Close()
					return
				}
				if !errors.Is(err, ErrUnsafe) {
					if f != nil {
						f.Close()
					}
					t.Errorf("OpenRegular: %v, want ErrUnsafe", err)
				}
			})
			within(t, "WriteFileAtomic", func() {
				err := WriteFileAtomic(root, rel, []byte("new"), true)
				if h.name == "link in a parent component" && !errors.Is(err, ErrUnsafe) {
					t.Errorf("WriteFileAtomic through a linked directory: %v, want ErrUnsafe", err)
				}
			})
			within(t, "WriteDerivedFile", func() {
				err := WriteDerivedFile(root, rel, []byte("new"))
				if h.name == "link in a parent component" && !errors.Is(err, ErrUnsafe) {
					t.Errorf("WriteDerivedFile through a linked directory: %v, want ErrUnsafe", err)
				}
			})
			// Nothing outside the root was written.
			if b, err := os.ReadFile(filepath.Join(base, "outside")); err == nil && string(b) != `{"secret":1}` {
				t.Errorf("the file outside the root changed: %q", b)
			}
			if b, err := os.ReadFile(filepath.Join(base, "elsewhere", "f")); err == nil && string(b) != "x" {
				t.Errorf("the file behind the linked directory changed: %q", b)
			}
		})
	}
}

func TestReadFile(t *testing.T) {
	root := t.TempDir()
	must(t, os.WriteFile(filepath.Join(root, "ok"), []byte("hello"), 0o600))
	if b, err := ReadFile(root, "ok", 5); err != nil || string(b) != "hello" {
		t.Fatalf("ReadFile at its cap: %q, %v", b, err)
	}
	if _, err := ReadFile(root, "ok", 4); !errors.Is(err, ErrUnsafe) {
		t.Fatalf("ReadFile over its cap: %v", err)
	}
	if _, err := ReadFile(root, "missing", 4); !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrUnsafe) {
		t.Fatalf("ReadFile of a missing file: %v, want fs.ErrNotExist", err)
	}
	if _, err := ReadFile(root, "../etc/passwd", 1<<20); !errors.Is(err, ErrUnsafe) {
		t.Fatalf("ReadFile of ../: %v, want ErrUnsafe", err)
	}
}

func TestWriteFileAtomic(t *testing.T) {
	root := t.TempDir()
	must(t, os.Mkdir(filepath.Join(root, "d"), 0o755))
	for i, data := range []string{"one", "two", "derived"} {
		write := func() error { return WriteFileAtomic(root, "d/f", []byte(data), i == 0) }
		if data == "derived" {
			write = func() error { return WriteDerivedFile(root, "d/f", []byte(data)) }
		}
		if err := write(); err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(filepath.Join(root, "d", "f")); string(b) != data {
			t.Fatalf("after writing %q: %q", data, b)
		}
	}
	// A crash's temp file is swept once stale, a fresh one (another writer's) kept.
	stale := filepath.Join(root, "d", ".f.tmp-0000")
	fresh := filepath.Join(root, "d", ".f.tmp-1111")
	must(t, os.WriteFile(stale, nil, 0o600))
	must(t, os.WriteFile(fresh, nil, 0o600))
	old := time.Now().Add(-2 * StaleTemp)
	must(t, os.Chtimes(stale, old, old))
	must(t, WriteFileAtomic(root, "d/f", []byte("three"), false))
	if _, err := os.Stat(stale); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stale temp file kept: %v", err)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Errorf("fresh temp file removed: %v", err)
	}
	entries, _ := os.ReadDir(filepath.Join(root, "d"))
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if len(names) != 2 {
		t.Errorf("directory holds %v", names)
	}
}

func TestOpenRegularCreates(t *testing.T) {
	root := t.TempDir()
	f, err := OpenRegular(root, "lock", unix.O_RDWR|unix.O_CREAT, 0o600)
	must(t, err)
	_, err = f.Write([]byte("held"))
	must(t, err)
	f.Close()
	f, err = OpenRegular(root, "lock", unix.O_RDWR|unix.O_CREAT, 0o600)
	must(t, err)
	b := make([]byte, 8)
	n, _ := f.ReadAt(b, 0)
	f.Close()
	if !bytes.Equal(b[:n], []byte("held")) {
		t.Fatalf("reopened lock holds %q", b[:n])
	}
}
