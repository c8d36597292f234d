package pool

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// The capacity ledger lets a create, growth or snapshot be admitted without
// reading every volume of the pool: <pool>/ledger.json holds the sums that
// admission needs (volumes and their capacities, snapshots and the bytes
// reflinked ones share), kept under the pool lock with every change. It is
// derived data: the records (volume.json, snapshot.json) stay the truth, and
// the ledger is rebuilt from them whenever it cannot be trusted:
//
//   - missing, not a regular file, too large, unparsable, a checksum or a
//     sanity check that fails: damage, rebuilt;
//   - older than the pool's records: it holds a stamp (inode, times, link
//     count, size) of the volumes and snapshots directories as they were when
//     it was written; every create or delete changes them, so a create or
//     delete the ledger does not know of (a crash between the directory change
//     and the ledger write, an older driver) shows as a stamp that does not
//     match, and the ledger is rebuilt;
//   - a change that does not touch those directories (a growth, a reserved
//     volume whose volume.json is not written yet, a snapshot filled) is
//     written to the ledger first, as its pending entry, then to the record.
//     The next transaction settles the pending entry by reading that one
//     record: a crash between the two is undone, with no scan.
//
// Admission from the ledger is conservative: it counts every volume's whole
// capacity as unbacked (as if no image had a block allocated), which is never
// less than the truth. When that bound would refuse, the pool is measured
// exactly, as before the ledger existed, and the ledger is checked against that
// measurement (and repaired) before anything is refused: a ledger can make a
// create cost a scan, never admit one the pool cannot back.

const (
	ledgerFile    = "ledger.json"
	trashDir      = "trash"
	maxLedger     = 16 << 10
	ledgerVersion = 1
)

// Ledger is the pool's capacity accounting: the ledger above, the
// measurements of the pool (Usage, Capacity) and the admission decisions made
// from them under the pool lock, and the reserve (reserve.go).
type Ledger struct{ p *Pool }

// Ledger is the pool's capacity accounting.
func (p *Pool) Ledger() Ledger { return Ledger{p} }

// errLedgerStale marks a ledger older than the pool's directories.
var errLedgerStale = errors.New("ledger is older than the pool's records")

// errLedgerKeyed marks a ledger signed with a share key this process does not
// have (pool check run without --share-key-file): not verifiable here, so never
// trusted, but not damage either.
var errLedgerKeyed = errors.New("ledger is signed with a share key this process does not have")

// dirStamp identifies one state of a directory's entries.
type dirStamp struct {
	Ino   uint64 `json:"ino,omitempty"`
	Mtime int64  `json:"mtime,omitempty"`
	Ctime int64  `json:"ctime,omitempty"`
	Nlink uint64 `json:"nlink,omitempty"`
	Size  int64  `json:"size,omitempty"`
}

// pending is the one change the ledger counts ahead of its record: the record
// of Kind ("volume" or "snapshot") Key is meant to exist, counting Bytes
// (a volume's capacity, a snapshot's reflinked bytes).
type pending struct {
	Kind  string `json:"kind,omitempty"`
	Key   string `json:"key,omitempty"`
	Bytes int64  `json:"bytes,omitempty"`
}

const (
	pendingVolume   = "volume"
	pendingSnapshot = "snapshot"
)

// ledger is the content of ledger.json.
type ledger struct {
	Version          int      `json:"version"`
	Volumes          int64    `json:"volumes"`
	ProvisionedBytes int64    `json:"provisionedBytes"`
	Snapshots        int64    `json:"snapshots"`
	ReflinkedBytes   int64    `json:"reflinkedBytes"`
	Pending          pending  `json:"pending"`
	VolumesDir       dirStamp `json:"volumesDir"`
	SnapshotsDir     dirStamp `json:"snapshotsDir"`
	// Seq counts the ledger's writes: a ledger older than one this process
	// has read or written (an old copy put back) is not trusted.
	Seq uint64 `json:"seq,omitempty"`
	// Sum is a checksum of the rest: a hand edit or a stray write that does
	// not recompute it is damage. With the cluster's share keys it is an
	// HMAC-SHA256 under the first key (any key verifies), so only a holder
	// of the key can write a ledger the driver trusts.
	Sum string `json:"sum"`
}

