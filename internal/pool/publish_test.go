package pool

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestValidateNodeID(t *testing.T) {
	tests := []struct {
		id string
		ok bool
	}{
		{"node-1", true},
		{"ip-10-0-0-1.eu-west-1.compute.internal", true},
		{"Node_A", true},
		{strings.Repeat("a", 253), true},
		{strings.Repeat("a", 254), false},
		{"", false},
		{"..", false},
		{"a..b", false},
		{"a/b", false},
		{"-a", false},
		{"a\x00b", false},
		{".hidden", false},
	}
	for _, tt := range tests {
		err := ValidateNodeID(tt.id)
		if (err == nil) != tt.ok || (err != nil && !errors.Is(err, ErrInvalidID)) {
			t.Errorf("ValidateNodeID(%q) = %v, want ok=%t", tt.id, err, tt.ok)
		}
	}
}

func TestPublishRecords(t *testing.T) {
	var v Volume
	now := time.Now()
	v.SetPublished("b", false, now)
	v.SetPublished("a", true, now)
	v.SetPublished("b", true, now) // replaces b's record
	if got := v.PublishedNodes(); !reflect.DeepEqual(got, []string{"a", "b"}) {
		t.Fatalf("PublishedNodes = %v", got)
	}
	if r, ok := v.PublishedTo("b"); !ok || !r.ReadOnly {
		t.Fatalf("PublishedTo(b) = %+v %t", r, ok)
	}
	v.ClearPublished("a")
	v.ClearPublished("a")
	if got := v.PublishedNodes(); !reflect.DeepEqual(got, []string{"b"}) {
		t.Fatalf("after clearing a: %v", got)
	}
	v.ClearPublished("")
	if v.Published != nil {
		t.Fatalf("clearing all left %v", v.Published)
	}
}

func TestNodeRegistry(t *testing.T) {
	p, err := Open(Config{Name: "p", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := p.Publications().NodeRegistered("node-1"); ok || err != nil {
		t.Fatalf("unregistered node: %t %v", ok, err)
	}
	if err := p.Publications().RegisterNode("node-1", map[string]string{"k": "v"}, 0); err != nil {
		t.Fatal(err)
	}
	if ok, err := p.Publications().NodeRegistered("node-1"); !ok || err != nil {
		t.Fatalf("registered node: %t %v", ok, err)
	}
	if _, err := p.Publications().NodeRegistered("../pool"); !errors.Is(err, ErrInvalidID) {
		t.Fatalf("a path-like node ID was looked up: %v", err)
	}
	if err := p.Publications().RegisterNode("../../etc", nil, 0); !errors.Is(err, ErrInvalidID) {
		t.Fatalf("a path-like node ID was registered: %v", err)
	}
}

// TestRequireMount: a pool that must be a mount point is never laid out on the
// empty directory underneath, and refuses volumes until mounted.
func TestRequireMount(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	os.Mkdir(dir, 0o755)
	p, err := Open(Config{Name: "p", Path: dir, Shared: true, RequireMount: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Check(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Check = %v, want unavailable", err)
	}
	if _, err := p.Reserve(t.Context(), Spec{Name: "v", Layout: LayoutDir, AccessType: AccessBlock, CapacityBytes: MiB}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Reserve = %v, want unavailable", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("the unmounted mount point got %v", entries)
	}
}
