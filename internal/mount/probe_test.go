package mount

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestProbeFormat checks the in-process superblock probe against what mkfs
// makes and against blkid: it must name the filesystem mkfs made, through the
// image file and through a loop device, and must give up (leave the answer to
// blkid) on anything it cannot prove, such as a superblock with one byte
// changed or data where no filesystem is.
func TestProbeFormat(t *testing.T) {
	for _, tc := range []struct {
		fs   string
		size int64
		sb   int64 // a byte inside the superblock the checksum covers
	}{
		{"ext4", 64 << 20, 1024 + 0x100},
		{"xfs", 300 << 20, 0x100},
		{"btrfs", 128 << 20, 64<<10 + 0x100},
	} {
		t.Run(tc.fs, func(t *testing.T) {
			requireLoops(t, "blkid", mkfsCmd(tc.fs))
			file := newImage(t, tc.size)
			if got, sure, err := probeFormat(file); err != nil || !sure || got != "" {
				t.Fatalf("probe of a new sparse file = %q, sure=%t, %v; want blank, sure", got, sure, err)
			}
			if err := Format(context.Background(), file, tc.fs); err != nil {
				t.Fatal(err)
			}
			if got, sure, err := probeFormat(file); err != nil || !sure || got != tc.fs {
				t.Fatalf("probe after mkfs = %q, sure=%t, %v; want %s, sure", got, sure, err, tc.fs)
			}
			if got := blkidType(t, file); got != tc.fs {
				t.Fatalf("blkid says %q, the probe %q", got, tc.fs)
			}
			dev := attach(t, newLoops(t), file)
			if got, sure, err := probeFormat(dev); err != nil || !sure || got != tc.fs {
				t.Fatalf("probe of %s = %q, sure=%t, %v; want %s, sure", dev, got, sure, err, tc.fs)
			}
			if got, err := DiskFormat(context.Background(), dev); err != nil || got != tc.fs {
				t.Fatalf("DiskFormat(%s) = %q, %v", dev, got, err)
			}
			flipByte(t, file, tc.sb)
			if got, sure, err := probeFormat(file); err != nil || sure {
				t.Fatalf("probe of a damaged superblock = %q, sure=%t, %v; want not sure", got, sure, err)
			}
		})
	}
	t.Run("data-but-no-filesystem", func(t *testing.T) {
		file := newImage(t, 8<<20)
		writeAt(t, file, 4<<20, []byte("data"))
		if got, sure, err := probeFormat(file); err != nil || sure {
			t.Fatalf("probe of a file with data and no superblock = %q, sure=%t, %v; want not sure", got, sure, err)
		}
	})
}

func blkidType(t *testing.T, path string) string {
	t.Helper()
	out, _ := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", path).Output()
	return strings.TrimSpace(string(out))
}

func writeAt(t *testing.T, file string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func flipByte(t *testing.T, file string, off int64) {
	t.Helper()
	f, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x55
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}
