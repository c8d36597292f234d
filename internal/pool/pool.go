// Package pool is the on-disk layout of a poolcsi pool: volume IDs, volume.json,
// image files, capacity accounting, listing and cross-process locks. It knows
// nothing of gRPC or mounts, so operator tools can read a pool without a driver.
package pool

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

const (
	volumesDir = "volumes"
	poolMeta   = "pool.json"
	poolLock   = ".lock"
)

// Config describes one pool as the operator configured it.
type Config struct {
	Name string `json:"name"`
	Path string `json:"path"`
	// Shared pools are mounted on every node; local pools exist on one node only.
	Shared bool `json:"shared,omitempty"`
	// Overcommit is how many bytes of sparse capacity may be promised per free byte
	// of the pool's filesystem. 1 (the default) never promises more than it has.
	Overcommit float64 `json:"overcommit,omitempty"`
	// RequireMount says the pool path must be a mount point. Until something is
	// mounted there the pool is unavailable, so volumes never land on the node's
	// root disk under an empty mount point. Set by the config's mount stanza.
	RequireMount bool `json:"requireMount,omitempty"`
	// Ephemeral allows (true) or forbids (false) CSI ephemeral inline
	// volumes in the pool; unset, local pools allow them and shared pools
	// do not (AllowsEphemeral).
	Ephemeral *bool `json:"ephemeral,omitempty"`
	// Share is the share a StorageClass named, for the pool the driver keeps
	// on it; nil for an operator-configured pool. Its volume IDs carry it.
	Share *ShareRef `json:"-"`
	// NoLayout forbids laying the pool out by itself (Check, Open): only an
	// explicit LayOut does. A share mounted because a volume ID named it is
	// not trusted to be a pool until its pool.json says so.
	NoLayout bool `json:"-"`
}

// Pool is an opened pool directory.
type Pool struct {
	// cfg is fixed at Open: callers read it through Name, Path, Shared and
	// Config, so no one can flip a pool from local to shared under the driver.
	cfg Config
	// share is the encoded ShareRef its volume IDs carry ("" for a configured pool).
	share string
	// keys and snapKeys cache the sorted volume and snapshot keys, for
	// listing in pages (list.go).
	keys, snapKeys keyCache
	// node names this process's node in the lock files it takes (WithNode).
	node string
	// meta caches parsed volume.json files for capacity accounting, by key
	// (loadForUsage).
	meta sync.Map
	// capacity caches what GetCapacity measures of the images (capacity.go).
	capacity capacityCache
	// trash is what deletes left for the trash's emptier (trash.go).
	trash trashQueue
	// reserve is this process's view of the pool's reserve file (reserve.go).
	reserve reserveState
	// ledgerKeysP signs the ledger (Ledger().SetKeys); ledgerSeq is the
	// highest ledger write seen here (ledger.go).
	ledgerKeysP atomic.Pointer[[][]byte]
	ledgerSeq   atomic.Uint64
	// indexed is set once the per-node publish index is known to exist
	// (Publications().EnsureIndex).
	indexed atomic.Bool
	// quotaIndexed is set once the quota ID index is known to exist
	// (QuotaIDs().ensureIndex).
	quotaIndexed atomic.Bool
	// openWait bounds Open's wait for the filesystem (WithOpenWait);
	// opened is what Open's layout found (OpenError).
	openWait time.Duration
	opened   atomic.Pointer[openOutcome]
	openDone chan struct{} // closed when Open's layout returned
	// seen is the pool.json this process first saw at the pool's path (nil:
	// none yet). A pool that showed itself is never laid out again by this
	// process, and a pool.json of another uid is another pool (init,
	// readMeta): a path that stops showing the pool is the pool lost (its
	// filesystem covered, unmounted, replaced), never a pool mounted late.
	// Nothing of it is kept on disk: a new process starts without it, and a
	// pool deliberately wiped and laid out again is served by the next one.
	seen atomic.Pointer[seenPool]
	// layoutMu serialises this process's late layouts, so that two checks
	// at once never write two uids.
	layoutMu sync.Mutex
	// layoutGuard, if set, is asked before a layout the pool makes by itself
	// or by LayOut (WithLayoutGuard).
	layoutGuard atomic.Pointer[func() error]
}

