package mount

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// ErrUnknownFS is returned by FilesystemSize for a device whose superblock it
// does not recognise.
var ErrUnknownFS = errors.New("no ext4, xfs or btrfs superblock")

// FilesystemSize reads the size the filesystem on device (or in an image file)
// believes it has, from its superblock: a few hundred bytes read, no process
// started. It is meant for an unmounted device — a mounted filesystem may hold
// a newer superblock in memory than the one on disk.
func FilesystemSize(device string) (fsType string, size int64, err error) {
	f, err := os.Open(device)
	if err != nil {
		return "", 0, fmt.Errorf("filesystem size: %w", err)
	}
	defer f.Close()
	// xfs: big-endian superblock at 0: magic, block size, data blocks.
	var xfs [16]byte
	if _, err := f.ReadAt(xfs[:], 0); err != nil && !errors.Is(err, io.EOF) {
		return "", 0, fmt.Errorf("filesystem size of %s: %w", device, err)
	}
	if bytes.Equal(xfs[0:4], []byte("XFSB")) {
		bs := int64(binary.BigEndian.Uint32(xfs[4:8]))
		return "xfs", int64(binary.BigEndian.Uint64(xfs[8:16])) * bs, nil
	}
	// ext2/3/4: little-endian superblock at 1024.
	var ext [0x160]byte
	if _, err := f.ReadAt(ext[:], 1024); err == nil && binary.LittleEndian.Uint16(ext[0x38:]) == 0xEF53 {
		bs := int64(1024) << binary.LittleEndian.Uint32(ext[0x18:])
		blocks := uint64(binary.LittleEndian.Uint32(ext[0x04:]))
		const incompat64Bit = 0x80
		if binary.LittleEndian.Uint32(ext[0x60:])&incompat64Bit != 0 {
			blocks |= uint64(binary.LittleEndian.Uint32(ext[0x150:])) << 32
		}
		return "ext4", int64(blocks) * bs, nil
	}
	// btrfs: superblock at 64 KiB, magic at +0x40, total_bytes at +0x70.
	var btrfs [0x78]byte
	if _, err := f.ReadAt(btrfs[:], 64<<10); err == nil && bytes.Equal(btrfs[0x40:0x48], []byte("_BHRfS_M")) {
		return "btrfs", int64(binary.LittleEndian.Uint64(btrfs[0x70:])), nil
	}
	return "", 0, fmt.Errorf("filesystem size of %s: %w", device, ErrUnknownFS)
}

// DeviceReadOnly reports the kernel read-only flag of a block device (BLKROGET),
// the flag SetReadOnly sets.
func DeviceReadOnly(device string) (bool, error) {
	fd, err := unix.Open(device, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("read-only flag: %w", &os.PathError{Op: "open", Path: device, Err: err})
	}
	defer unix.Close(fd)
	v, err := unix.IoctlGetInt(fd, unix.BLKROGET)
	if err != nil {
		return false, fmt.Errorf("read-only flag: %w", &os.PathError{Op: "BLKROGET", Path: device, Err: err})
	}
	return v != 0, nil
}
