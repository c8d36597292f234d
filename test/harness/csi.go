package harness

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"io"
	"os"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// MountCap is a filesystem capability with the given fs type and access mode.
func MountCap(fsType string, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// BlockCap is a raw block capability.
func BlockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

// RWO is the access mode of a ReadWriteOnce PVC.
const RWO = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

// WriteRandom writes n random bytes to path, fsyncs, and returns their SHA-256.
func WriteRandom(t testing.TB, path string, n int64) []byte {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.CopyN(io.MultiWriter(f, h), rand.Reader, n); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	return h.Sum(nil)
}

// FileSum returns the SHA-256 of a file.
func FileSum(t testing.TB, path string) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return h.Sum(nil)
}

// SameSum compares two digests.
func SameSum(a, b []byte) bool { return bytes.Equal(a, b) }

// Background is a context for test calls.
func Background() context.Context { return context.Background() }