// Tally is what the ledger counts, or what a scan of the records found.
type Tally struct {
	Volumes, ProvisionedBytes, Snapshots, ReflinkedBytes int64
}

func (l *ledger) tally() Tally {
	return Tally{l.Volumes, l.ProvisionedBytes, l.Snapshots, l.ReflinkedBytes}
}

func (l *ledger) setTally(t Tally) {
	l.Volumes, l.ProvisionedBytes, l.Snapshots, l.ReflinkedBytes = t.Volumes, t.ProvisionedBytes, t.Snapshots, t.ReflinkedBytes
}

func tallyOf(u Usage) Tally {
	return Tally{int64(u.Volumes), u.ProvisionedBytes, int64(u.Snapshots), u.ReflinkedBytes}
}

// keyedSum starts a checksum made with a share key.
const keyedSum = "hmac-sha256:"

// checksum is l's sum under key (nil: unkeyed).
func (l ledger) checksum(key []byte) string {
	l.Sum = ""
	raw, _ := json.Marshal(l)
	if key == nil {
		s := sha256.Sum256(raw)
		return hex.EncodeToString(s[:12])
	}
	m := hmac.New(sha256.New, key)
	m.Write(raw)
	return keyedSum + hex.EncodeToString(m.Sum(nil)[:16])
}

// sumMatches tells whether l's sum is its checksum under one of keys (none:
// the unkeyed one). A keyed driver never accepts an unkeyed sum: anyone who
// can write the pool can compute that one.
func (l *ledger) sumMatches(keys [][]byte) bool {
	if len(keys) == 0 {
		return l.Sum == l.checksum(nil)
	}
	for _, k := range keys {
		if hmac.Equal([]byte(l.Sum), []byte(l.checksum(k))) {
			return true
		}
	}
	return false
}

// validate checks what admission relies on: a value no driver writes is damage.
func (l *ledger) validate(keys [][]byte) error {
	switch {
	case l.Version != ledgerVersion:
		return fmt.Errorf("version %d, want %d", l.Version, ledgerVersion)
	case !l.sumMatches(keys):
		return errors.New("checksum does not match (or was not made with the cluster's share key)")
	case l.Volumes < 0 || l.Snapshots < 0 || l.ProvisionedBytes < 0 || l.ReflinkedBytes < 0:
		return errors.New("a negative count")
	case float64(l.ProvisionedBytes) > float64(l.Volumes)*MaxCapacity:
		return errors.New("more capacity than its volumes can have")
	}
	switch l.Pending.Kind {
	case "":
		if l.Pending != (pending{}) {
			return errors.New("a pending entry without a kind")
		}
	case pendingVolume, pendingSnapshot:
		if !keyRE.MatchString(l.Pending.Key) || l.Pending.Bytes < 0 || l.Pending.Bytes > MaxCapacity {
			return errors.New("a pending entry no driver writes")
		}
	default:
		return fmt.Errorf("pending kind %q", l.Pending.Kind)
	}
	return nil
}

// stampOf stamps the pool directory rel (zero when it does not exist), from a
// descriptor opened below the pool's root without links. Opening it also makes
// an NFS client revalidate its attributes (close-to-open).
func (lg Ledger) stampOf(rel string) (dirStamp, error) {
	f, err := fsx.OpenDir(lg.p.cfg.Path, rel)
	if missing(err) {
		return dirStamp{}, nil
	}
	if err != nil {
		return dirStamp{}, fmt.Errorf("pool %s: stamp %s: %w", lg.p.cfg.Name, rel, unsafe(err))
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return dirStamp{}, fmt.Errorf("pool %s: stamp %s: %w", lg.p.cfg.Name, rel, err)
	}
	return dirStamp{Ino: st.Ino, Mtime: st.Mtim.Nano(), Ctime: st.Ctim.Nano(), Nlink: uint64(st.Nlink), Size: st.Size}, nil
}

func (lg Ledger) stamps() (vols, snaps dirStamp, err error) {
	if vols, err = lg.stampOf(volumesDir); err != nil {
		return
	}
	snaps, err = lg.stampOf(snapshotsDir)
	return
}

