package pool

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A lock another node holds is never waited on past the call's deadline, and
// the error names the holder.
func TestLockNamesItsHolder(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	a, err := Open(Config{Name: "t", Path: dir}, WithNode("node-a"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(Config{Name: "t", Path: dir}, WithNode("node-b"))
	if err != nil {
		t.Fatal(err)
	}
	unlock, err := a.LockPool(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = b.LockPool(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "node node-a") {
		t.Fatalf("LockPool while node-a holds it: %v", err)
	}
	if waited := time.Since(start); waited > 2*time.Second {
		t.Fatalf("waited %s past a 200ms deadline", waited)
	}
}
