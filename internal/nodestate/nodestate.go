// Package nodestate keeps a node plugin's own records, outside every pool.
//
// What a node must know about itself when a pool stops answering, or after a
// restart of its plugin, cannot live in the pool: a node that lost a shared
// pool cannot read it, and anyone on any node may have written it. The fence
// must find the loop devices of a pool the node can no longer resolve, and
// crash recovery of a freeze must act on what this node froze, not on what a
// pool record names. So the node writes those facts here, on its own root
// filesystem (a hostPath in the chart), where only this node plugin writes:
// `<dir>/<node>/<kind>/<key>.json`, each replaced atomically (temp file,
// fsync, rename, fsync of the directory) and read through the bounded reader
// (no links, no FIFOs, a size cap). The node ID is part of the path so that
// two node plugins on one machine (the tests) keep apart.
//
// An empty directory keeps the records in memory only: for unit tests and the
// demo, never for a node plugin that serves a shared pool in production.
package nodestate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// maxRecord caps what one record may be read as; records are small.
const maxRecord = 1 << 20

// ErrBadName is returned for a kind or key that is not a plain name.
var ErrBadName = errors.New("not a plain record name")

// Store is one node's record store.
type Store struct {
	root string // <dir>/<node>; "" keeps records in memory

	mu  sync.Mutex
	mem map[string]map[string][]byte // kind → key → JSON
}

// Open returns the store of node below dir, making its directories (0700).
// An empty dir keeps the records in memory only.
func Open(dir, node string) (*Store, error) {
	s := &Store{mem: map[string]map[string][]byte{}}
	if dir == "" {
		return s, nil
	}
	if err := checkName(node); err != nil {
		return nil, fmt.Errorf("node-local state for node %q: %w", node, err)
	}
	s.root = filepath.Join(dir, node)
	if err := os.MkdirAll(s.root, 0o700); err != nil {
		return nil, fmt.Errorf("node-local state: %w", err)
	}
	if err := fsx.CheckDir(dir, node); err != nil {
		return nil, fmt.Errorf("node-local state: %w", err)
	}
	return s, nil
}

// Memory is a store that keeps its records in memory only.
func Memory() *Store { s, _ := Open("", ""); return s }

// Dir is where the records live ("" in memory).
func (s *Store) Dir() string { return s.root }

// checkName allows plain file names only: letters, digits, '.', '_', '-', ':'
// and '@', not starting with '.', at most 200 bytes.
func checkName(n string) error {
	if n == "" || len(n) > 200 || n[0] == '.' {
		return fmt.Errorf("%w: %q", ErrBadName, n)
	}
	for _, c := range n {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.ContainsRune("._-:@", c):
		default:
			return fmt.Errorf("%w: %q", ErrBadName, n)
		}
	}
	return nil
}

func check(kind, key string) error {
	if err := checkName(kind); err != nil {
		return err
	}
	return checkName(key)
}

// Put replaces the record kind/key with v as JSON, durably.
func (s *Store) Put(kind, key string, v any) error {
	if err := check(kind, key); err != nil {
		return err
	}
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("node-local record %s/%s: %w", kind, key, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.root == "" {
		if s.mem[kind] == nil {
			s.mem[kind] = map[string][]byte{}
		}
		s.mem[kind][key] = data
		return nil
	}
	if err := os.MkdirAll(filepath.Join(s.root, kind), 0o700); err != nil {
		return fmt.Errorf("node-local record %s/%s: %w", kind, key, err)
	}
	if err := fsx.WriteFileAtomic(s.root, filepath.Join(kind, key+".json"), data, true); err != nil {
		return fmt.Errorf("node-local record %s/%s: %w", kind, key, err)
	}
	return nil
}

// Get reads the record kind/key into v; false if there is none.
func (s *Store) Get(kind, key string, v any) (bool, error) {
	if err := check(kind, key); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var data []byte
	if s.root == "" {
		d, ok := s.mem[kind][key]
		if !ok {
			return false, nil
		}
		data = d
	} else {
		d, err := fsx.ReadFile(s.root, filepath.Join(kind, key+".json"), maxRecord)
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("node-local record %s/%s: %w", kind, key, err)
		}
		data = d
	}
	if err := json.Unmarshal(data, v); err != nil {
		return false, fmt.Errorf("node-local record %s/%s: %w", kind, key, err)
	}
	return true, nil
}

// Delete removes the record kind/key; a missing record is no error.
func (s *Store) Delete(kind, key string) error {
	if err := check(kind, key); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.root == "" {
		delete(s.mem[kind], key)
		return nil
	}
	d, err := fsx.OpenDir(s.root, kind)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("node-local record %s/%s: %w", kind, key, err)
	}
	defer d.Close()
	if err := removeAt(d, key+".json"); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("node-local record %s/%s: %w", kind, key, err)
	}
	if err := d.Sync(); err != nil {
		return fmt.Errorf("node-local record %s/%s: fsync: %w", kind, key, err)
	}
	return nil
}

// Keys lists the keys of kind, sorted.
func (s *Store) Keys(kind string) ([]string, error) {
	if err := checkName(kind); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	if s.root == "" {
		for k := range s.mem[kind] {
			out = append(out, k)
		}
	} else {
		ents, err := fsx.ReadDir(s.root, kind)
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("node-local records %s: %w", kind, err)
		}
		for _, e := range ents {
			n := e.Name()
			if !e.Type().IsRegular() || fsx.IsTemp(n) || !strings.HasSuffix(n, ".json") {
				continue
			}
			if k := strings.TrimSuffix(n, ".json"); checkName(k) == nil {
				out = append(out, k)
			}
		}
	}
	sort.Strings(out)
	return out, nil
}