// read reads and verifies ledger.json against the pool's directories.
// Every error means: rebuild it. A missing one is missing (errors.go), a damaged
// one ErrCorrupt, an outdated one errLedgerStale.
func (lg Ledger) read() (ledger, error) {
	var l ledger
	raw, err := lg.p.files().readBeneath(ledgerFile, maxLedger)
	if err != nil {
		return l, fmt.Errorf("read %s: %w", ledgerFile, err)
	}
	if err := json.Unmarshal(raw, &l); err != nil {
		return l, fmt.Errorf("%w: %s: %w", ErrCorrupt, ledgerFile, err)
	}
	if err := l.validate(lg.keys()); err != nil {
		if len(lg.keys()) == 0 && strings.HasPrefix(l.Sum, keyedSum) {
			return l, fmt.Errorf("%s: %w", ledgerFile, errLedgerKeyed)
		}
		return l, fmt.Errorf("%w: %s: %w", ErrCorrupt, ledgerFile, err)
	}
	vols, snaps, err := lg.stamps()
	if err != nil {
		return l, err
	}
	if vols != l.VolumesDir || snaps != l.SnapshotsDir {
		return l, fmt.Errorf("%s: %w (a create or delete it does not count: a crash, or an older driver)", ledgerFile, errLedgerStale)
	}
	// Checked after the stamps: an older copy whose stamps no longer match
	// is outdated, and rebuilt, either way.
	if seen := lg.p.ledgerSeq.Load(); l.Seq < seen {
		return l, fmt.Errorf("%w: %s: write %d, older than write %d already seen here: an old copy put back", ErrCorrupt, ledgerFile, l.Seq, seen)
	}
	lg.seen(l.Seq)
	return l, nil
}

// write stamps l with the pool's directories as they are now and writes
// it durably: a growth it counts must not be lost while the record survives.
func (lg Ledger) write(l *ledger) error { return lg.writeAs(l, true) }

// writeAs is write, durable or not. A write that follows a change
// of volumes/ or snapshots/ (a create, a delete) need not be durable, and is
// not fsynced at all (fsx.WriteDerivedFile): a crash that loses it, or the
// directory change, or both, leaves either the state before the change, a
// ledger whose stamp does not match the directory, or one whose content did
// not survive (empty, zero-filled: its checksum fails), and each of those is
// rebuilt from the records. Only a change the stamps do not see (a growth, a
// filled snapshot) needs its content and the pool's root fsynced.
func (lg Ledger) writeAs(l *ledger, durable bool) error {
	vols, snaps, err := lg.stamps()
	if err != nil {
		return err
	}
	l.Version, l.VolumesDir, l.SnapshotsDir = ledgerVersion, vols, snaps
	l.Seq = max(l.Seq, lg.p.ledgerSeq.Load()) + 1
	var key []byte
	if keys := lg.keys(); len(keys) > 0 {
		key = keys[0]
	}
	l.Sum = l.checksum(key)
	raw, err := json.Marshal(l)
	if err != nil {
		return err
	}
	write := func() error { return lg.p.files().writeBeneath(ledgerFile, append(raw, '\n'), true) }
	if !durable {
		write = func() error { return unsafe(fsx.WriteDerivedFile(lg.p.cfg.Path, ledgerFile, append(raw, '\n'))) }
	}
	if err := write(); err != nil {
		return fmt.Errorf("pool %s: write %s: %w", lg.p.cfg.Name, ledgerFile, err)
	}
	lg.seen(l.Seq)
	return nil
}

// SetKeys gives the pool the cluster's share keys (--share-key-file),
// which sign its ledger. Called before the pool is used.
func (lg Ledger) SetKeys(keys [][]byte) {
	if len(keys) > 0 {
		lg.p.ledgerKeysP.Store(&keys)
	}
}

func (lg Ledger) keys() [][]byte {
	if k := lg.p.ledgerKeysP.Load(); k != nil {
		return *k
	}
	return nil
}

// seen records that the ledger's write seq was read or written here.
func (lg Ledger) seen(seq uint64) {
	for {
		old := lg.p.ledgerSeq.Load()
		if seq <= old || lg.p.ledgerSeq.CompareAndSwap(old, seq) {
			return
		}
	}
}