// seenPool is what this process saw of the pool's pool.json.
type seenPool struct{ uid string }

// Option sets up a pool at Open with what its configuration does not hold.
type Option func(*Pool)

// WithNode names this process's node in the lock files the pool takes, so an
// operator (and a node that finds a lock held) can tell whose it is.
func WithNode(node string) Option { return func(p *Pool) { p.node = node } }

// WithLayoutGuard makes the pool ask guard before it lays itself out (a pool
// that never showed itself to this process: Open, Check, LayOut); an error
// keeps the pool unavailable and nothing is written. The node plugin's guard
// refuses while this node's own records hold loop devices attached from
// images of the pool (fence.LayoutGuard): the pool was there, so a path
// without pool.json is the pool lost, after a restart as well.
func WithLayoutGuard(guard func() error) Option {
	return func(p *Pool) { p.SetLayoutGuard(guard) }
}

// SetLayoutGuard is WithLayoutGuard on an opened pool (nil: none).
func (p *Pool) SetLayoutGuard(guard func() error) {
	if guard == nil {
		p.layoutGuard.Store(nil)
		return
	}
	p.layoutGuard.Store(&guard)
}

// Open validates cfg and makes the pool's layout. A local pool's directory is
// created if missing; a shared pool's directory is a mount point the admin (or the
// driver's mount stanza) provides, so it is never created here — creating it would
// quietly put "shared" volumes on the node's root disk.
//
// Only a configuration that can never work is an error. Whatever the pool's
// filesystem does — its path a dead mount point (ENOTCONN, EIO, ESTALE), missing,
// covered, unreadable, holding a damaged pool.json, or not answering at all —
// leaves the pool unavailable, not the caller without it: Check says why, and
// lays the pool out once it answers. A node plugin must not die on one pool it
// cannot use, least of all before its start-up fence is done (docs/fencing.md).
// Nothing is created through a path whose stat failed with anything but
// ENOENT: a dead FUSE mount point stats with an error and mkdirs with EEXIST.
func Open(cfg Config, opts ...Option) (*Pool, error) {
	if err := ValidatePoolName(cfg.Name); err != nil {
		return nil, err
	}
	if !filepath.IsAbs(cfg.Path) || filepath.Clean(cfg.Path) != cfg.Path || cfg.Path == "/" {
		return nil, fmt.Errorf("pool %s: path %q must be a clean absolute path other than /", cfg.Name, cfg.Path)
	}
	if cfg.Overcommit == 0 {
		cfg.Overcommit = 1
	}
	if cfg.Overcommit < 0 {
		return nil, fmt.Errorf("pool %s: overcommit %v must be positive", cfg.Name, cfg.Overcommit)
	}
	if cfg.Share != nil {
		if err := cfg.Share.Validate(); err != nil {
			return nil, err
		}
		if cfg.Share.PoolName() != cfg.Name {
			return nil, fmt.Errorf("pool %s: the pool of share %s is named %s", cfg.Name, cfg.Share, cfg.Share.PoolName())
		}
	}
	p := &Pool{cfg: cfg}
	for _, o := range opts {
		o(p)
	}
	if cfg.Share != nil {
		p.share = cfg.Share.payload()
	}
	p.openDone = make(chan struct{})
	if p.openWait <= 0 {
		p.opened.Store(&openOutcome{err: p.layOutAtOpen()})
		close(p.openDone)
		return p, nil
	}
	// A filesystem that does not answer (a FUSE daemon stopped, a hard NFS
	// mount whose server is gone) blocks the stat itself, for as long as it
	// hangs: the caller gets the pool after wait, unavailable until it
	// answers; the layout goes on meanwhile, as a Check would.
	p.opened.Store(&openOutcome{err: fmt.Errorf("%w: pool %s: %s has not answered since the pool was opened (waited %s; a filesystem that hangs, such as a FUSE daemon stopped or a hard NFS mount whose server is gone)", ErrUnavailable, cfg.Name, cfg.Path, p.openWait), pending: true})
	go func() {
		defer close(p.openDone)
		p.opened.Store(&openOutcome{err: p.layOutAtOpen()})
	}()
	select {
	case <-p.openDone:
	case <-time.After(p.openWait):
	}
	return p, nil
}

