package unixsock

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestListen(t *testing.T) {
	tests := []struct {
		name   string
		setup  func(t *testing.T, path string)
		wantOK bool
	}{
		{"nothing there", func(*testing.T, string) {}, true},
		{"stale socket", func(t *testing.T, p string) {
			l, err := net.Listen("unix", p)
			if err != nil {
				t.Fatal(err)
			}
			l.(*net.UnixListener).SetUnlinkOnClose(false)
			l.Close()
		}, true},
		{"live socket", func(t *testing.T, p string) {
			l, err := net.Listen("unix", p)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			go func() {
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					c.Close()
				}
			}()
		}, false},
		{"directory", func(t *testing.T, p string) {
			if err := os.Mkdir(p, 0o700); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"regular file", func(t *testing.T, p string) {
			if err := os.WriteFile(p, []byte("data"), 0o600); err != nil {
				t.Fatal(err)
			}
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "us") // short: a socket path is at most 108 bytes
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			path := filepath.Join(dir, "s.sock")
			tt.setup(t, path)
			before, _ := os.Lstat(path)
			s, err := Listen(path)
			if !tt.wantOK {
				if !errors.Is(err, ErrInUse) {
					t.Fatalf("Listen: %v, want ErrInUse", err)
				}
				after, err := os.Lstat(path)
				if err != nil || !os.SameFile(before, after) {
					t.Fatalf("what was there changed: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			s.Close()
			if _, err := os.Lstat(path); err != nil {
				t.Fatalf("Close removed the socket (Remove decides): %v", err)
			}
			if err := s.Remove(); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("socket left: %v", err)
			}
		})
	}
}

// TestRemoveLeavesAReplacement: a socket another instance put in place of
// ours (or anything else there) is left alone.
func TestRemoveLeavesAReplacement(t *testing.T) {
	dir, err := os.MkdirTemp("", "us")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "s.sock")
	s, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	// The newer instance. Another process's socket is made at least a clock
	// tick later than ours (inode numbers are reused at once, change times
	// are kept to the tick).
	time.Sleep(20 * time.Millisecond)
	other, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := s.Remove(); !errors.Is(err, ErrInUse) {
		t.Fatalf("Remove of a replaced socket: %v", err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("the newer instance's socket was removed: %v", err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := other.Remove(); !errors.Is(err, ErrInUse) {
		t.Fatalf("Remove of a directory in its place: %v", err)
	}
	if fi, err := os.Lstat(path); err != nil || !fi.IsDir() {
		t.Fatalf("the directory was removed: %v", err)
	}
}