// decides tells whether the ledger alone may admit: not on a shared
// pool whose ledger is unkeyed (no share key), which anyone who can write
// the share can rewrite to count less than the records hold. There every
// admission measures the pool first (a confirmation scan).
func (lg Ledger) decides() bool {
	return !lg.p.cfg.Shared || len(lg.keys()) > 0
}

// ledgerTx is the ledger of a pool whose lock is held.
type ledgerTx struct {
	p *Pool
	l ledger
	// degraded: ledger.json cannot be written (a directory in its place);
	// every admission then measures the pool, as before the ledger.
	degraded bool
}

// begin takes the pool lock and the pool's ledger, verified: rebuilt if
// it is missing, damaged or outdated, and the previous change's pending entry
// settled. end releases the lock. What the transaction settled or repaired is
// written with its change (apply) and only then: a call that changes nothing
// (refused, or a no-op) leaves the pool's files as they were, and the next
// change redoes the repair.
func (lg Ledger) begin(ctx context.Context) (tx *ledgerTx, end func(), err error) {
	return lg.under(lg.p.LockPool(ctx))
}

// beginCreate is begin for a call that makes a record: the pool is
// checked first (lockToCreate).
func (lg Ledger) beginCreate(ctx context.Context) (tx *ledgerTx, end func(), err error) {
	return lg.under(lg.p.lockToCreate(ctx))
}

// under loads the ledger under the pool lock just taken (unlock, or
// the error of taking it).
func (lg Ledger) under(unlock func(), err error) (tx *ledgerTx, end func(), _ error) {
	if err != nil {
		return nil, nil, err
	}
	lg.keepReserve()
	tx = &ledgerTx{p: lg.p}
	if err := tx.load(); err != nil {
		unlock()
		return nil, nil, err
	}
	return tx, unlock, nil
}

func (tx *ledgerTx) load() error {
	l, err := tx.p.Ledger().read()
	if err != nil {
		return tx.rebuild()
	}
	tx.l = l
	return tx.settle()
}

// rebuild counts the pool's records: a scan, once, under the pool lock.
func (tx *ledgerTx) rebuild() error {
	u, err := tx.p.Ledger().Usage()
	if err != nil {
		return fmt.Errorf("pool %s: rebuild the capacity ledger: %w", tx.p.cfg.Name, err)
	}
	tx.l = ledger{}
	tx.l.setTally(tallyOf(u))
	return nil
}

// recorded is what the record of a pending entry contributes to the ledger
// now: whether it counts, and its bytes. A missing or damaged record counts
// nothing, as in a rebuild; a record that cannot be read for another reason
// (an I/O error) fails the transaction rather than being guessed.
func (lg Ledger) recorded(pd pending) (int64, int64, error) {
	var n, b int64
	var err error
	switch pd.Kind {
	case pendingVolume:
		var v *Volume
		if v, err = lg.p.Load(lg.p.IDOf(pd.Key)); err == nil {
			n, b = 1, v.CapacityBytes
		}
	case pendingSnapshot:
		var s *Snapshot
		if s, err = lg.p.Snapshots().Load(lg.p.Snapshots().IDOf(pd.Key)); err == nil {
			n, b = 1, reflinked(s)
		}
	}
	if err != nil && !missing(err) && !errors.Is(err, ErrCorrupt) {
		return 0, 0, err
	}
	return n, b, nil
}

// reflinked is what a snapshot adds to the pool's unbacked promises.
func reflinked(s *Snapshot) int64 {
	if s.CopyMethod == CopyReflink {
		return s.AllocatedBytes
	}
	return 0
}

// settle replaces the pending entry's count by what its record holds: the
// change finished (no difference) or was cut short by a crash (undone).
func (tx *ledgerTx) settle() error {
	pd := tx.l.Pending
	if pd.Kind == "" {
		return nil
	}
	n, b, err := tx.p.Ledger().recorded(pd)
	if err != nil {
		return fmt.Errorf("pool %s: settle the capacity ledger: %w", tx.p.cfg.Name, err)
	}
	if pd.Kind == pendingVolume {
		tx.l.Volumes += n - 1
		tx.l.ProvisionedBytes += b - pd.Bytes
	} else {
		tx.l.Snapshots += n - 1
		tx.l.ReflinkedBytes += b - pd.Bytes
	}
	tx.l.Pending = pending{}
	if tx.l.Volumes < 0 || tx.l.ProvisionedBytes < 0 || tx.l.Snapshots < 0 || tx.l.ReflinkedBytes < 0 {
		return tx.rebuild() // it under-counted: never trust it further
	}
	return nil
}