// awaitOpen waits, at most the open's wait again, for an Open whose layout
// had not returned: a filesystem that is slow (a CephFS revoking another
// client's capabilities takes seconds) is then used as soon as it answers,
// and one that hangs costs each caller a bounded wait, never the hang.
func (p *Pool) awaitOpen() error {
	if !p.OpenPending() {
		return nil
	}
	select {
	case <-p.openDone:
		return nil
	case <-time.After(p.openWait):
		return p.OpenError()
	}
}

// Opened is closed once Open's layout has returned (at once, unless the
// pool's filesystem did not answer within WithOpenWait).
func (p *Pool) Opened() <-chan struct{} { return p.openDone }

// WithOpenWait bounds how long Open waits for the pool's filesystem: after
// wait, Open returns the pool, unavailable until the filesystem answers
// (OpenError). Zero: Open waits as long as the filesystem takes.
func WithOpenWait(wait time.Duration) Option { return func(p *Pool) { p.openWait = wait } }

// openOutcome is what Open's layout found (OpenError).
type openOutcome struct {
	err error
	// pending: the layout had not returned when Open did.
	pending bool
}

// OpenError is why Open left the pool unavailable, wrapping ErrUnavailable
// (nil: the pool was there and laid out). Check finds the same again; this
// is for the start's log.
func (p *Pool) OpenError() error {
	if o := p.opened.Load(); o != nil {
		return o.err
	}
	return nil
}

// OpenPending tells whether Open's layout has not returned yet: the pool's
// filesystem did not answer within WithOpenWait and still does not. Until it
// does, Check and every listing wait for it at most the open's wait again,
// then fail with OpenError instead of hanging behind it.
func (p *Pool) OpenPending() bool {
	o := p.opened.Load()
	return o != nil && o.pending
}

// layOutAtOpen is Open's part on the filesystem: it creates a missing local
// pool's directory and lays the pool out where it may. It never fails the
// Open: what it returns (wrapping ErrUnavailable) is why the pool is
// unavailable, which Check finds again.
func (p *Pool) layOutAtOpen() error {
	cfg := p.cfg
	st, err := statPath(cfg.Path)
	switch {
	case err == nil && !st.IsDir():
		return fmt.Errorf("%w: pool %s: %s is not a directory", ErrUnavailable, cfg.Name, cfg.Path)
	case err == nil:
	case errors.Is(err, unix.ENOENT) && !cfg.Shared:
		if err := mkdirMissing(cfg.Path); err != nil {
			return fmt.Errorf("%w: pool %s: create its directory: %w", ErrUnavailable, cfg.Name, err)
		}
	case errors.Is(err, unix.ENOENT):
		// A shared pool's directory is never made here: Probe reports it
		// until it appears.
		return fmt.Errorf("%w: shared pool %s: %s is missing (is the share mounted?): %w", ErrUnavailable, cfg.Name, cfg.Path, err)
	default:
		// A dead mount point (ENOTCONN, EIO, ESTALE), a path it may not
		// look at (EACCES), a file on the way (ENOTDIR), a loop of links:
		// the directory may well be there, and nothing is made through it.
		return fmt.Errorf("%w: pool %s: %s cannot be looked at (a dead mount, or no access): %w", ErrUnavailable, cfg.Name, cfg.Path, err)
	}
	if err := p.mountReady(); err != nil {
		return err
	}
	// A pool whose pool.json is damaged or names another pool is
	// unavailable (Check says why), not fatal: on a shared pool anyone can
	// write that file, and one pool must never stop a driver.
	if err := p.init(p.mayInit()); err != nil {
		if !errors.Is(err, ErrUnavailable) {
			err = fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		return err
	}
	return nil
}

// statPath is os.Stat; tests make it fail as the kernel will not for root
// (EACCES) or hang.
var statPath = os.Stat

// mkdirMissing makes dir and the parents it lacks, like os.MkdirAll, but
// only below a parent that answered: a component whose stat fails with
// anything but ENOENT (a dead mount point, which mkdir answers with EEXIST)
// stops it with that error.
func mkdirMissing(dir string) error {
	st, err := statPath(dir)
	switch {
	case err == nil && st.IsDir():
		return nil
	case err == nil:
		return &os.PathError{Op: "mkdir", Path: dir, Err: unix.ENOTDIR}
	case !errors.Is(err, unix.ENOENT):
		return err
	}
	if parent := filepath.Dir(dir); parent != dir {
		if err := mkdirMissing(parent); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o750); err != nil {
		if errors.Is(err, unix.EEXIST) {
			// Made meanwhile, or a mount point that stopped answering:
			// only a directory that stats is one.
			if st, serr := os.Stat(dir); serr != nil || !st.IsDir() {
				return err
			}
			return nil
		}
		return err
	}
	return nil
}

// Initialise lays out a new pool at cfg.Path — the operator's one explicit step
// for a shared pool the admin mounts (poolcsi pool init). The directory is
// created when its parent exists; a missing parent is most likely a share that
// is not mounted, and is refused with what to do. It is idempotent, and refuses
// a directory that belongs to a pool of another name.
func Initialise(cfg Config) (*Pool, error) {
	if _, err := os.Stat(cfg.Path); missing(err) {
		parent := filepath.Dir(cfg.Path)
		if _, perr := os.Stat(parent); perr != nil {
			return nil, fmt.Errorf("pool %s: neither %s nor its parent %s exists: mount the share (or create the parent directory) first, then run pool init again", cfg.Name, cfg.Path, parent)
		}
		if err := os.Mkdir(cfg.Path, 0o750); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("pool %s: create %s: %w", cfg.Name, cfg.Path, err)
		}
	} else if err != nil {
		return nil, fmt.Errorf("pool %s: %s: %w", cfg.Name, cfg.Path, err)
	}
	p, err := Open(cfg)
	if err != nil {
		return nil, err
	}
	if err := p.init(true); err != nil {
		return nil, err
	}
	return p, nil
}

