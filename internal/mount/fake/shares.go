package fake

import (
	"context"
	"os"
	"path/filepath"
	"sync"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// Shares stands in for poolmount.Shares: a share "mounted" is a directory
// under Root, one per share, which stays (as the server's data would) after
// Release takes the "mount" away.
type Shares struct {
	Root string

	mu       sync.Mutex
	mounted  map[pool.ShareRef]bool
	recorded map[pool.ShareRef]bool
	// Mounts are the mounts made, in order, with what each was given.
	Mounts []poolmount.Share
	// Released are the shares Release unmounted.
	Released []pool.ShareRef
	// Err, if set, fails every Ensure that would mount.
	Err error
}

// NewShares returns fake shares under root.
func NewShares(root string) *Shares {
	return &Shares{Root: root, mounted: map[pool.ShareRef]bool{}, recorded: map[pool.ShareRef]bool{}}
}

func (s *Shares) path(r pool.ShareRef) string { return filepath.Join(s.Root, r.PoolName()) }

// Ensure "mounts" the share: makes its directory.
func (s *Shares) Ensure(_ context.Context, sh poolmount.Share) (string, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mounted[sh.Ref] {
		return s.path(sh.Ref), false, nil
	}
	if err := poolmount.Check(sh); err != nil {
		return "", false, err
	}
	if s.Err != nil {
		return "", false, s.Err
	}
	if err := os.MkdirAll(s.path(sh.Ref), 0o750); err != nil {
		return "", false, err
	}
	s.mounted[sh.Ref] = true
	s.recorded[sh.Ref] = true
	s.Mounts = append(s.Mounts, sh)
	return s.path(sh.Ref), true, nil
}

// Release "unmounts" the share.
func (s *Shares) Release(_ context.Context, r pool.ShareRef) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.mounted, r)
	delete(s.recorded, r)
	s.Released = append(s.Released, r)
	return nil
}

// Recorded tells whether the share was "mounted" before and not released.
func (s *Shares) Recorded(r pool.ShareRef) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.recorded[r]
}

// Known returns the shares "mounted".
func (s *Shares) Known() (map[pool.ShareRef]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[pool.ShareRef]string{}
	for r := range s.mounted {
		out[r] = s.path(r)
	}
	return out, nil
}

// Unmount forgets a mount, as a node reboot does.
func (s *Shares) Unmount(r pool.ShareRef) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.mounted, r)
}

// MountCount is how many mounts were made.
func (s *Shares) MountCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.Mounts)
}

// RequireMount is false: the fake's shares are plain directories.
func (s *Shares) RequireMount() bool { return false }
