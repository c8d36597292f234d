package runner

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
)

// fake is a runner of a stage: it waits until every fake has started, then
// returns fail at once (a failure), nil at once (a runner with nothing
// more to do), or waits for its context to end; when its context ends it
// checks that no runner of a later stage has been stopped yet, which is
// what the order promises (a context's cancel reaches its children before
// it returns, so a stop out of order is seen here, not by luck).
type fake struct {
	name  string
	stage int
	fail  error
	once  bool

	ctx context.Context // its context, set before it counts as started
}

type recorder struct {
	mu         sync.Mutex
	events     []string
	violations []string
	fakes      []*fake
	started    sync.WaitGroup
	allStarted chan struct{}
	seen       chan string // every event, as it comes
}

func (r *recorder) note(e string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
	r.seen <- e
}

func (r *recorder) runner(f *fake) Runner {
	return Func(func(ctx context.Context) error {
		f.ctx = ctx
		r.started.Done()
		<-r.allStarted
		switch {
		case f.fail != nil:
			r.note(f.name + " failed")
			return f.fail
		case f.once:
			r.note(f.name + " done")
			return nil
		}
		<-ctx.Done()
		for _, g := range r.fakes {
			if g.stage > f.stage {
				if g.ctx.Err() != nil {
					r.mu.Lock()
					r.violations = append(r.violations, g.name+" stopped while "+f.name+" (an earlier stage) was still running")
					r.mu.Unlock()
				}
			}
		}
		r.note(f.name + " stopped")
		return nil
	})
}

func TestStagesStopInOrder(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name    string
		stages  [][]*fake
		waitFor string // an event that comes before the parent context ends
		want    error
		// events that must come in this order (others may come between)
		order []string
	}{{
		name: "the server, then the lease keeper and the freeze agent",
		stages: [][]*fake{
			{{name: "sweep"}, {name: "server"}},
			{{name: "keeper"}, {name: "freezer"}},
		},
		order: []string{"server stopped", "keeper stopped"},
	}, {
		name: "three stages, each after the one before",
		stages: [][]*fake{
			{{name: "sidecar"}},
			{{name: "server"}},
			{{name: "keeper"}},
		},
		order: []string{"sidecar stopped", "server stopped", "keeper stopped"},
	}, {
		name: "a runner's failure stops nothing",
		stages: [][]*fake{
			{{name: "metrics", fail: boom}, {name: "server"}},
			{{name: "keeper"}},
		},
		waitFor: "metrics failed",
		want:    boom,
		order:   []string{"metrics failed", "server stopped", "keeper stopped"},
	}, {
		name: "a runner with nothing more to do ends nothing",
		stages: [][]*fake{
			{{name: "sweep at start only", once: true}, {name: "server"}},
			{{name: "keeper"}},
		},
		waitFor: "sweep at start only done",
		order:   []string{"sweep at start only done", "server stopped", "keeper stopped"},
	}, {
		name: "a failure in a later stage stops nothing early",
		stages: [][]*fake{
			{{name: "server"}},
			{{name: "keeper"}, {name: "freezer", fail: boom}},
		},
		waitFor: "freezer failed",
		want:    boom,
		order:   []string{"freezer failed", "server stopped", "keeper stopped"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{allStarted: make(chan struct{}), seen: make(chan string, 64)}
			var stages [][]Runner
			for i, s := range tc.stages {
				var rs []Runner
				for _, f := range s {
					f.stage = i
					r.fakes = append(r.fakes, f)
					rs = append(rs, r.runner(f))
				}
				stages = append(stages, rs)
			}
			r.started.Add(len(r.fakes))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- Stages(ctx, stages...) }()
			r.started.Wait()
			close(r.allStarted)
			for tc.waitFor != "" && <-r.seen != tc.waitFor {
			}
			cancel()
			if err := <-done; !errors.Is(err, tc.want) {
				t.Errorf("Stages returned %v, want %v", err, tc.want)
			}
			for _, v := range r.violations {
				t.Error(v)
			}
			last := -1
			for _, e := range tc.order {
				i := slices.Index(r.events, e)
				if i < 0 || i < last {
					t.Errorf("events %q: want %q in this order", r.events, tc.order)
					break
				}
				last = i
			}
		})
	}
}
