package config

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func TestParsePoolFlag(t *testing.T) {
	yes, no := true, false
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
		{in: "s-0123456789abcdef=/x", wantErr: true}, // a share's pool name
		{in: "s-nfs=/x", want: pool.Config{Name: "s-nfs", Path: "/x"}},
		{in: "sc=/mnt/sc,shared,ephemeral", want: pool.Config{Name: "sc", Path: "/mnt/sc", Shared: true, Ephemeral: &yes}},
		{in: "l=/l,noephemeral", want: pool.Config{Name: "l", Path: "/l", Ephemeral: &no}},
		{in: "l=/l,ephemeral=yes", wantErr: true},
	}
	for _, tt := range tests {
		got, err := ParsePoolFlag(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParsePoolFlag(%q) error = %v, wantErr %v", tt.in, err, tt.wantErr)
			continue
		}
		if !tt.wantErr && !reflect.DeepEqual(got, tt.want) {
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

func TestMountStanza(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.yaml")
	os.WriteFile(path, []byte(`pools:
- name: nfs
  path: /var/lib/poolcsi/pools/nfs
  shared: true
  mount:
    type: nfs
    source: server:/export
    options: [nfsvers=4.1, hard]
    timeout: 45s
- name: local
  path: /a
`), 0o600)
	f, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	pools := Pools(f, nil)
	if !pools[0].RequireMount || pools[1].RequireMount {
		t.Fatalf("RequireMount: %+v", pools)
	}
	m := Mounts(f, nil)
	if s, ok := m["nfs"]; !ok || s.Source != "server:/export" || s.Timeout != "45s" || len(m) != 1 {
		t.Fatalf("Mounts = %+v", m)
	}
	if m := Mounts(f, []pool.Config{{Name: "nfs", Path: "/elsewhere"}}); len(m) != 0 {
		t.Fatalf("a --pool flag redefining the pool kept its stanza: %+v", m)
	}
	os.WriteFile(path, []byte("pools:\n- name: nfs\n  path: /x\n  mount:\n    type: nfs\n"), 0o600)
	if _, err := Load(path); err == nil {
		t.Fatal("a stanza without source was accepted")
	}
}