// LayOut lays out the pool if it has no pool.json yet: the driver's explicit
// step for the pool on a share a StorageClass names, which it mounted itself
// and checked before (see NoLayout).
func (p *Pool) LayOut() error { return p.init(true) }

// LaidOut tells whether the pool has its pool.json.
func (p *Pool) LaidOut() bool {
	_, err := os.Stat(filepath.Join(p.cfg.Path, poolMeta))
	return err == nil
}

// MountReady fails when the pool must be a mount point and is not.
func (p *Pool) MountReady() error { return p.mountReady() }

// IDOf is the ID of the volume with key in this pool (carrying the pool's
// share, if it is a share's).
func (p *Pool) IDOf(key string) VolumeID {
	return VolumeID{Pool: p.cfg.Name, Key: key, Share: p.share, ref: p.shareRef()}
}

// shareRef is the pool's share, the zero ShareRef for a configured pool.
func (p *Pool) shareRef() ShareRef {
	if p.cfg.Share == nil {
		return ShareRef{}
	}
	return *p.cfg.Share
}

// NewID is the ID of the volume named name in this pool.
func (p *Pool) NewID(name string) VolumeID { return p.IDOf(KeyForName(name)) }

// mayInit tells whether the driver may lay out this pool by itself. A shared
// pool that the admin mounts is laid out once, explicitly: an empty directory
// where the share should be mounted looks exactly like a new pool, and laying it
// out would put "shared" volumes on this node's own disk, where no other node
// sees them. A pool the driver mounts itself (mount stanza) is checked mounted
// first, so it may, unless NoLayout says only LayOut may.
func (p *Pool) mayInit() bool { return !p.cfg.NoLayout && (!p.cfg.Shared || p.cfg.RequireMount) }

type poolInfo struct {
	SchemaVersion int    `json:"schemaVersion"`
	Name          string `json:"name"`
	// UID is drawn at random when the pool is laid out: what tells this
	// pool from another of the same name laid out over its path (a
	// process that saw one refuses the other, readMeta). Pools laid out
	// before it have none.
	UID string `json:"uid,omitempty"`
	// Share is the share a pool on a share a StorageClass names is on, so
	// operator tools opening the directory know its volume IDs.
	Share *ShareRef `json:"share,omitempty"`
}

