package fsx

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// lockPoll is how often FlockContext retries a lock another process holds:
// flock has no timeout, so a blocking one could never honour a context.
const lockPoll = 5 * time.Millisecond

// FlockContext takes an exclusive flock on f, waiting until ctx ends.
func FlockContext(ctx context.Context, f *os.File) error {
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