func (tx *ledgerTx) write(l ledger, durable bool) error {
	if tx.degraded {
		return nil
	}
	err := tx.p.Ledger().writeAs(&l, durable)
	if err != nil {
		if fi, lerr := os.Lstat(filepath.Join(tx.p.cfg.Path, ledgerFile)); lerr == nil && fi.IsDir() {
			// Not ours to remove; admission measures the pool instead,
			// and pool check names the directory.
			tx.degraded = true
			return nil
		}
		return err
	}
	return nil
}

// apply makes change to a copy of the ledger and writes it; only once it is
// written does the transaction hold it, so a failed write leaves nothing
// counted that the caller then does not make.
func (tx *ledgerTx) apply(change func(l *ledger)) error { return tx.applyAs(change, true) }

// applyStamped is apply for a change that has just created, renamed or
// removed an entry of volumes/ or snapshots/: its ledger write need not be
// durable (writeAs).
func (tx *ledgerTx) applyStamped(change func(l *ledger)) error { return tx.applyAs(change, false) }

func (tx *ledgerTx) applyAs(change func(l *ledger), durable bool) error {
	l := tx.l
	change(&l)
	if err := tx.write(l, durable); err != nil {
		return err
	}
	tx.l = l
	return nil
}

// admit is the one capacity decision, for every create, snapshot and growth of
// either layout: whether the pool can back need more bytes under its overcommit
// policy. what names the request in the refusal. The ledger's bound decides at
// the cost of one statfs; only a request that bound would refuse measures the
// pool (and checks the ledger against it) before the answer.
func (tx *ledgerTx) admit(need int64, what string) error {
	p := tx.p
	p.settleTrash()
	if !tx.degraded && p.Ledger().decides() {
		var st unix.Statfs_t
		if err := unix.Statfs(p.cfg.Path, &st); err != nil {
			return fmt.Errorf("%w: statfs pool %s: %w", ErrUnavailable, p.cfg.Name, err)
		}
		bound := float64(int64(st.Bavail)*st.Bsize)*p.cfg.Overcommit - float64(tx.l.ProvisionedBytes) - float64(tx.l.ReflinkedBytes)
		if float64(need) <= bound && bound < math.MaxInt64 {
			return nil
		}
	}
	u, err := p.Ledger().Usage()
	if err != nil {
		return err
	}
	if t := tallyOf(u); t != tx.l.tally() {
		// Drift (a crash that left a count behind, an older driver, a
		// record changed by hand): the measurement is the truth.
		tx.l.setTally(t)
	}
	if avail := p.Ledger().AvailableBytes(u); need > avail {
		return fmt.Errorf("%w: pool %s can back %d more bytes (free %d, already promised to sparse volumes and reflinked snapshots %d, overcommit %.2f); %s needs %d",
			ErrNoSpace, p.cfg.Name, avail, u.FreeBytes, u.UnbackedBytes, p.cfg.Overcommit, what, need)
	}
	return nil
}

