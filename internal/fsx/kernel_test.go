package fsx

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

func TestReadKernelFile(t *testing.T) {
	dir := t.TempDir()
	big := bytes.Repeat([]byte("0123456789abcdef"), 1000) // 16000 bytes: several reads, the buffer grows
	if err := os.WriteFile(filepath.Join(dir, "big"), big, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "empty"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path string
		max        int
		want       []byte
		wantErr    bool
		notExist   bool
	}{
		{name: "larger than one read", path: "big", max: 1 << 20, want: big},
		{name: "exactly max", path: "big", max: len(big), want: big},
		{name: "one byte over max", path: "big", max: len(big) - 1, wantErr: true},
		{name: "far over max", path: "big", max: 10, wantErr: true},
		{name: "empty", path: "empty", max: 10, want: []byte{}},
		{name: "missing", path: "missing", max: 10, wantErr: true, notExist: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ReadKernelFile(filepath.Join(dir, tc.path), tc.max)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("read %d bytes, want an error", len(got))
				}
				if tc.notExist != (err != nil && errorsIsNotExist(err)) {
					t.Fatalf("err = %v, not-exist %v, want %v", err, !tc.notExist, tc.notExist)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, tc.want) {
				t.Fatalf("read %d bytes, want %d", len(got), len(tc.want))
			}
		})
	}
}

// TestReadKernelFileProc reads a kernel-generated file (no size in its stat)
// as os.ReadFile does.
func TestReadKernelFileProc(t *testing.T) {
	want, err := os.ReadFile("/proc/self/limits")
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadKernelFile("/proc/self/limits", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
}

func errorsIsNotExist(err error) bool { return errors.Is(err, fs.ErrNotExist) }
