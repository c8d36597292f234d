package pool

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// A node's lease in a shared pool is leases/<node>: one line of JSON that the
// node plugin rewrites in place every renewal interval. In place, not by
// rename: a reader on another NFS client opens the file anew each time, and
// close-to-open consistency then gives it the current content of the same
// inode, where a cached name could still resolve to the inode a rename
// replaced. The line is padded to a fixed length so that a rewrite never
// leaves a tail of the one before.

const (
	leasesDir = "leases"
	leaseSize = 256
	maxLease  = 4 << 10
)

// Lease is one node's lease record in a pool.
type Lease struct {
	Node string `json:"node"`
	// Instance changes with every driver process, Counter with every
	// renewal of one: a reader that sees either change knows the holder is
	// alive, by its own clock, whatever the holder's clock says.
	Instance string `json:"instance"`
	Counter  uint64 `json:"counter"`
	// DurationSeconds is the holder's --lease-duration: a reader waits for
	// the longer of it and its own.
	DurationSeconds int64 `json:"durationSeconds"`
	// Released: the holder stopped renewing and holds nothing read-write in
	// the pool (a clean stop).
	Released bool `json:"released,omitempty"`
	// Damaged, set by Leases().Read and never written, says that what the pool
	// holds for the node is no lease record (a directory, a link, a FIFO, a
	// file too large, garbage, another node's name) and fingerprints it, so
	// that a reader notices when it changes. A reader waits for a damaged
	// record as for one declaring the longest lease (internal/lease).
	Damaged string `json:"-"`
	// Stamp, set by Leases().Read and never written, is the lease file's inode
	// and change time (ctime, which only the kernel sets, on every write).
	// A reader counts any change of it as a renewal: someone who rewrites a
	// live node's lease with a constant record, faster than the node renews,
	// must not make the node look silent while it renews and does not fence.
	Stamp string `json:"-"`
}

// Leases is the pool's view for the nodes' lease records (leases/<node>),
// a narrow store over the one Pool as Freezes is.
type Leases struct{ p *Pool }

// Leases is the pool's lease records.
func (p *Pool) Leases() Leases { return Leases{p} }

func leaseRel(node string) string { return filepath.Join(leasesDir, node) }

// ErrLeaseDamaged marks a node's own lease entry that is not a lease file it
// can rewrite in place: a directory, a link (symbolic or hard), a FIFO, a
// device, a file far too large. It wraps ErrCorrupt. The node repairs it
// (Leases().Repair): the pool answers, only its file is wrong.
var ErrLeaseDamaged = fmt.Errorf("%w: lease entry damaged", ErrCorrupt)

// Write rewrites node's lease record in place and makes it durable. A
// pool that does not answer, or whose root is not this pool any more, is
// ErrUnavailable; a lease entry that is not a lease file is ErrLeaseDamaged.
func (ls Leases) Write(l Lease) error {
	if err := ValidateNodeID(l.Node); err != nil {
		return err
	}
	raw, _ := json.Marshal(l)
	if len(raw) >= leaseSize {
		return fmt.Errorf("lease record of node %s is %d bytes, over %d", l.Node, len(raw), leaseSize-1)
	}
	line := append(raw, []byte(strings.Repeat(" ", leaseSize-1-len(raw))+"\n")...)
	// Only into the pool itself: where its filesystem is not mounted (any
	// more), the mount point is an empty directory of this node's own disk,
	// and a lease written there would renew nothing another node sees.
	if err := ls.p.readMeta(); err != nil {
		if missing(err) && ls.p.cfg.Shared {
			return fmt.Errorf("%w: shared pool %s: %s has no %s: the share is not mounted on this node, or the pool was never initialised (then run, once: poolcsi pool init --path %s --name %s): %w",
				ErrUnavailable, ls.p.cfg.Name, ls.p.cfg.Path, poolMeta, ls.p.cfg.Path, ls.p.cfg.Name, err)
		}
		if !errors.Is(err, ErrUnavailable) {
			err = fmt.Errorf("%w: pool %s: %w", ErrUnavailable, ls.p.cfg.Name, err)
		}
		return err
	}
	if err := os.Mkdir(filepath.Join(ls.p.cfg.Path, leasesDir), 0o750); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("pool %s: %w", ls.p.cfg.Name, err)
	}
	f, err := fsx.OpenRegular(ls.p.cfg.Path, leaseRel(l.Node), unix.O_RDWR|unix.O_CREAT, 0o640)
	if err != nil {
		if errors.Is(err, fsx.ErrUnsafe) || errors.Is(err, unix.ENOTDIR) {
			return fmt.Errorf("%w: pool %s: lease of node %s: %w", ErrLeaseDamaged, ls.p.cfg.Name, l.Node, err)
		}
		return fmt.Errorf("pool %s: lease of node %s: %w", ls.p.cfg.Name, l.Node, ls.p.files().classify(err))
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("pool %s: stat lease of node %s: %w", ls.p.cfg.Name, l.Node, err)
	}
	// A second name for the file (a hard link from another node's lease, or
	// from anywhere in the pool) would carry this node's renewals there.
	if st.Nlink > 1 {
		return fmt.Errorf("%w: pool %s: the lease file of node %s has %d names", ErrLeaseDamaged, ls.p.cfg.Name, l.Node, st.Nlink)
	}
	if _, err := f.WriteAt(line, 0); err != nil {
		return fmt.Errorf("pool %s: write lease of node %s: %w", ls.p.cfg.Name, l.Node, err)
	}
	// Whatever someone appended beyond the record goes: a reader would take
	// the file for damage.
	if st.Size > leaseSize {
		if err := f.Truncate(leaseSize); err != nil {
			return fmt.Errorf("pool %s: truncate lease of node %s: %w", ls.p.cfg.Name, l.Node, err)
		}
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("pool %s: fsync lease of node %s: %w", ls.p.cfg.Name, l.Node, err)
	}
	return nil
}