// readMeta reads and checks pool.json. A pool.json that is damaged, or names
// another pool, makes the pool unavailable (never the driver: Open does not fail
// on it), with what to do; a missing one is missing (errors.go).
func (p *Pool) readMeta() error {
	var info poolInfo
	metaPath := filepath.Join(p.cfg.Path, poolMeta)
	raw, err := p.files().readBeneath(poolMeta, maxPoolMeta)
	switch {
	case missing(err):
		return err
	case errors.Is(err, ErrUnavailable):
		return err
	case err != nil:
		return fmt.Errorf("%w: pool %s: %s cannot be read: %w", ErrUnavailable, p.cfg.Name, metaPath, err)
	}
	if err := json.Unmarshal(raw, &info); err != nil {
		return fmt.Errorf("%w: pool %s: %s is damaged (%w): restore it (it holds {\"schemaVersion\": %d, \"name\": %q})",
			ErrUnavailable, p.cfg.Name, metaPath, err, SchemaVersion, p.cfg.Name)
	}
	if info.Name != p.cfg.Name {
		return fmt.Errorf("%w: pool %s: %s belongs to pool %q; give it that name or use another directory", ErrUnavailable, p.cfg.Name, p.cfg.Path, info.Name)
	}
	return p.sawPool(info.UID)
}

// sawPool remembers the uid of the first pool.json this process saw, and
// fails (ErrUnavailable) on one of another uid, or none where one was seen:
// another pool of the name now shows at the path, over or instead of the one
// this process served. Its volumes are not the ones this node has attached,
// and a lease renewed there renews nothing the pool's other nodes read.
func (p *Pool) sawPool(uid string) error {
	s := p.seen.Load()
	if s == nil {
		if p.seen.CompareAndSwap(nil, &seenPool{uid: uid}) {
			return nil
		}
		s = p.seen.Load()
	}
	if s.uid == uid {
		return nil
	}
	return fmt.Errorf("%w: pool %s: %s shows another pool of the name (uid %q; this process served uid %q): the pool's filesystem was covered (another mount over the path) or replaced; nothing is written there. Restore the pool's filesystem at the path; a pool deliberately laid out anew is served once the node plugin restarts",
		ErrUnavailable, p.cfg.Name, p.cfg.Path, uid, s.uid)
}

// errLost is why a pool that showed itself to this process and shows no
// pool.json now is not laid out again.
func (p *Pool) errLost() error {
	return fmt.Errorf("%w: pool %s: %s shows no %s, but this process served the pool there: its filesystem is gone from the path (unmounted, covered by another mount, the export replaced by an empty one); the pool is lost, not late, and nothing is laid out or written there. Restore the pool's filesystem at the path; a pool deliberately wiped is laid out again once the node plugin restarts",
		ErrUnavailable, p.cfg.Name, p.cfg.Path, poolMeta)
}

// newPoolUID is a new pool's uid.
func newPoolUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// init writes pool.json once and refuses a directory that already belongs to a
// pool of another name: two names over one directory would double-count capacity
// and give one volume two IDs.
func (p *Pool) init(may bool) error {
	err := p.readMeta()
	switch {
	case err == nil:
		if err := p.mkdirVolumes(); err != nil {
			return err
		}
		return nil
	case missing(err):
		// A pool this process saw is never laid out again: laying it out
		// would put volumes, and the lease that keeps the self-fence
		// quiet, on whatever covers its filesystem, while this node's
		// loop devices still write the real one.
		if p.seen.Load() != nil {
			return p.errLost()
		}
		if !may {
			if p.cfg.Share != nil {
				return fmt.Errorf("%w: share %s mounted at %s holds no poolcsi pool (no %s)", ErrUnavailable, p.cfg.Share, p.cfg.Path, poolMeta)
			}
			return fmt.Errorf("%w: shared pool %s: %s has no %s — the share is not mounted on this node, or the pool was never initialised (then run, once: poolcsi pool init --path %s --name %s)",
				ErrUnavailable, p.cfg.Name, p.cfg.Path, poolMeta, p.cfg.Path, p.cfg.Name)
		}
		return p.layOut()
	default:
		return err
	}
}

