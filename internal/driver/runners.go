package driver

import (
	"context"
	"time"

	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/util/wait"
)

// Runner is one of the driver's long-running loops: it runs until its
// context ends, then returns (nil, or why it could not run). Serve starts and
// awaits them all in one place (start).
type Runner interface {
	Run(ctx context.Context) error
}

// Every runs F every Interval until the context ends, sliding (the next run
// starts an interval after the last one ended). AtStart also runs it once at
// once; otherwise the first run is one interval after the start. An
// Interval of zero or less runs it at start only (with AtStart) or never.
type Every struct {
	Interval time.Duration
	AtStart  bool
	F        func(ctx context.Context)
}

// Run runs e until ctx ends.
func (e Every) Run(ctx context.Context) error {
	if e.Interval <= 0 {
		if e.AtStart && ctx.Err() == nil {
			e.F(ctx)
		}
		return nil
	}
	if !e.AtStart {
		t := time.NewTimer(e.Interval)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
	wait.UntilWithContext(ctx, e.F, e.Interval)
	return nil
}

// start runs every runner on a goroutine of its own, below parent, and returns
// what stops them all and waits until each has returned (with the first
// error one returned).
func start(parent context.Context, runners ...Runner) (stop func() error) {
	ctx, cancel := context.WithCancel(parent)
	var g errgroup.Group
	for _, r := range runners {
		g.Go(func() error { return r.Run(ctx) })
	}
	return func() error { cancel(); return g.Wait() }
}
