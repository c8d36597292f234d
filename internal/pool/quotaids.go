package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The quota ID index lets a dir volume take a project quota ID without reading
// every volume.json of the pool to learn which IDs are in use:
//
//	quota-ids/<kind>/<id>   one file per ID taken, holding the key of the volume
//	quota-ids/.index-v1     the index was built; absent, it is built once
//
// A volume's ID is a hash of its key (quota.ProjectID), probed onward past
// IDs already taken, so a claim costs one exclusive create, and a collision is
// the create finding the file there. As with the publish index (attach.go),
// the volume.json records stay the truth and the index is kept a superset of
// them across crashes:
//   - the claim is made, and made durable, before the ID is set on the data
//     directory and long before volume.json records it;
//   - it is removed only after the volume is deleted, so a crash can leave a
//     claim without a volume (stale), never a volume without its claim;
//   - a stale claim only makes a create probe one ID further; a claim found
//     naming another volume is checked against that volume (under the pool
//     lock, so two creates never both take it over) and taken over only if
//     that volume is gone or records another ID, and no call holds its lock;
//   - a pool without the index (made by an older version) gets it built from
//     every volume.json once, under the pool lock, before its first claim.

const (
	quotaIDsDir    = "quota-ids"
	quotaIndexDone = ".index-v1"
	maxQuotaClaim  = 4 << 10
)

// QuotaIDs is the pool's index of quota ID claims (quota-ids/).
type QuotaIDs struct{ p *Pool }

// QuotaIDs is the pool's quota ID claims.
func (p *Pool) QuotaIDs() QuotaIDs { return QuotaIDs{p} }

func quotaClaimRel(kind string, qid uint64) string {
	return filepath.Join(quotaIDsDir, kind, strconv.FormatUint(qid, 10))
}

// validQuotaKind keeps a kind read from volume.json from naming a path.
func validQuotaKind(kind string) bool {
	if kind == "" || len(kind) > 32 {
		return false
	}
	return strings.Trim(kind, "abcdefghijklmnopqrstuvwxyz0123456789-") == ""
}

// Claim takes quota ID qid of kind for volume vol, if no other volume
// holds it, and tells whether it did. The caller holds vol's lock. A claim vol
// already holds (an interrupted attempt's) is vol's again.
func (qs QuotaIDs) Claim(ctx context.Context, kind string, vol VolumeID, qid uint64) (bool, error) {
	if !validQuotaKind(kind) {
		return false, fmt.Errorf("quota kind %q is not one a driver uses", kind)
	}
	if err := qs.ensureIndex(ctx); err != nil {
		return false, err
	}
	dir := filepath.Join(quotaIDsDir, kind)
	if err := os.MkdirAll(filepath.Join(qs.p.cfg.Path, dir), 0o750); err != nil {
		return false, fmt.Errorf("pool %s: claim quota ID %d: %w", qs.p.cfg.Name, qid, err)
	}
	if err := qs.p.files().checkDir(dir); err != nil {
		return false, err
	}
	rel := quotaClaimRel(kind, qid)
	claimed, err := qs.create(rel, vol.Key, true)
	if err != nil || claimed {
		return claimed, err
	}
	owner, err := qs.p.files().readBeneath(rel, maxQuotaClaim)
	if err != nil {
		// Unreadable (a link, a FIFO, garbage a node left): it is not known
		// to be free, so it is not taken; pool check names it.
		return false, nil //nolint:nilerr // a damaged claim is a taken ID, not an error
	}
	if string(owner) == vol.Key {
		return true, nil
	}
	// Maybe stale: decided under the pool lock, so that two creates never
	// both take one stale claim over.
	unlock, err := qs.p.LockPool(ctx)
	if err != nil {
		return false, err
	}
	defer unlock()
	owner, err = qs.p.files().readBeneath(rel, maxQuotaClaim)
	if err != nil || !keyRE.MatchString(string(owner)) || !qs.stale(kind, qs.p.IDOf(string(owner)), qid) {
		return string(owner) == vol.Key, nil
	}
	if err := qs.p.files().writeBeneath(rel, []byte(vol.Key), true); err != nil {
		return false, fmt.Errorf("pool %s: take over stale quota ID %d: %w", qs.p.cfg.Name, qid, err)
	}
	return true, nil
}

