package fsx

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"

	"golang.org/x/sys/unix"
)

// How CopyImage copied: the names pool records in snapshot.json.
const (
	// CopyReflink: the copy shares extents with its source (FICLONE).
	CopyReflink = "reflink"
	// CopyFull: an independent sparse copy.
	CopyFull = "copy"
)

// CopyImage makes dst a copy of the image file src, then grows it to size bytes
// (never shrinks; 0 keeps src's size), and fsyncs it. dst must not exist.
//
// It first asks the filesystem for a reflink (FICLONE: btrfs, XFS with reflink),
// which copies nothing and is instant; otherwise (ext4, or src and dst on
// different filesystems) it copies the data extents only (SEEK_DATA/SEEK_HOLE,
// copy_file_range), so the copy is as sparse as its source. It returns the
// method used, CopyReflink or CopyFull.
func CopyImage(ctx context.Context, src, dst string, size int64) (string, error) {
	in, err := os.Open(src)
	if err != nil {
		return "", fmt.Errorf("copy image: %w", err)
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return "", fmt.Errorf("copy image: %w", err)
	}
	out, err := os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", fmt.Errorf("copy image: %w", err)
	}
	defer out.Close()

	method := CopyReflink
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		if !reflinkUnsupported(err) {
			return "", fmt.Errorf("reflink %s to %s: %w", src, dst, err)
		}
		method = CopyFull
		if err := sparseCopy(ctx, in, out, fi.Size()); err != nil {
			return "", fmt.Errorf("copy %s to %s: %w", src, dst, err)
		}
	}
	if size > fi.Size() {
		if err := out.Truncate(size); err != nil {
			return "", fmt.Errorf("grow %s to %d bytes: %w", dst, size, err)
		}
	}
	if err := out.Sync(); err != nil {
		return "", fmt.Errorf("fsync %s: %w", dst, err)
	}
	return method, out.Close()
}

// reflinkUnsupported tells the errors of a filesystem (or a pair of them) that
// cannot share extents, as opposed to a real failure such as EIO or ENOSPC.
func reflinkUnsupported(err error) bool {
	for _, e := range []error{unix.EOPNOTSUPP, unix.ENOTTY, unix.EXDEV, unix.EINVAL, unix.ENOSYS} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// sparseCopy copies the data extents of in to out and sizes out like in. Holes
// are skipped, so they stay holes (unallocated) in the copy.
func sparseCopy(ctx context.Context, in, out *os.File, size int64) error {
	if err := out.Truncate(size); err != nil {
		return err
	}
	ifd := int(in.Fd())
	var off int64
	for off < size {
		if err := ctx.Err(); err != nil {
			return err
		}
		data, err := unix.Seek(ifd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole is left
		} else if err != nil {
			return fmt.Errorf("SEEK_DATA at %d: %w", off, err)
		}
		hole, err := unix.Seek(ifd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("SEEK_HOLE at %d: %w", data, err)
		}
		if err := copyRange(ctx, in, out, data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// copyRange copies n bytes at off from in to out, in the kernel when it can.
func copyRange(ctx context.Context, in, out *os.File, off, n int64) error {
	const chunk = 64 << 20 // bounds one call, so a cancelled context is noticed
	for n > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		roff, woff := off, off
		c, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, chunk)), 0)
		if err != nil && (errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EINVAL)) {
			return bufferedRange(in, out, off, n)
		}
		if err != nil {
			return fmt.Errorf("copy_file_range at %d: %w", off, err)
		}
		if c == 0 {
			return fmt.Errorf("copy_file_range at %d: source ended early", off)
		}
		off += int64(c)
		n -= int64(c)
	}
	return nil
}

func bufferedRange(in, out *os.File, off, n int64) error {
	_, err := io.Copy(io.NewOffsetWriter(out, off), io.NewSectionReader(in, off, n))
	return err
}

// CopyTree copies the contents of directory src into the existing directory dst,
// keeping owners, modes, timestamps, links, xattrs and sparseness, sharing extents
// where the filesystem can (cp -a --reflink=auto). A directory tree has no single
// ioctl to copy it, and cp knows every corner of it (hard links, special files,
// ACLs) that a hand-written walk would get wrong.
func CopyTree(ctx context.Context, src, dst string) error {
	// "src/." copies the contents, dotfiles included, not the directory itself.
	out, err := exec.CommandContext(ctx, "cp", "-a", "--reflink=auto", "--", src+"/.", dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("cp -a %s %s: %w: %s", src, dst, err, strings.TrimSpace(string(out)))
	}
	return nil
}
