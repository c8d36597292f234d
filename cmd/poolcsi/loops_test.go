package main

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/internal/runner"
)

// TestRunLoopsOrder runs serve's loops over fake runners: the loops beside
// the CSI server start before it, stop with it, and are awaited (up to the
// grace) before runLoops returns the server's error; a loop beside it that
// fails stops nothing else.
func TestRunLoopsOrder(t *testing.T) {
	boom := errors.New("listen failed")
	for _, tc := range []struct {
		name       string
		serverFail error    // the server returns this at once; nil: it serves until ctx ends
		besideFail bool     // one loop beside it fails at once
		stuck      bool     // one loop beside it never stops
		want       []string // the events, in this order (the mounts stop beside the server, in no order, before runLoops returns)
	}{{
		name: "ctx ends: the server and the loops beside it stop, and are awaited",
		want: []string{"mounts started", "server started", "server stopped", "returned"},
	}, {
		name:       "a server that fails stops the loops beside it",
		serverFail: boom,
		want:       []string{"mounts started", "server started", "server failed", "returned"},
	}, {
		name:       "a loop beside the server that fails stops nothing",
		besideFail: true,
		want:       []string{"metrics failed", "server started", "server stopped", "returned"},
	}, {
		name:  "a loop beside the server that never stops is left after the grace",
		stuck: true,
		want:  []string{"mounts started", "server started", "server stopped", "returned"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var events []string
			note := func(e string) {
				mu.Lock()
				defer mu.Unlock()
				events = append(events, e)
			}
			besideUp := make(chan struct{}, 2)
			serverUp := make(chan struct{})
			mounts := runner.Func(func(ctx context.Context) error {
				note("mounts started")
				besideUp <- struct{}{}
				<-ctx.Done()
				note("mounts stopped")
				return nil
			})
			beside := []runner.Runner{mounts}
			if tc.besideFail {
				beside = append(beside, runner.Func(func(ctx context.Context) error {
					note("metrics failed")
					besideUp <- struct{}{}
					return errors.New("metrics address in use")
				}))
			}
			release := make(chan struct{})
			defer close(release)
			if tc.stuck {
				beside = append(beside, runner.Func(func(ctx context.Context) error {
					besideUp <- struct{}{}
					<-release // ignores ctx
					return nil
				}))
			}
			server := runner.Func(func(ctx context.Context) error {
				// The loops beside the server are under way before it serves.
				for range beside {
					<-besideUp
				}
				note("server started")
				close(serverUp)
				if tc.serverFail != nil {
					note("server failed")
					return tc.serverFail
				}
				<-ctx.Done()
				note("server stopped")
				return nil
			})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- runLoops(ctx, server, beside, 50*time.Millisecond) }()
			<-serverUp
			if tc.serverFail == nil {
				cancel()
			}
			err := <-done
			note("returned")
			if !errors.Is(err, tc.serverFail) {
				t.Errorf("runLoops returned %v, want %v", err, tc.serverFail)
			}
			mu.Lock()
			defer mu.Unlock()
			if i := slices.Index(events, "mounts stopped"); i < 0 || i > slices.Index(events, "returned") {
				t.Errorf("events %q: the mounts' retries did not stop before runLoops returned", events)
			}
			got := slices.DeleteFunc(slices.Clone(events), func(e string) bool {
				// The failing loop's and the mounts' start race each other.
				return e == "mounts stopped" || tc.besideFail && e == "mounts started"
			})
			if !slices.Equal(got, tc.want) {
				t.Errorf("events %q, want %q", got, tc.want)
			}
		})
	}
}