// Repair removes node's lease entry when it is not a lease file the node
// can rewrite (ErrLeaseDamaged), so that the next Leases().Write creates it anew;
// the leases directory too, when it is not a directory. Nothing is followed:
// entries are looked at and removed relative to a descriptor of their
// directory, opened below the pool's root without links, so a link is removed
// itself, never its target. A directory in the lease's place is renamed
// aside first (the lease can be written at once) and then removed, at most
// maxRepairEntries entries deep: a huge tree planted there is left, renamed,
// for an operator, and says so.
func (ls Leases) Repair(node string) error {
	if err := ValidateNodeID(node); err != nil {
		return err
	}
	if err := ls.p.readMeta(); err != nil {
		return err // only in the pool itself, as Leases().Write
	}
	root, err := fsx.OpenDir(ls.p.cfg.Path, ".")
	if err != nil {
		return fmt.Errorf("pool %s: %w", ls.p.cfg.Name, ls.p.files().classify(err))
	}
	defer root.Close()
	if err := removeEntry(int(root.Fd()), leasesDir, false); err != nil {
		return fmt.Errorf("pool %s: repair %s: %w", ls.p.cfg.Name, leasesDir, err)
	}
	dir, err := fsx.OpenDir(ls.p.cfg.Path, leasesDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("pool %s: %w", ls.p.cfg.Name, ls.p.files().classify(err))
	}
	defer dir.Close()
	if err := removeEntry(int(dir.Fd()), node, true); err != nil {
		return fmt.Errorf("pool %s: repair the lease of node %s: %w", ls.p.cfg.Name, node, err)
	}
	return dir.Sync()
}

// maxRepairEntries bounds what Leases().Repair removes of a directory planted
// where a lease belongs.
const maxRepairEntries = 1000

// removeEntry removes name in the directory dirfd unless it is what belongs
// there: a directory (file false) or a regular file with one name (file true).
func removeEntry(dirfd int, name string, file bool) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return err
	}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	switch {
	case !file && isDir:
		return nil
	case file && st.Mode&unix.S_IFMT == unix.S_IFREG && st.Nlink == 1 && st.Size <= maxLease:
		return nil
	case !isDir:
		// unlinkat removes the entry itself, whatever it points to; if a
		// directory was swapped in since the look, it fails (EISDIR).
		return unlinkat(dirfd, name, 0)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	aside := fmt.Sprintf(".%s.damaged-%s", name, hex.EncodeToString(b[:]))
	if err := unix.Renameat(dirfd, name, dirfd, aside); err != nil {
		return fmt.Errorf("rename %s aside: %w", name, err)
	}
	budget := maxRepairEntries
	if err := removeTree(dirfd, aside, &budget, 0); err != nil {
		return fmt.Errorf("a directory stood in its place, renamed %s, and removing it failed (remove it by hand): %w", aside, err)
	}
	return nil
}

