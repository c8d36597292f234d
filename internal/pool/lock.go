package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// lockPoll is how often a blocked lock is retried. flock has no timeout, and a
// blocking flock cannot be cancelled, so the wait is a poll bounded by the context.
const lockPoll = 5 * time.Millisecond

// LockPool takes the pool-wide lock that serialises capacity decisions (create,
// expand, delete) across every process and node that shares the pool. It is a lock
// file, not a mutex: on a shared filesystem the other holder is another machine.
func (p *Pool) LockPool(ctx context.Context) (unlock func(), err error) {
	return lockFileAt(ctx, filepath.Join(p.Path, poolLock), true)
}

// LockVolume takes the lock of one volume's metadata. It fails with an error
// wrapping os.ErrNotExist when the volume does not exist (or is deleted while
// waiting), so no caller ever acts on a volume that vanished under it.
func (p *Pool) LockVolume(ctx context.Context, id VolumeID) (unlock func(), err error) {
	return lockFileAt(ctx, filepath.Join(p.Dir(id), lockFile), false)
}

func lockFileAt(ctx context.Context, path string, create bool) (func(), error) {
	flags := os.O_RDWR
	if create {
		flags |= os.O_CREATE
	}
	for {
		f, err := os.OpenFile(path, flags, 0o600)
		if err != nil {
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if err := flockContext(ctx, f); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		// The file may have been removed (volume deleted) between open and lock:
		// then the lock we hold guards nothing, and we look again.
		var held, now unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &held); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if err := unix.Stat(path, &now); err != nil || now.Ino != held.Ino || now.Dev != held.Dev {
			f.Close()
			if err != nil && errors.Is(err, unix.ENOENT) && !create {
				return nil, fmt.Errorf("lock %s: %w", path, os.ErrNotExist)
			}
			continue
		}
		return func() { f.Close() }, nil // closing releases the flock
	}
}

func flockContext(ctx context.Context, f *os.File) error {
	t := time.NewTicker(lockPoll)
	defer t.Stop()
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("held by another process: %w", ctx.Err())
		case <-t.C:
		}
	}
}