// layOut writes a new pool.json (with a new uid) where none is, once: under
// layoutMu, after the guard, and never over one another process (another
// node's) wrote meanwhile, which is then the pool this process saw.
func (p *Pool) layOut() error {
	p.layoutMu.Lock()
	defer p.layoutMu.Unlock()
	if err := p.readMeta(); !missing(err) {
		if err != nil {
			return err
		}
		return p.mkdirVolumes()
	}
	if p.seen.Load() != nil {
		return p.errLost()
	}
	if g := p.layoutGuard.Load(); g != nil {
		if err := (*g)(); err != nil {
			if !errors.Is(err, ErrUnavailable) {
				err = fmt.Errorf("%w: pool %s: not laid out at %s: %w", ErrUnavailable, p.cfg.Name, p.cfg.Path, err)
			}
			return err
		}
	}
	if err := p.mkdirVolumes(); err != nil {
		return err
	}
	uid := newPoolUID()
	raw, _ := json.Marshal(poolInfo{SchemaVersion: SchemaVersion, Name: p.cfg.Name, UID: uid, Share: p.cfg.Share})
	err := unsafe(fsx.CreateFileAtomic(p.cfg.Path, poolMeta, append(raw, '\n'), true))
	if errors.Is(err, fs.ErrExist) {
		// Laid out meanwhile by another node (every node of a mount
		// stanza lays a new share out at once): that is the pool.
		return p.readMeta()
	}
	if err != nil {
		return fmt.Errorf("pool %s: write %s: %w", p.cfg.Name, filepath.Join(p.cfg.Path, poolMeta), err)
	}
	return p.sawPool(uid)
}

