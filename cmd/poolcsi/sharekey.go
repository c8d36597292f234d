package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/fsx"
)

// shareKeyMaxBytes caps the share key file: a few keys, one a line.
const shareKeyMaxBytes = 16 << 10

// shareKeyMinDistinct is the fewest different bytes a share key may hold: a
// random key of 32 bytes or more holds far more (a hex one about 14, base64 about
// 25); a key of one byte repeated, or a short pattern, is not a secret.
const shareKeyMinDistinct = 8

// shareKeyHowTo says how to make a good key.
const shareKeyHowTo = `make one with: head -c 36 /dev/urandom | base64`

// readShareKeys reads --share-key-file: one key per line (a Kubernetes
// Secret's value, mounted through links), the first the one that tags. No
// file, no keys. Whoever can change the file, or read it, can make volume IDs
// that name any share, so the file must be owned by root (or this process's
// user) and writable by its owner alone, and readable by its owner alone
// unless it is a Kubernetes secret volume (visible in the pod only; the chart
// mounts it 0400). Each key must be at least driver.MinShareKeyLength bytes
// and not a pattern.
func readShareKeys(path string) ([][]byte, error) {
	if path == "" {
		return nil, nil
	}
	raw, err := readShareKeyFile(path)
	if err != nil {
		return nil, fmt.Errorf("--share-key-file: %w", err)
	}
	var keys [][]byte
	for i, line := range strings.Split(string(raw), "\n") {
		if line = strings.TrimSpace(line); line == "" {
			continue
		}
		if err := checkShareKey([]byte(line)); err != nil {
			return nil, fmt.Errorf("--share-key-file %s, line %d: %w", path, i+1, err)
		}
		keys = append(keys, []byte(line))
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("--share-key-file %s holds no key", path)
	}
	return keys, nil
}

// readShareKeyFile opens path once (links followed, without blocking on a
// FIFO), checks the file that descriptor is, and reads it through the same.
func readShareKeyFile(path string) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	h := os.NewFile(uintptr(fd), path)
	defer h.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if err := checkShareKeyMode(path, &st, isSecretVolumeFile(path)); err != nil {
		return nil, err
	}
	f, err := fsx.Reopen(h, unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	raw, err := io.ReadAll(io.LimitReader(f, shareKeyMaxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(raw) > shareKeyMaxBytes {
		return nil, fmt.Errorf("%s is over %d bytes: not a key file", path, shareKeyMaxBytes)
	}
	return raw, nil
}

// checkShareKeyMode refuses a key file others could change or, outside a
// Kubernetes secret volume, read.
func checkShareKeyMode(path string, st *unix.Stat_t, secretVolume bool) error {
	mode := fs.FileMode(st.Mode & 0o7777)
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return fmt.Errorf("%s is not a regular file", path)
	case st.Uid != 0 && int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s is owned by uid %d, who can change it: want root's (chown root %s)", path, st.Uid, path)
	case mode&0o022 != 0:
		return fmt.Errorf("%s is writable by others (mode %04o): anyone who can change it can make volume IDs that name any share; chmod 0400 %s (a Secret volume: defaultMode: 0400)", path, mode, path)
	case mode&0o044 != 0 && !secretVolume:
		return fmt.Errorf("%s is readable by others (mode %04o): anyone who reads it can make volume IDs that name any share; chmod 0400 %s", path, mode, path)
	}
	return nil
}

// isSecretVolumeFile says whether path is a file of a Kubernetes Secret (or
// ConfigMap, or projected) volume: kubelet's atomic writer makes each file a
// link to ..data/<name>, and ..data a link to the current timestamped directory.
func isSecretVolumeFile(path string) bool {
	dir, name := filepath.Split(path)
	target, err := os.Readlink(path)
	if err != nil || target != filepath.Join("..data", name) {
		return false
	}
	fi, err := os.Lstat(filepath.Join(dir, "..data"))
	return err == nil && fi.Mode()&fs.ModeSymlink != 0
}

// checkShareKey refuses a key too short or too regular to be a secret.
func checkShareKey(key []byte) error {
	if len(key) < driver.MinShareKeyLength {
		return fmt.Errorf("a key of %d bytes, want at least %d; %s", len(key), driver.MinShareKeyLength, shareKeyHowTo)
	}
	var seen [256]bool
	distinct := 0
	for _, b := range key {
		if !seen[b] {
			seen[b] = true
			distinct++
		}
	}
	if distinct < shareKeyMinDistinct {
		return fmt.Errorf("%w: the key holds %d different bytes, a random one far more; %s", errWeakKey, distinct, shareKeyHowTo)
	}
	return nil
}

var errWeakKey = errors.New("not a random key")
