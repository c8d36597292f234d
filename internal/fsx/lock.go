package fsx

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
)

// lockPoll is how often Flock retries a lock another process holds: flock
// has no timeout, so a blocking one could never honour a context. Contention
// only happens when two calls on one file race.
const lockPoll = 5 * time.Millisecond

// FlockContext takes an exclusive flock on f, waiting until ctx ends.
func FlockContext(ctx context.Context, f *os.File) error {
	return Flock(ctx, int(f.Fd()))
}

// Flock takes an exclusive flock on the descriptor fd, waiting until ctx
// ends; any other error of flock (ENOLCK on an NFS mount without locks) is
// returned as it is.
func Flock(ctx context.Context, fd int) error {
	var lockErr error
	err := wait.PollUntilContextCancel(ctx, lockPoll, true, func(context.Context) (bool, error) {
		err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return true, nil
		}
		if errors.Is(err, unix.EWOULDBLOCK) || errors.Is(err, unix.EINTR) {
			return false, nil
		}
		lockErr = err
		return false, err
	})
	switch {
	case lockErr != nil:
		return lockErr
	case err != nil:
		return fmt.Errorf("held by another process: %w", ctx.Err())
	}
	return nil
}