// mkdirVolumes makes the pool's volumes directory if it is missing: one
// mkdir below the pool's root, which just answered. Never MkdirAll: a root
// that stopped answering since stats with an error, and MkdirAll would
// "create" it (EEXIST, and the start failed on it).
func (p *Pool) mkdirVolumes() error {
	dir := filepath.Join(p.cfg.Path, volumesDir)
	st, err := os.Stat(dir)
	switch {
	case err == nil && st.IsDir():
		return nil
	case err == nil:
		return fmt.Errorf("%w: pool %s: %s is not a directory", ErrUnavailable, p.cfg.Name, dir)
	case !errors.Is(err, unix.ENOENT):
		return fmt.Errorf("%w: pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	if err := os.Mkdir(dir, 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("%w: pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		if err == nil {
			err = &os.PathError{Op: "mkdir", Path: dir, Err: unix.ENOTDIR}
		}
		return fmt.Errorf("%w: pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	return nil
}

// Check tells whether the pool can serve requests now: present, initialised and
// writable. It costs a few system calls, so Probe can call it every few seconds.
// Every error it returns wraps ErrUnavailable (and never ErrNotFound: a missing
// pool directory is an unavailable pool, not a missing volume).
func (p *Pool) Check() error {
	if err := p.awaitOpen(); err != nil {
		// Its filesystem has not answered since Open: every look at it
		// would hang the caller (a start, a Probe) behind Open's.
		return err
	}
	if err := p.check(); err != nil {
		if errors.Is(err, ErrUnavailable) {
			return err
		}
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return nil
}

func (p *Pool) check() error {
	vols := filepath.Join(p.cfg.Path, volumesDir)
	if _, err := os.Stat(p.cfg.Path); err != nil {
		return fmt.Errorf("pool %s: directory %s is missing (is the pool's filesystem mounted?): %w", p.cfg.Name, p.cfg.Path, err)
	}
	if err := p.mountReady(); err != nil {
		return err
	}
	if err := p.readMeta(); missing(err) {
		// A pool that appeared after start-up (a share mounted late): lay it out
		// now if the driver may, or say why not.
		if err := p.init(p.mayInit()); err != nil {
			return err
		}
	} else if err != nil {
		return err
	}
	if err := unix.Access(vols, unix.W_OK); err != nil {
		return fmt.Errorf("pool %s: %s is not writable (read-only filesystem or permissions): %w", p.cfg.Name, vols, err)
	}
	return nil
}

// mountReady fails when the pool must be a mount point and is not.
func (p *Pool) mountReady() error {
	if !p.cfg.RequireMount {
		return nil
	}
	mounted, err := mountinfo.Mounted(p.cfg.Path)
	if err != nil {
		return fmt.Errorf("pool %s: %w: cannot tell whether %s is mounted: %w", p.cfg.Name, ErrUnavailable, p.cfg.Path, err)
	}
	if !mounted {
		return fmt.Errorf("pool %s: %w: %s is not mounted yet", p.cfg.Name, ErrUnavailable, p.cfg.Path)
	}
	return nil
}

// Entry is one listed volume: its metadata, or the error that kept it from loading,
// so one damaged volume never hides the others.
type Entry struct {
	ID     VolumeID
	Volume *Volume
	Err    error
	// image is the image's stat, taken with the listing's other reads (a
	// health check per listed volume then costs no open of the pool's root);
	// nil when not taken.
	image *imageStat
}

type imageStat struct {
	size, allocated int64
	err             error
}

// EntryStat is Stat of a listed volume: the stat the listing took
// with its record, or a new one.
func (im Images) EntryStat(e Entry) (size, allocated int64, err error) {
	if e.image != nil {
		return e.image.size, e.image.allocated, e.image.err
	}
	return im.Stat(e.ID)
}

// loadListed loads a volume found in the volumes directory. A directory
// without volume.json is left out while it is on its way in or out: deleted
// since the directory was read, or made by a create, here or on another node,
// that has not written its metadata yet (changing). Otherwise it is listed
// (with its image's stat when read through a tree t, which may be nil)
// with the error: metadata that is gone is damage an operator must hear of.
func (p *Pool) loadListed(t *fsx.Tree, id VolumeID) (Entry, bool) {
	v, err := p.loadIn(t, id)
	if missing(err) {
		if !p.VolumeExists(id) || p.files().changing() {
			return Entry{}, false
		}
		v, err = p.loadIn(t, id) // the create may have finished between the two looks
	}
	e := Entry{ID: id, Volume: v, Err: err}
	if t != nil && err == nil && v.Layout == LayoutImage {
		e.image = p.Images().statIn(t, id)
	}
	return e, true
}

// statIn is Stat through a tree of the pool opened for a batch.
func (im Images) statIn(t *fsx.Tree, id VolumeID) *imageStat {
	st, err := t.Stat(volumeRel(id, imageFile), false)
	if err != nil {
		return &imageStat{err: fmt.Errorf("volume %s: image: %w", id, notFound(im.p.files().classify(err)))}
	}
	return &imageStat{size: st.Size, allocated: st.Blocks * 512}
}

// List returns the pool's volumes sorted by ID.
func (p *Pool) List() ([]Entry, error) {
	des, err := p.files().readDir(volumesDir)
	if err != nil {
		return nil, fmt.Errorf("%w: list pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	t, err := fsx.OpenTree(p.cfg.Path)
	if err != nil {
		return nil, fmt.Errorf("%w: list pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	defer t.Close()
	var out []Entry
	for _, de := range des {
		if !de.IsDir() || !keyRE.MatchString(de.Name()) {
			continue // temp files and volumes being deleted
		}
		if e, ok := p.loadListed(t, p.IDOf(de.Name())); ok {
			// Callers check entries at their own pace: an image is looked
			// at when it is checked, not when it was listed.
			e.image = nil
			out = append(out, e)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID.Key < out[j].ID.Key })
	return out, nil
}

// Name is the pool's name, as configured.
func (p *Pool) Name() string { return p.cfg.Name }

// Path is the pool's directory.
func (p *Pool) Path() string { return p.cfg.Path }

// Shared tells whether the pool is on a filesystem every node mounts.
func (p *Pool) Shared() bool { return p.cfg.Shared }

// Config is a copy of the pool's configuration.
func (p *Pool) Config() Config {
	c := p.cfg
	if c.Share != nil {
		s := *c.Share
		c.Share = &s
	}
	return c
}

// AllowsEphemeral tells whether the pool takes CSI ephemeral inline volumes.
func (p *Pool) AllowsEphemeral() bool { return p.cfg.AllowsEphemeral() }