// create makes the claim file rel holding key (with durable, made to
// survive a crash before it returns) if it does not exist; false if it does.
func (qs QuotaIDs) create(rel, key string, durable bool) (bool, error) {
	f, err := qs.p.files().openBeneath(rel, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL)
	if errors.Is(err, os.ErrExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("pool %s: claim %s: %w", qs.p.cfg.Name, rel, err)
	}
	_, werr := f.WriteString(key)
	if werr == nil && durable {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil && durable {
		werr = syncDir(filepath.Dir(filepath.Join(qs.p.cfg.Path, rel)))
	}
	if werr != nil {
		_ = os.Remove(filepath.Join(qs.p.cfg.Path, rel))
		return false, fmt.Errorf("pool %s: claim %s: %w", qs.p.cfg.Name, rel, werr)
	}
	return true, nil
}

// stale tells whether owner's claim of qid stands for nothing: owner is
// gone, or records another ID, and no call holds its lock (a create holds it
// from before it claims until it records the ID). Anything unclear (a
// damaged volume.json, a volume still creating) counts as holding it.
func (qs QuotaIDs) stale(kind string, owner VolumeID, qid uint64) bool {
	if lockHeld(qs.p.cfg.Path, volumeRel(owner, lockFile)) {
		return false
	}
	v, err := qs.p.Load(owner)
	switch {
	case missing(err):
		return !qs.p.VolumeExists(owner)
	case err != nil, v.State != StateReady:
		return false
	}
	return v.Quota == nil || v.Quota.Kind != kind || v.Quota.ID != qid
}

// release removes vol's claim of qid, after the volume is gone. Not
// fsynced, and best effort: a claim a crash leaves is stale, and taken over.
func (qs QuotaIDs) release(kind string, qid uint64, key string) {
	if qid == 0 || !validQuotaKind(kind) {
		return
	}
	rel := quotaClaimRel(kind, qid)
	if owner, err := qs.p.files().readBeneath(rel, maxQuotaClaim); err == nil && string(owner) == key {
		_ = os.Remove(filepath.Join(qs.p.cfg.Path, rel))
	}
}

// ensureIndex builds the index from every volume.json if the pool does
// not have it yet (a pool an older version made), once per pool and process,
// under the pool lock so that no claim is made while it is incomplete.
func (qs QuotaIDs) ensureIndex(ctx context.Context) error {
	if qs.p.quotaIndexed.Load() {
		return nil
	}
	done := filepath.Join(quotaIDsDir, quotaIndexDone)
	if _, err := qs.p.files().readBeneath(done, maxMarker); err == nil {
		qs.p.quotaIndexed.Store(true)
		return nil
	}
	unlock, err := qs.p.LockPool(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := qs.p.files().readBeneath(done, maxMarker); err == nil {
		qs.p.quotaIndexed.Store(true)
		return nil
	}
	entries, err := qs.p.List()
	if err != nil {
		return fmt.Errorf("pool %s: build the quota ID index: %w", qs.p.cfg.Name, err)
	}
	dirs := map[string]bool{}
	for _, e := range entries {
		if e.Volume == nil || e.Volume.Quota == nil || e.Volume.Quota.ID == 0 || !validQuotaKind(e.Volume.Quota.Kind) {
			continue
		}
		q := e.Volume.Quota
		dir := filepath.Join(quotaIDsDir, q.Kind)
		if err := os.MkdirAll(filepath.Join(qs.p.cfg.Path, dir), 0o750); err != nil {
			return fmt.Errorf("pool %s: build the quota ID index: %w", qs.p.cfg.Name, err)
		}
		if err := qs.p.files().checkDir(dir); err != nil {
			return err
		}
		// Added, never replaced: a duplicate (two volumes an older version
		// gave one ID) keeps its first owner; pool check reports both.
		if _, err := qs.create(quotaClaimRel(q.Kind, q.ID), e.ID.Key, false); err != nil {
			return err
		}
		dirs[dir] = true
	}
	// One fsync per directory, not per claim; the done marker comes after.
	for dir := range dirs {
		if err := syncDir(filepath.Join(qs.p.cfg.Path, dir)); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Join(qs.p.cfg.Path, quotaIDsDir), 0o750); err != nil {
		return fmt.Errorf("pool %s: build the quota ID index: %w", qs.p.cfg.Name, err)
	}
	if err := qs.p.files().writeBeneath(done, []byte("1\n"), true); err != nil {
		return err
	}
	qs.p.quotaIndexed.Store(true)
	return nil
}
