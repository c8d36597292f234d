package nodestate

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

type rec struct {
	Dev   uint64 `json:"dev"`
	Inode uint64 `json:"inode"`
}

func TestStore(t *testing.T) {
	for _, tc := range []struct {
		name string
		dir  func(t *testing.T) string
	}{
		{"memory", func(*testing.T) string { return "" }},
		{"disk", func(t *testing.T) string { return t.TempDir() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.dir(t)
			s, err := Open(dir, "node-1")
			if err != nil {
				t.Fatal(err)
			}
			var got rec
			if ok, err := s.Get("stages", "v1", &got); ok || err != nil {
				t.Fatalf("Get of nothing = %v, %v", ok, err)
			}
			if err := s.Put("stages", "v1", rec{1, 2}); err != nil {
				t.Fatal(err)
			}
			if err := s.Put("stages", "v0", rec{3, 4}); err != nil {
				t.Fatal(err)
			}
			if ok, err := s.Get("stages", "v1", &got); !ok || err != nil || got != (rec{1, 2}) {
				t.Fatalf("Get = %v, %v, %+v", ok, err, got)
			}
			if keys, err := s.Keys("stages"); err != nil || !reflect.DeepEqual(keys, []string{"v0", "v1"}) {
				t.Fatalf("Keys = %v, %v", keys, err)
			}
			if err := s.Delete("stages", "v1"); err != nil {
				t.Fatal(err)
			}
			if err := s.Delete("stages", "v1"); err != nil {
				t.Fatalf("second Delete: %v", err)
			}
			if keys, err := s.Keys("stages"); err != nil || !reflect.DeepEqual(keys, []string{"v0"}) {
				t.Fatalf("Keys after Delete = %v, %v", keys, err)
			}
			if dir == "" {
				return
			}
			// A restarted plugin reads what the last one wrote.
			s2, err := Open(dir, "node-1")
			if err != nil {
				t.Fatal(err)
			}
			if ok, err := s2.Get("stages", "v0", &got); !ok || err != nil || got != (rec{3, 4}) {
				t.Fatalf("Get after reopen = %v, %v, %+v", ok, err, got)
			}
			// Another node's records are apart.
			s3, err := Open(dir, "node-2")
			if err != nil {
				t.Fatal(err)
			}
			if keys, _ := s3.Keys("stages"); len(keys) != 0 {
				t.Fatalf("node-2 sees node-1's records: %v", keys)
			}
		})
	}
}

func TestBadNames(t *testing.T) {
	s := Memory()
	for _, n := range []string{"", ".", "..", "../x", "a/b", ".hidden", "a\x00b", string(make([]byte, 201))} {
		if err := s.Put("stages", n, rec{}); !errors.Is(err, ErrBadName) {
			t.Errorf("Put key %q = %v, want ErrBadName", n, err)
		}
		if err := s.Put(n, "k", rec{}); !errors.Is(err, ErrBadName) {
			t.Errorf("Put kind %q = %v, want ErrBadName", n, err)
		}
	}
	if _, err := Open(t.TempDir(), "../x"); !errors.Is(err, ErrBadName) {
		t.Errorf("Open with node ../x = %v, want ErrBadName", err)
	}
}

// A link planted where a record lives is not followed.
func TestLinkNotFollowed(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, "n")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Put("stages", "v", rec{1, 1}); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(t.TempDir(), "secret.json")
	if err := os.WriteFile(target, []byte(`{"dev":9,"inode":9}`), 0o600); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "n", "stages", "v.json")
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		t.Fatal(err)
	}
	var got rec
	if ok, err := s.Get("stages", "v", &got); ok || err == nil {
		t.Fatalf("Get through a link = %v, %v, %+v; want an error", ok, err, got)
	}
}
