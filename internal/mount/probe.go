package mount

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// The driver asks "what is on this device?" at every stage and before every
// mkfs. blkid answers it by starting a process (several milliseconds on a
// busy node, most of it process start-up and library loading); the two
// answers that matter on the hot path can be read from the kernel directly:
//
//   - "a filesystem of type T": the superblock of an ext4, xfs or btrfs
//     filesystem carries a checksum over itself (ext4 metadata_csum, xfs v5,
//     btrfs crc32c). A magic number at the right place whose checksum also
//     matches was written by that filesystem's tools, not left by chance, and
//     the caller mounts it with that type, so the kernel checks it again.
//   - "blank": a regular file in which lseek(SEEK_DATA) finds no data at all
//     holds nothing but zeros, so no signature of any kind can be in it.
//
// Anything else (no checksum, another checksum type, a blank device, a
// partition table, a mixture) is left to blkid, which knows every signature:
// the decision to format is only ever taken on blkid's word or on a file the
// kernel says holds no data.

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// probeFormat reads target's filesystem type without starting a process.
// sure is false when it cannot tell, and the caller must ask blkid.
func probeFormat(target string) (fsType string, sure bool, err error) {
	f, err := os.Open(target)
	if err != nil {
		return "", false, fmt.Errorf("probe %s: %w", target, err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return "", false, fmt.Errorf("probe %s: %w", target, &os.PathError{Op: "fstat", Path: target, Err: err})
	}
	if st.Mode&unix.S_IFMT == unix.S_IFREG && holdsNoData(int(f.Fd()), st.Size) {
		return "", true, nil
	}
	// 64 KiB + 4 KiB covers the ext4 (at 1 KiB), xfs (at 0) and btrfs (at
	// 64 KiB) primary superblocks.
	buf := make([]byte, 68<<10)
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", false, fmt.Errorf("probe %s: %w", target, err)
	}
	buf = buf[:n]
	switch {
	case xfsSuperblockValid(buf):
		return "xfs", true, nil
	case ext4SuperblockValid(buf):
		return "ext4", true, nil
	case btrfsSuperblockValid(buf):
		return "btrfs", true, nil
	}
	return "", false, nil
}

// holdsNoData tells whether a regular file of the given size has no data
// extent at all: SEEK_DATA from 0 fails with ENXIO. A filesystem without
// SEEK_DATA support reports the whole file as data, which answers false.
func holdsNoData(fd int, size int64) bool {
	if size == 0 {
		return true
	}
	_, err := unix.Seek(fd, 0, unix.SEEK_DATA)
	return errors.Is(err, unix.ENXIO)
}

// xfsSuperblockValid: big-endian superblock at 0, magic "XFSB", version 5
// (the checksummed format mkfs.xfs makes by default), sb_crc at 224 over the
// superblock's sector, stored little-endian (xfs_end_cksum).
func xfsSuperblockValid(b []byte) bool {
	if len(b) < 512 || !bytes.Equal(b[0:4], []byte("XFSB")) {
		return false
	}
	const versionOff, sectSizeOff, crcOff = 100, 102, 224
	if binary.BigEndian.Uint16(b[versionOff:])&0xf != 5 {
		return false
	}
	sect := int(binary.BigEndian.Uint16(b[sectSizeOff:]))
	if sect < 512 || sect > 32768 || sect&(sect-1) != 0 || sect > len(b) {
		return false
	}
	want := binary.LittleEndian.Uint32(b[crcOff:])
	return crcWithHole(b[:sect], crcOff) == want
}

// ext4SuperblockValid: little-endian superblock at 1024, magic 0xEF53 at
// +0x38, metadata_csum (ro_compat 0x400) set, crc32c type (+0x175 = 1), and
// s_checksum at +0x3FC: the raw crc32c (seed ~0, no final inversion) of the
// bytes before it.
func ext4SuperblockValid(b []byte) bool {
	const off = 1024
	if len(b) < off+1024 {
		return false
	}
	sb := b[off : off+1024]
	const roCompatMetadataCsum = 0x400
	if binary.LittleEndian.Uint16(sb[0x38:]) != 0xEF53 ||
		binary.LittleEndian.Uint32(sb[0x64:])&roCompatMetadataCsum == 0 || sb[0x175] != 1 {
		return false
	}
	return ^crc32.Checksum(sb[:0x3FC], castagnoli) == binary.LittleEndian.Uint32(sb[0x3FC:])
}

// btrfsSuperblockValid: superblock at 64 KiB, magic "_BHRfS_M" at +0x40,
// csum_type 0 (crc32c) at +0xC4, and the checksum in its first 4 bytes over
// bytes 0x20..0x1000, stored little-endian.
func btrfsSuperblockValid(b []byte) bool {
	const off = 64 << 10
	if len(b) < off+4096 {
		return false
	}
	sb := b[off : off+4096]
	if !bytes.Equal(sb[0x40:0x48], []byte("_BHRfS_M")) || binary.LittleEndian.Uint16(sb[0xC4:]) != 0 {
		return false
	}
	return crc32.Checksum(sb[0x20:], castagnoli) == binary.LittleEndian.Uint32(sb[0:])
}

// crcWithHole is crc32c of b with the 4 bytes at hole read as zeros, the way
// xfs checksums a structure that holds its own checksum.
func crcWithHole(b []byte, hole int) uint32 {
	c := crc32.Update(0, castagnoli, b[:hole])
	c = crc32.Update(c, castagnoli, []byte{0, 0, 0, 0})
	return crc32.Update(c, castagnoli, b[hole+4:])
}
