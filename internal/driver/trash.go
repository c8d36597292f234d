package driver

import (
	"context"
	"slices"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// trashScanInterval is how often the emptier looks through each pool's whole
// trash for what no delete queued (a crash's, a failed removal's, a pool the
// emptier came to serve late).
const trashScanInterval = time.Minute

// trashEmptier removes what volume deletes renamed into their pools' trash
// after DeleteVolume answered (pool.ServeTrash): at its start what a crash
// left, then each queued entry as it is queued, and the whole trash every
// trashScanInterval, when it also starts serving the pools that appeared
// since (a share's). When it stops, deletes remove their data themselves
// again, and it removes what was still queued.
type trashEmptier struct {
	pools func() []*pool.Pool
}

// Run empties until ctx ends.
func (t trashEmptier) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithName("trash")
	wake := make(chan struct{}, 1)
	signal := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	var served []*pool.Pool
	empty := func(all bool) {
		for _, p := range t.pools() {
			if all {
				p.ServeTrash(signal)
				if !slices.Contains(served, p) {
					served = append(served, p)
				}
			}
			if err := p.EmptyTrash(all); err != nil {
				logger.Error(err, "Emptying a pool's trash", "pool", p.Name())
			}
		}
	}
	defer func() {
		for _, p := range served {
			p.ServeTrash(nil)
			if err := p.EmptyTrash(false); err != nil {
				logger.Error(err, "Emptying a pool's trash", "pool", p.Name())
			}
		}
	}()
	empty(true)
	tick := time.NewTicker(trashScanInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
			empty(false)
		case <-tick.C:
			empty(true)
		}
	}
}