// removeTree removes the directory name in dirfd and what it holds, never
// following a link, within budget entries and 16 levels.
func removeTree(dirfd int, name string, budget *int, depth int) error {
	if depth > 16 {
		return errors.New("nested too deep")
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", name, err)
	}
	d := os.NewFile(uintptr(fd), name)
	defer d.Close()
	for {
		des, err := d.ReadDir(64)
		for _, de := range des {
			if *budget--; *budget < 0 {
				return fmt.Errorf("more than %d entries", maxRepairEntries)
			}
			if de.IsDir() {
				if err := removeTree(fd, de.Name(), budget, depth+1); err != nil {
					return err
				}
				continue
			}
			if err := unlinkat(fd, de.Name(), 0); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) || len(des) == 0 {
			break
		}
		if err != nil {
			return err
		}
	}
	return unlinkat(dirfd, name, unix.AT_REMOVEDIR)
}

func unlinkat(dirfd int, name string, flags int) error {
	if err := unix.Unlinkat(dirfd, name, flags); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s: %w", name, err)
	}
	return nil
}

// Read reads node's lease record; ok is false when it has none. What
// stands in its place and is no lease record (a link, a directory, a FIFO, a
// file too large, garbage, another node's name) is returned with ok and
// Damaged set, not as an error: anyone who can write the pool can put it
// there, and a reader waits for it as for the longest lease (internal/lease)
// instead of refusing for good. An error is a pool that cannot be read.
func (ls Leases) Read(node string) (l Lease, ok bool, err error) {
	if err := ValidateNodeID(node); err != nil {
		return l, false, err
	}
	raw, stamp, err := ls.readFile(node)
	switch {
	case missing(err):
		return l, false, nil
	case errors.Is(err, ErrUnavailable):
		return l, false, err
	case errors.Is(err, fsx.ErrUnsafe) || errors.Is(err, unix.ENOTDIR):
		return Lease{Node: node, Damaged: err.Error(), Stamp: stamp}, true, nil
	case err != nil:
		return l, false, err
	}
	damaged := func(why string) (Lease, bool, error) {
		sum := sha256.Sum256(raw)
		return Lease{Node: node, Damaged: fmt.Sprintf("%s; content sha256 %s", why, hex.EncodeToString(sum[:8])), Stamp: stamp}, true, nil
	}
	if err := json.Unmarshal([]byte(strings.TrimSpace(string(raw))), &l); err != nil {
		return damaged(fmt.Sprintf("pool %s: the lease of node %s is not a lease record: %v", ls.p.cfg.Name, node, err))
	}
	if l.Node != node {
		return damaged(fmt.Sprintf("pool %s: the lease file of node %s names node %q", ls.p.cfg.Name, node, l.Node))
	}
	l.Damaged, l.Stamp = "", stamp
	return l, true, nil
}

// readFile reads node's lease file through the bounded reader's rules
// (below the pool's root without links, a regular file only, at most
// maxLease bytes) and stamps it with its inode and change time.
func (ls Leases) readFile(node string) (raw []byte, stamp string, err error) {
	f, err := fsx.OpenRegular(ls.p.cfg.Path, leaseRel(node), unix.O_RDONLY, 0)
	if err != nil {
		return nil, "", ls.p.files().classify(err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, "", fmt.Errorf("pool %s: stat lease of node %s: %w", ls.p.cfg.Name, node, err)
	}
	stamp = fmt.Sprintf("ino %d ctime %d.%09d", st.Ino, st.Ctim.Sec, st.Ctim.Nsec)
	raw, err = io.ReadAll(io.LimitReader(f, maxLease+1))
	if err != nil {
		return nil, stamp, fmt.Errorf("pool %s: read lease of node %s: %w", ls.p.cfg.Name, node, err)
	}
	if len(raw) > maxLease {
		return nil, stamp, fmt.Errorf("%w: %w: %s is over %d bytes", ErrCorrupt, fsx.ErrUnsafe, f.Name(), maxLease)
	}
	return raw, stamp, nil
}

// Nodes lists the nodes that have an entry in the pool's leases
// directory (whatever it is: Leases().Read says), sorted; names that are no node
// ID (an entry Leases().Repair renamed aside, a temp file) are left out.
func (ls Leases) Nodes() ([]string, error) {
	des, err := ls.p.files().readDir(leasesDir)
	switch {
	case missing(err):
		return nil, nil
	case err != nil:
		return nil, err
	}
	var out []string
	for _, de := range des {
		if n := de.Name(); !strings.HasPrefix(n, ".") && ValidateNodeID(n) == nil {
			out = append(out, n)
		}
	}
	return out, nil
}
