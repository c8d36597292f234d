package config

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func TestParsePoolFlag(t *testing.T) {
	tests := []struct {
		in      string
		want    pool.Config
		wantErr bool
	}{
		{in: "local=/var/lib/p", want: pool.Config{Name: "local", Path: "/var/lib/p"}},
		{in: "nfs=/mnt/share,shared", want: pool.Config{Name: "nfs", Path: "/mnt/share", Shared: true}},
		{in: "a=/x/../y", want: pool.Config{Name: "a", Path: "/y"}},
		{in: "noequals", wantErr: true},
		{in: "=/x", wantErr: true},
		{in: "Bad_Name=/x", wantErr: true},
		{in: "a=/x,bogus", wantErr: true},
		{in: "a=", wantErr: true},
	}
	for _, tt := range tests {
		got, err := ParsePoolFlag(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParsePoolFlag(%q) error = %v, wantErr %v", tt.in, err, tt.wantErr)
			continue
		}
		if !tt.wantErr && got != tt.want {
			t.Errorf("ParsePoolFlag(%q) = %+v, want %+v", tt.in, got, tt.want)
		}
	}
}

func TestLoadAndMerge(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte("pools:\n- name: local\n  path: /a\n- name: shared\n  path: /b\n  shared: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	got := Pools(f, []pool.Config{{Name: "local", Path: "/override"}})
	want := []pool.Config{{Name: "local", Path: "/override"}, {Name: "shared", Path: "/b", Shared: true}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("Pools = %+v, want %+v", got, want)
	}
	if def := Pools(File{}, nil); len(def) != 1 || def[0].Path != DefaultPoolPath {
		t.Fatalf("default pools = %+v", def)
	}
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(bad, []byte("pools:\n- name: x\n  pth: /a\n"), 0o600)
	if _, err := Load(bad); err == nil {
		t.Fatal("a misspelt key was accepted")
	}
}
