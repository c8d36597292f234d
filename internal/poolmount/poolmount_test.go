package poolmount

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// TestNFSCommandLine: this machine has no NFS client, so the command line an NFS
// stanza runs is checked as text.
func TestNFSCommandLine(t *testing.T) {
	s := Spec{Type: "nfs", Source: "nfs.example.com:/export/poolcsi", Options: []string{"nfsvers=4.1", "hard", "timeo=600"}}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	want := []string{"-t", "nfs", "-o", "nfsvers=4.1,hard,timeo=600", "nfs.example.com:/export/poolcsi", "/var/lib/poolcsi/pools/shared"}
	if got := s.Args("/var/lib/poolcsi/pools/shared"); !reflect.DeepEqual(got, want) {
		t.Fatalf("Args = %q, want %q", got, want)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		spec Spec
		ok   bool
	}{
		{"nfs", Spec{Type: "nfs", Source: "h:/e"}, true},
		{"bind", Spec{Source: "/srv/x", Options: []string{"bind"}}, true},
		{"timeout", Spec{Type: "nfs", Source: "h:/e", Timeout: "5s"}, true},
		{"no source", Spec{Type: "nfs"}, false},
		{"no type", Spec{Source: "h:/e"}, false},
		{"comma in option", Spec{Type: "nfs", Source: "h:/e", Options: []string{"a,b"}}, false},
		{"bad timeout", Spec{Type: "nfs", Source: "h:/e", Timeout: "soon"}, false},
		{"negative timeout", Spec{Type: "nfs", Source: "h:/e", Timeout: "-1s"}, false},
	}
	for _, tt := range tests {
		if err := tt.spec.Validate(); (err == nil) != tt.ok {
			t.Errorf("%s: Validate = %v, want ok=%t", tt.name, err, tt.ok)
		}
	}
}

// TestEnsureBind mounts a real bind stanza, and finds it mounted the second time.
func TestEnsureBind(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mount", "umount")
	root := t.TempDir()
	src, dst := filepath.Join(root, "export"), filepath.Join(root, "pool")
	os.Mkdir(src, 0o755)
	os.WriteFile(filepath.Join(src, "marker"), []byte("x"), 0o644)
	m, err := New("shared", dst, Spec{Source: src, Options: []string{"bind"}, Timeout: "10s"})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Ready(); err == nil || !strings.Contains(err.Error(), "not mounted") {
		t.Fatalf("Ready before mounting = %v", err)
	}
	t.Cleanup(func() {
		if ok, _ := mountinfo.Mounted(dst); ok {
			exec.Command("umount", dst).Run()
		}
	})
	for i := 0; i < 2; i++ {
		if err := m.Ensure(context.Background()); err != nil {
			t.Fatalf("Ensure #%d: %v", i+1, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dst, "marker")); err != nil {
		t.Fatalf("the source is not visible at the pool path: %v", err)
	}
	if err := m.Ready(); err != nil {
		t.Fatalf("Ready = %v", err)
	}
	if n := countMounts(t, dst); n != 1 {
		t.Fatalf("%d mounts at %s, want 1", n, dst)
	}
}

func countMounts(t *testing.T, path string) int {
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		t.Fatal(err)
	}
	return len(infos)
}

// TestEnsureTimeout uses a FAKE mount command that never returns, standing in for
// mount.nfs against an unreachable server (no NFS client on this machine). The
// attempt gives up at the timeout, and Ready reports why.
func TestEnsureTimeout(t *testing.T) {
	dir := t.TempDir()
	fake := filepath.Join(dir, "fake-mount")
	os.WriteFile(fake, []byte("#!/bin/sh\nexec sleep 5\n"), 0o755)
	m, err := New("shared", filepath.Join(dir, "pool"), Spec{Type: "nfs", Source: "unreachable:/x", Timeout: "100ms"})
	if err != nil {
		t.Fatal(err)
	}
	m.Command = fake
	err = m.Ensure(context.Background())
	if err == nil || !strings.Contains(err.Error(), "did not finish within 100ms") {
		t.Fatalf("Ensure = %v, want a timeout", err)
	}
	if r := m.Ready(); r == nil || !strings.Contains(r.Error(), "did not finish") {
		t.Fatalf("Ready = %v, want the timeout", r)
	}
}

// TestSensitiveOptions: secret options reach mount(8) but not its log line,
// nor an error that repeats the helper's output.
func TestSensitiveOptions(t *testing.T) {
	s := Spec{Type: "ceph", Source: "mon:/x", Options: []string{"name=csi"}, Sensitive: []string{"secret=AQBsecretkey=="}}
	args, logged := s.args("/mnt")
	if strings.Join(args, " ") != "-t ceph -o name=csi,secret=AQBsecretkey== mon:/x /mnt" {
		t.Fatalf("args %q", args)
	}
	if strings.Contains(logged, "AQBsecretkey") || !strings.Contains(logged, "name=csi") {
		t.Fatalf("logged %q", logged)
	}
	if out := s.scrub("mount error: bad option secret=AQBsecretkey== and AQBsecretkey=="); strings.Contains(out, "AQBsecretkey") {
		t.Fatalf("scrubbed %q", out)
	}
	if err := (Spec{Type: "ceph", Source: "x", Sensitive: []string{"a,b"}}).Validate(); err == nil || strings.Contains(err.Error(), "a,b") {
		t.Fatalf("Validate: %v", err)
	}
}