// admitAllocation decides whether need bytes can be allocated now (a
// preallocated image, or its growth): they must fit in the pool's free space,
// and what stays promised to sparse volumes must still fit the overcommit
// policy in what is left. promised is the part of need already counted as a
// promise (the sparse image being filled): allocating it ends that promise.
// The ledger's bound decides first, as in admit; only a request it would
// refuse measures the pool.
func (tx *ledgerTx) admitAllocation(need, promised int64, what string) error {
	p := tx.p
	p.settleTrash()
	var st unix.Statfs_t
	if err := unix.Statfs(p.cfg.Path, &st); err != nil {
		return fmt.Errorf("%w: statfs pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	free := int64(st.Bavail) * st.Bsize
	if need > free {
		return fmt.Errorf("%w: pool %s has %d bytes free; %s needs %d allocated now", ErrNoSpace, p.cfg.Name, free, what, need)
	}
	fits := func(free, unbacked int64) bool {
		return float64(free-need)*p.cfg.Overcommit >= float64(unbacked-promised)
	}
	if !tx.degraded && p.Ledger().decides() && fits(free, tx.l.ProvisionedBytes+tx.l.ReflinkedBytes) {
		return nil
	}
	u, err := p.Ledger().Usage()
	if err != nil {
		return err
	}
	if need > u.FreeBytes || !fits(u.FreeBytes, u.UnbackedBytes) {
		return fmt.Errorf("%w: pool %s has %d bytes free and %d promised to sparse volumes and reflinked snapshots (overcommit %.2f); %s needs %d allocated now, which would leave the sparse volumes' promises unbacked",
			ErrNoSpace, p.cfg.Name, u.FreeBytes, u.UnbackedBytes, p.cfg.Overcommit, what, need)
	}
	return nil
}

// LedgerReport is what pool check says of a pool's ledger.
type LedgerReport struct {
	// Problem is empty when the ledger matches the records, or is only
	// Stale.
	Problem string
	// Stale: a create or delete changed volumes/ or snapshots/ since the
	// ledger was written (a crash between the two, or an older driver). The
	// driver never trusts such a ledger: the next change rebuilds it from the
	// records. So it is no problem, whatever it counts.
	Stale   bool
	Ledger  Tally // what the file counts (zero if unreadable)
	Records Tally // what the records hold
}

// Check compares the ledger with a count of the records, under the pool
// lock so that no change is half done. With repair, a ledger that does not
// match is rewritten from the records.
func (lg Ledger) Check(ctx context.Context, repair bool) (LedgerReport, error) {
	var unlock func()
	var err error
	if repair {
		unlock, err = lg.p.LockPool(ctx)
	} else {
		unlock, err = lg.lockQuietly(ctx)
	}
	if err != nil {
		return LedgerReport{}, err
	}
	defer unlock()
	var r LedgerReport
	l, lerr := lg.read()
	u, err := lg.Usage()
	if err != nil {
		return r, err
	}
	r.Records = tallyOf(u)
	switch {
	case missing(lerr):
		// No ledger yet (a pool an older version made): the first create
		// builds it. Not a problem.
		return r, nil
	case errors.Is(lerr, errLedgerKeyed):
		// Signed with the cluster's key, which this check lacks: the driver
		// verifies it; nothing to report or repair from here.
		return r, nil
	case lerr != nil && !errors.Is(lerr, errLedgerStale):
		r.Problem = "damaged: " + lerr.Error()
	default:
		r.Ledger = l.tally()
		if l.Pending.Kind != "" {
			n, b, err := lg.recorded(l.Pending)
			if err != nil {
				return r, err
			}
			// The pending entry, settled, as the next change would.
			if l.Pending.Kind == pendingVolume {
				r.Ledger.Volumes += n - 1
				r.Ledger.ProvisionedBytes += b - l.Pending.Bytes
			} else {
				r.Ledger.Snapshots += n - 1
				r.Ledger.ReflinkedBytes += b - l.Pending.Bytes
			}
		}
		r.Stale = lerr != nil
		if r.Ledger != r.Records && !r.Stale {
			r.Problem = fmt.Sprintf("drift: the ledger counts %+v, the records hold %+v", r.Ledger, r.Records)
		}
	}
	if (r.Problem != "" || r.Stale) && repair {
		nl := ledger{}
		nl.setTally(r.Records)
		if err := lg.write(&nl); err != nil {
			return r, err
		}
	}
	return r, nil
}

// lockQuietly takes the pool lock for a check that must change nothing: the
// lock file is opened read-only (flock needs no more) and no holder record is
// written into it; a pool without a lock file has no change under way, and a
// lock file that is not a regular file (pool check names it) is not waited on.
func (lg Ledger) lockQuietly(ctx context.Context) (func(), error) {
	f, err := fsx.OpenRegular(lg.p.cfg.Path, poolLock, unix.O_RDONLY, 0)
	if err != nil {
		return func() {}, nil //nolint:nilerr // nothing to wait for; damage is reported elsewhere
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, lockPatience)
		defer cancel()
	}
	if err := fsx.FlockContext(ctx, f); err != nil {
		f.Close()
		return nil, fmt.Errorf("pool %s: wait for the pool lock: %w", lg.p.cfg.Name, err)
	}
	return func() { f.Close() }, nil
}
