// Package runner is the shape of every long-running loop of poolcsi: a
// Runner runs until its context ends; Every paces one with
// k8s.io/apimachinery's wait; Start starts a set of them and returns what
// stops and awaits them; Stages orders their stops.
package runner

import (
	"context"
	"time"

	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/util/wait"
)

// Runner is one long-running loop: it runs until its context ends, then
// returns (nil, or why it could not run).
type Runner interface {
	Run(ctx context.Context) error
}

// Func is a function as a Runner.
type Func func(ctx context.Context) error

// Run calls f.
func (f Func) Run(ctx context.Context) error { return f(ctx) }

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
		// The first run waits one interval; wait has no "delay first".
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

// Start runs every runner on a goroutine of its own, below parent, and
// returns what stops them all and waits until each has returned (with the
// first error one returned).
func Start(parent context.Context, runners ...Runner) (stop func() error) {
	ctx, cancel := context.WithCancel(parent)
	var g errgroup.Group
	for _, r := range runners {
		g.Go(func() error { return r.Run(ctx) })
	}
	return func() error { cancel(); return g.Wait() }
}

// Stages runs the runners of every stage at once, and stops them in stage
// order: those of the first stage when ctx ends; those of each later stage
// only once every runner of the stage before it has returned (what a call
// under way in an earlier stage may still need keeps running until that
// stage is over). A runner that returns, even with an error, stops nothing
// else: a runner whose end must end the rest (a server) cancels ctx itself.
// Stages returns once all have returned, with the first error one returned.
func Stages(ctx context.Context, stages ...[]Runner) error {
	var all errgroup.Group
	// prev closes when every runner of the stage before has returned.
	var prev <-chan struct{}
	for i, stage := range stages {
		parent := ctx
		if i > 0 {
			parent = context.WithoutCancel(ctx) // stopped by the stage before
		}
		sctx, cancel := context.WithCancel(parent)
		var g errgroup.Group
		for _, r := range stage {
			g.Go(func() error { return r.Run(sctx) })
		}
		if before := prev; before != nil {
			// A later stage stops once the stage before it is over.
			all.Go(func() error { <-before; cancel(); return nil })
		}
		done := make(chan struct{})
		all.Go(func() error { defer close(done); defer cancel(); return g.Wait() })
		prev = done
	}
	return all.Wait()
}
