package pool

import (
	"encoding/json"
	"errors"
	"fmt"
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
}

func leaseRel(node string) string { return filepath.Join(leasesDir, node) }

// WriteLease rewrites node's lease record in place and makes it durable.
func (p *Pool) WriteLease(l Lease) error {
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
	if err := p.readMeta(); err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(p.cfg.Path, leasesDir), 0o750); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("pool %s: %w", p.cfg.Name, err)
	}
	f, err := fsx.OpenRegular(p.cfg.Path, leaseRel(l.Node), unix.O_RDWR|unix.O_CREAT, 0o640)
	if err != nil {
		return fmt.Errorf("pool %s: lease of node %s: %w", p.cfg.Name, l.Node, unsafe(err))
	}
	defer f.Close()
	if _, err := f.WriteAt(line, 0); err != nil {
		return fmt.Errorf("pool %s: write lease of node %s: %w", p.cfg.Name, l.Node, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("pool %s: fsync lease of node %s: %w", p.cfg.Name, l.Node, err)
	}
	return nil
}

// ReadLease reads node's lease record; ok is false when it has none.
func (p *Pool) ReadLease(node string) (l Lease, ok bool, err error) {
	if err := ValidateNodeID(node); err != nil {
		return l, false, err
	}
	raw, err := p.readBeneath(leaseRel(node), maxLease)
	switch {
	case missing(err):
		return l, false, nil
	case err != nil:
		return l, false, err
	}
	if err := json.Unmarshal([]byte(strings.TrimSpace(string(raw))), &l); err != nil {
		return l, false, fmt.Errorf("%w: pool %s: lease of node %s: %w", ErrCorrupt, p.cfg.Name, node, err)
	}
	if l.Node != node {
		return l, false, fmt.Errorf("%w: pool %s: the lease file of node %s names node %q", ErrCorrupt, p.cfg.Name, node, l.Node)
	}
	return l, true, nil
}
