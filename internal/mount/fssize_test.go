package mount

import (
	"context"
	"errors"
	"testing"
)

// TestFilesystemSize checks the superblock reader against what mkfs made and
// what the grow tools make: it is how NodeStageVolume tells whether a volume
// expanded while unstaged still needs its filesystem grown.
func TestFilesystemSize(t *testing.T) {
	for _, tc := range []struct {
		fs   string
		size int64
	}{
		{"ext4", 64 << 20},
		{"xfs", 300 << 20},
		{"btrfs", 128 << 20},
	} {
		t.Run(tc.fs, func(t *testing.T) {
			requireLoops(t, "blkid", mkfsCmd(tc.fs))
			file := newImage(t, tc.size)
			if err := Format(context.Background(), file, tc.fs); err != nil {
				t.Fatal(err)
			}
			fsType, got, err := FilesystemSize(file)
			if err != nil || fsType != tc.fs {
				t.Fatalf("FilesystemSize = %q, %d, %v; want %s", fsType, got, err, tc.fs)
			}
			// mkfs may leave a tail too small for one more group unused.
			if got > tc.size || got < tc.size-4<<20 {
				t.Errorf("FilesystemSize = %d on a %d-byte image", got, tc.size)
			}
			truncate(t, file, 2*tc.size)
			if _, after, _ := FilesystemSize(file); after != got {
				t.Errorf("growing the file changed the filesystem size to %d; only a grow tool may", after)
			}
		})
	}
	t.Run("blank", func(t *testing.T) {
		file := newImage(t, 1<<20)
		if _, _, err := FilesystemSize(file); !errors.Is(err, ErrUnknownFS) {
			t.Errorf("FilesystemSize of a blank image: %v, want ErrUnknownFS", err)
		}
	})
}

func mkfsCmd(fs string) string {
	name, _ := mkfsArgs(fs, "")
	return name
}
