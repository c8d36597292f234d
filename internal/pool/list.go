package pool

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// Listing in pages costs what the page returns, not the whole pool: the sorted
// names of the volumes directory are cached and read again only when the
// directory changed (one stat tells: its mtime and ctime move with every entry
// created, renamed or removed, here or on another node of a shared pool), and
// only the volumes of the page (plus the one after, for the next token) have
// their volume.json read.

// keyCache is the sorted volume keys of the pool's volumes directory, valid
// while the directory's change times are the ones recorded.
type keyCache struct {
	mu           sync.Mutex
	mtime, ctime unix.Timespec
	ino          uint64
	keys         []string
	// stable: when the directory was read, its last change was already
	// settleTime old. Timestamps are coarse (a jiffy) and, on a shared
	// filesystem, set by another clock: a change in the same tick as the one
	// recorded would leave the times equal, so a listing read that soon after a
	// change is not reused.
	stable bool
}

// settleTime is how old a directory's last change must be, when it is read,
// for the listing to be reused while its times stay the same.
const settleTime = 2 * time.Second

// volumeKeys returns the pool's volume keys, sorted. The slice is shared:
// callers do not modify it.
func (p *Pool) volumeKeys() ([]string, error) {
	return p.keys.load(p.cfg.Name, filepath.Join(p.cfg.Path, volumesDir))
}

// keys is volumeKeys for snapshots; no snapshots directory is none.
func (ss Snapshots) keys() ([]string, error) {
	dir := filepath.Join(ss.p.cfg.Path, snapshotsDir)
	if _, err := os.Lstat(dir); missing(err) {
		return nil, nil
	}
	return ss.p.snapKeys.load(ss.p.cfg.Name, dir)
}

// load returns the sorted keys of dir, the directory of pool's volumes or
// snapshots, read again only when it changed.
func (c *keyCache) load(pool, dir string) ([]string, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return nil, fmt.Errorf("%w: list pool %s: %w", ErrUnavailable, pool, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.keys != nil && c.stable && c.mtime == st.Mtim && c.ctime == st.Ctim && c.ino == st.Ino {
		return c.keys, nil
	}
	readAt := time.Now()
	names, err := readNames(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: list pool %s: %w", ErrUnavailable, pool, err)
	}
	keys := names[:0]
	for _, n := range names {
		if keyRE.MatchString(n) {
			keys = append(keys, n)
		}
	}
	sort.Strings(keys)
	c.keys, c.mtime, c.ctime, c.ino = keys, st.Mtim, st.Ctim, st.Ino
	c.stable = readAt.Sub(time.Unix(st.Ctim.Unix())) > settleTime && readAt.Sub(time.Unix(st.Mtim.Unix())) > settleTime
	return keys, nil
}

// ListPage returns, in key order from the key from (inclusive; "" for the
// start), up to limit entries (0: all) that keep accepts, and the key of the
// next entry keep accepts after them ("" at the end), which is where the next
// page starts. A volume created or deleted between pages is listed or not,
// but no other volume is missed or repeated, whatever controller of a shared
// pool serves the next page. keep sees entries whose metadata loaded and
// damaged ones (Err set).
func (p *Pool) ListPage(from string, limit int, keep func(Entry) bool) ([]Entry, string, error) {
	keys, err := p.volumeKeys()
	if err != nil {
		return nil, "", err
	}
	// The pool's root is opened once for the page, not once per file.
	t, err := fsx.OpenTree(p.cfg.Path)
	if err != nil {
		return nil, "", fmt.Errorf("%w: list pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	defer t.Close()
	entries, next := page(keys, from, limit, func(key string) (Entry, bool) {
		return p.loadListed(t, p.IDOf(key))
	}, keep)
	return entries, next, nil
}

// page walks sorted keys from from, loading each (load says false for one
// that is gone), and collects up to limit entries keep accepts, returning the
// key of the next accepted one ("" at the end).
func page[E any](keys []string, from string, limit int, load func(key string) (E, bool), keep func(E) bool) (out []E, next string) {
	for i := sort.SearchStrings(keys, from); i < len(keys); i++ {
		e, ok := load(keys[i])
		if !ok || !keep(e) {
			continue
		}
		if limit > 0 && len(out) == limit {
			return out, keys[i]
		}
		out = append(out, e)
	}
	return out, ""
}

// ListPage is Pool.ListPage for snapshots.
func (ss Snapshots) ListPage(from string, limit int, keep func(SnapshotEntry) bool) ([]SnapshotEntry, string, error) {
	keys, err := ss.keys()
	if err != nil {
		return nil, "", err
	}
	entries, next := page(keys, from, limit, func(key string) (SnapshotEntry, bool) {
		return ss.loadListed(ss.IDOf(key))
	}, keep)
	return entries, next, nil
}

// readNames lists a directory's entry names, unsorted. The directory itself
// must not be a link, nor anything but a directory (a FIFO would block the open).
func readNames(dir string) ([]string, error) {
	f, err := fsx.OpenDir(filepath.Dir(dir), filepath.Base(dir))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return f.Readdirnames(-1)
}
