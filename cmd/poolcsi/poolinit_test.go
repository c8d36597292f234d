package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCheckMountPoint(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink("/proc", link); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		path    string
		root    bool
		want    string // in what it says it found, or in the error
		wantErr bool
	}{
		{"the root filesystem", "/", true, "is the root of a", false},
		{"proc", "/proc", true, "proc mount of", false},
		{"a link to a mount point", link, true, "proc mount of", false},
		{"a plain directory", dir, false, "it is a directory in the", false},
		{"missing", filepath.Join(dir, "missing"), false, "mount the share there first", true},
		{"a file", file, false, "not a directory", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			found, err := checkMountPoint(tt.path)
			if tt.wantErr {
				if err == nil || !strings.Contains(err.Error(), tt.want) {
					t.Fatalf("err %v, want one with %q", err, tt.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if found.isRoot != tt.root || !strings.Contains(found.String(), tt.want) {
				t.Fatalf("found %q (root %v), want root %v and %q", found, found.isRoot, tt.root, tt.want)
			}
		})
	}
}

func TestPoolInitRefusesWhatIsNotAMountPoint(t *testing.T) {
	tests := []struct {
		name    string
		exists  bool
		flags   []string
		code    int
		want    string // in the output
		laidOut bool
	}{
		{"plain directory", true, nil, 1, "is not a mount point: it is a directory in the", false},
		{"missing directory", false, nil, 1, "mount the share there first", false},
		{"plain directory, said to be fine", true, []string{"--not-a-mount-point-ok"}, 0, "going on, as --not-a-mount-point-ok says", true},
		{"missing directory, said to be fine", false, []string{"--not-a-mount-point-ok"}, 0, "pool init makes it", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pool")
			if tt.exists {
				if err := os.Mkdir(dir, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			args := append([]string{"pool", "init", "--path", dir, "--name", "shared"}, tt.flags...)
			code, out, errOut := runCLI(args...)
			if code != tt.code || !strings.Contains(out+errOut, tt.want) {
				t.Fatalf("exit %d, want %d with %q:\n%s%s", code, tt.code, tt.want, out, errOut)
			}
			_, err := os.Stat(filepath.Join(dir, "pool.json"))
			if laidOut := err == nil; laidOut != tt.laidOut {
				t.Fatalf("pool.json there: %v, want %v", laidOut, tt.laidOut)
			}
		})
	}
}
