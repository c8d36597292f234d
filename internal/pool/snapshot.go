package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
	"unicode"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

const (
	snapshotsDir     = "snapshots"
	snapshotMetaFile = "snapshot.json"
	snapshotImage    = "image"
	// SnapshotSep separates pool and key in a snapshot ID. Volume IDs use ".",
	// and neither a pool name nor a key may contain "@", so a snapshot ID can
	// never parse as a volume ID, nor the other way round.
	SnapshotSep = "@"
)

// SnapshotSchemaVersion is the version of snapshot.json this code writes.
const SnapshotSchemaVersion = 1

// Copy methods recorded in snapshot.json.
const (
	// CopyReflink: the data shares extents with its source (FICLONE); the
	// blocks are unshared, and allocated, when either side is later written.
	CopyReflink = fsx.CopyReflink
	// CopyFull: an independent sparse copy.
	CopyFull = fsx.CopyFull
)

// Snapshots is the pool's view for volume snapshots: their IDs, records
// (snapshots/<key>/snapshot.json), copies and their place in the ledger.
// A narrow store over the one Pool, as Freezes is; a group snapshot's
// members are snapshots too (Groups).
type Snapshots struct{ p *Pool }

// Snapshots is the pool's snapshots.
func (p *Pool) Snapshots() Snapshots { return Snapshots{p} }

// SnapshotID is the handle Kubernetes stores in a VolumeSnapshotContent:
// "<pool>@<key>", or for a snapshot on a share a StorageClass names
// "<pool>@<key>.<share>", the share part as in a VolumeID (share.go).
type SnapshotID struct {
	Pool  string
	Key   string
	Share string
	Tag   string   // as in VolumeID
	ref   ShareRef // as in VolumeID
}

// String is the snapshot's identity, never with the tag (see VolumeID).
func (id SnapshotID) String() string {
	if id.Share != "" {
		return id.Pool + SnapshotSep + id.Key + "." + id.Share
	}
	return id.Pool + SnapshotSep + id.Key
}

// Wire is the ID as the CO holds it: String and, on a share, the tag.
func (id SnapshotID) Wire() string { return withTag(id.String(), id.Tag) }

// ShareRef returns the share an ID names, if it names one.
func (id SnapshotID) ShareRef() (ShareRef, bool) { return refOf(id.ref, id.Share) }

// IDOf is the ID of the snapshot with key in this pool.
func (ss Snapshots) IDOf(key string) SnapshotID {
	return SnapshotID{Pool: ss.p.cfg.Name, Key: key, Share: ss.p.share, ref: ss.p.shareRef()}
}

// NewID is the ID of the snapshot named name in this pool.
func (ss Snapshots) NewID(name string) SnapshotID { return ss.IDOf(KeyForName(name)) }

// NewSnapshotID builds the ID of the snapshot named name in pool poolName. The key
// is a hash of the name, so a retried CreateSnapshot finds its snapshot.
func NewSnapshotID(poolName, name string) SnapshotID {
	return SnapshotID{Pool: poolName, Key: KeyForName(name)}
}

// ParseSnapshotID validates a snapshot ID received over the wire before any path
// is built from it: only "<pool name>@<32 lowercase hex>" passes, or on a share
// "s-<16 hex>@<32 hex>.<share>" under the rules of ParseVolumeID.
func ParseSnapshotID(s string) (SnapshotID, error) {
	if len(s) > MaxVolumeIDLength {
		return SnapshotID{}, fmt.Errorf("%w: snapshot ID is %d bytes long", ErrInvalidID, len(s))
	}
	bad := func() (SnapshotID, error) {
		return SnapshotID{}, fmt.Errorf("%w: %q is not a poolcsi snapshot ID (<pool>@<32 hex digits>, or s-<16 hex digits>@<32 hex digits>.<share> for a share)", ErrInvalidID, s)
	}
	poolName, rest, ok := strings.Cut(s, SnapshotSep)
	if !ok || ValidatePoolName(poolName) != nil {
		return bad()
	}
	key, share, hasShare := strings.Cut(rest, ".")
	if !keyRE.MatchString(key) || IsSharePoolName(poolName) != hasShare {
		return bad()
	}
	id := SnapshotID{Pool: poolName, Key: key}
	if hasShare {
		share, tag, err := splitTag(share)
		if err != nil {
			return SnapshotID{}, err
		}
		ref, err := checkSharePart(s, poolName, share)
		if err != nil {
			return SnapshotID{}, err
		}
		id.Share, id.Tag, id.ref = share, tag, ref
	}
	return id, nil
}

// HostileID tells whether an ID that failed to parse is more than merely unknown:
// one that looks like an attempt to reach a path (a "/", "..", NUL or other
// control character) or is longer than any ID. The CSI spec wants an unknown
// snapshot ID treated as "not found" (DeleteSnapshot: success), but such an ID
// is refused outright, so it is logged as what it is.
func HostileID(s string) bool {
	if len(s) > 128 || strings.Contains(s, "/") || strings.Contains(s, "..") {
		return true
	}
	return strings.IndexFunc(s, func(r rune) bool { return r == 0 || unicode.IsControl(r) || r == unicode.ReplacementChar }) >= 0
}

// Snapshot is the content of snapshot.json.
type Snapshot struct {
	SchemaVersion  int        `json:"schemaVersion"`
	ID             string     `json:"id"`
	Name           string     `json:"name"`
	Pool           string     `json:"pool"`
	SourceVolumeID string     `json:"sourceVolumeId"`
	Layout         Layout     `json:"layout"`
	AccessType     AccessType `json:"accessType"`
	FSType         string     `json:"fsType,omitempty"`
	// SizeBytes is the source's capacity when the snapshot was cut: the smallest
	// volume it can be restored to.
	SizeBytes  int64     `json:"sizeBytes"`
	CreatedAt  time.Time `json:"createdAt"`
	ReadyToUse bool      `json:"readyToUse"`
	// CopyMethod is how the data was copied (reflink or copy); capacity
	// accounting counts a reflinked snapshot's blocks as a promise.
	CopyMethod string `json:"copyMethod,omitempty"`
	// AllocatedBytes is what the copy allocated (or shares, for a reflink), measured
	// once when it was made: a snapshot never changes afterwards.
	AllocatedBytes int64 `json:"allocatedBytes,omitempty"`
	// GroupSnapshotID names the group snapshot this one is a member of
	// (group.go); "" for an independent snapshot.
	GroupSnapshotID string `json:"groupSnapshotId,omitempty"`
}

// Dir is the directory holding one snapshot.
func (ss Snapshots) Dir(id SnapshotID) string {
	return filepath.Join(ss.p.cfg.Path, snapshotsDir, id.Key)
}

// ImagePath is the copied disk image of an image-layout snapshot.
func (ss Snapshots) ImagePath(id SnapshotID) string {
	return filepath.Join(ss.Dir(id), snapshotImage)
}

// DataPath is the copied directory tree of a dir-layout snapshot.
func (ss Snapshots) DataPath(id SnapshotID) string {
	return filepath.Join(ss.Dir(id), dataDir)
}

// Load reads snapshot.json; a missing snapshot is ErrNotFound.
func (ss Snapshots) Load(id SnapshotID) (*Snapshot, error) {
	path := filepath.Join(ss.Dir(id), snapshotMetaFile)
	raw, err := ss.p.files().readBeneath(snapshotRel(id, snapshotMetaFile), maxSnapshotMeta)
	if err != nil {
		return nil, fmt.Errorf("read metadata of snapshot %s: %w", id, notFound(err))
	}
	var s Snapshot
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, fmt.Errorf("%w: snapshot %s: %w", ErrCorrupt, id, err)
	}
	if s.SchemaVersion > SnapshotSchemaVersion {
		return nil, fmt.Errorf("%w: snapshot %s has schema version %d, this driver understands up to %d", ErrCorrupt, id, s.SchemaVersion, SnapshotSchemaVersion)
	}
	if s.ID != id.String() {
		return nil, fmt.Errorf("%w: %s records ID %q", ErrCorrupt, path, s.ID)
	}
	if _, err := ParseVolumeID(s.SourceVolumeID); err != nil || s.SizeBytes <= 0 || s.SizeBytes > MaxCapacity ||
		(s.Layout != LayoutImage && s.Layout != LayoutDir) || (s.AccessType != AccessFilesystem && s.AccessType != AccessBlock) {
		return nil, fmt.Errorf("%w: %s: source, size, layout or access type is not one a driver writes", ErrCorrupt, path)
	}
	if s.GroupSnapshotID != "" {
		if gid, err := ParseGroupSnapshotID(s.GroupSnapshotID); err != nil || gid.Pool != id.Pool || gid.Share != id.Share ||
			ss.p.Groups().MemberID(gid, s.SourceVolumeID) != ss.IDOf(id.Key) {
			return nil, fmt.Errorf("%w: %s: group snapshot %q is not one a driver writes", ErrCorrupt, path, s.GroupSnapshotID)
		}
	}
	return &s, nil
}

// save writes snapshot.json atomically.
func (ss Snapshots) save(s *Snapshot) error {
	id, err := ParseSnapshotID(s.ID)
	if err != nil {
		return err
	}
	if err := ss.p.files().checkDir(snapshotRel(id)); err != nil {
		return err
	}
	s.SchemaVersion = SnapshotSchemaVersion
	raw, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("encode metadata of snapshot %s: %w", id, err)
	}
	return ss.p.files().writeBeneath(snapshotRel(id, snapshotMetaFile), append(raw, '\n'), true)
}

// SnapshotEntry is one listed snapshot, or the error that kept it from loading.
type SnapshotEntry struct {
	ID       SnapshotID
	Snapshot *Snapshot
	Err      error
}

// loadListed is loadListed for a snapshot directory.
func (ss Snapshots) loadListed(id SnapshotID) (SnapshotEntry, bool) {
	s, err := ss.Load(id)
	if missing(err) {
		if !ss.Exists(id) || ss.p.files().changing() {
			return SnapshotEntry{}, false
		}
		s, err = ss.Load(id)
	}
	return SnapshotEntry{ID: id, Snapshot: s, Err: err}, true
}

// List returns the pool's snapshots sorted by ID.
func (ss Snapshots) List() ([]SnapshotEntry, error) {
	des, err := ss.p.files().readDir(snapshotsDir)
	if missing(err) {
		return nil, nil // no snapshot was ever taken
	}
	if err != nil {
		return nil, fmt.Errorf("%w: list snapshots of pool %s: %w", ErrUnavailable, ss.p.cfg.Name, err)
	}
	var out []SnapshotEntry
	for _, de := range des {
		if !de.IsDir() || !keyRE.MatchString(de.Name()) {
			continue
		}
		if e, ok := ss.loadListed(ss.IDOf(de.Name())); ok {
			out = append(out, e)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID.Key < out[j].ID.Key })
	return out, nil
}

// Reserve finds or starts the snapshot named name of volume src: its
// directory and a snapshot.json with readyToUse false. A snapshot of that name
// from another source is ErrExists. needBytes is what the copy may allocate; the
// pool must be able to hold it under its overcommit policy (ErrNoSpace). The
// caller copies the data and then calls save with ReadyToUse set.
func (ss Snapshots) Reserve(ctx context.Context, name string, src *Volume, needBytes int64) (*Snapshot, error) {
	return ss.reserve(ctx, name, "", time.Now().UTC(), src, needBytes)
}

// reserve is Reserve of a snapshot that is a member of group
// (or of none, ""); a snapshot of that name in another group, or in none, is
// ErrExists.
func (ss Snapshots) reserve(ctx context.Context, name, group string, created time.Time, src *Volume, needBytes int64) (*Snapshot, error) {
	if err := ValidateVolumeName(name); err != nil {
		return nil, err
	}
	id := ss.NewID(name)
	tx, end, err := ss.p.Ledger().beginCreate(ctx)
	if err != nil {
		return nil, err
	}
	defer end()
	if s, err := ss.Load(id); err == nil {
		switch {
		case s.Name != name:
			return nil, fmt.Errorf("%w: snapshot key %s is taken by %q (hash collision)", ErrCorrupt, id.Key, s.Name)
		case s.SourceVolumeID != src.ID:
			return nil, fmt.Errorf("%w: snapshot %q already exists of volume %s", ErrExists, name, s.SourceVolumeID)
		case s.GroupSnapshotID != group:
			return nil, fmt.Errorf("%w: snapshot %q already exists, in group %q", ErrExists, name, s.GroupSnapshotID)
		}
		return s, nil
	} else if !missing(err) {
		return nil, err
	}
	if err := tx.admit(needBytes, "a snapshot of volume "+src.ID); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(ss.Dir(id), 0o750); err != nil {
		return nil, fmt.Errorf("create snapshot %s: %w", id, err)
	}
	// Counted before its record, as Reserve counts a volume.
	if err := tx.applyStamped(func(l *ledger) {
		l.Snapshots++
		l.Pending = pending{Kind: pendingSnapshot, Key: id.Key}
	}); err != nil {
		return nil, err
	}
	s := &Snapshot{
		ID:              id.String(),
		Name:            name,
		Pool:            ss.p.cfg.Name,
		SourceVolumeID:  src.ID,
		Layout:          src.Layout,
		AccessType:      src.AccessType,
		FSType:          src.FSType,
		SizeBytes:       src.CapacityBytes,
		CreatedAt:       created,
		GroupSnapshotID: group,
	}
	if err := ss.save(s); err != nil {
		return nil, err
	}
	return s, nil
}

// Delete removes a snapshot; nil when it does not exist. Like a volume,
// it is renamed into the pool's trash first, under the pool lock, so a crash
// never leaves a half-deleted snapshot that lists as present; the copy is
// removed after the lock is released, and a retry finishes the removal.
func (ss Snapshots) Delete(ctx context.Context, id SnapshotID) error {
	tx, end, err := ss.p.Ledger().begin(ctx)
	if err != nil {
		return err
	}
	s, lerr := ss.Load(id)
	var moved bool
	var ours []string
	err = ss.p.Ledger().freeing(func() (err error) {
		var more []string
		moved, more, err = ss.p.files().toTrash(snapshotsDir, id.Key, "s-", false)
		ours = append(ours, more...)
		return err
	})
	if err == nil && moved && lerr == nil {
		err = ss.p.Ledger().freeing(func() error {
			return tx.applyStamped(func(l *ledger) {
				l.Snapshots--
				l.ReflinkedBytes -= reflinked(s)
			})
		})
	}
	end()
	if err != nil {
		return fmt.Errorf("delete snapshot %s: %w", id, err)
	}
	if err := ss.p.files().emptyTrash("s-"+id.Key, ours, nil); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", id, err)
	}
	return nil
}

// saveFilled records a filled snapshot, counting what a reflinked copy shares
// with its source in the ledger first (as its pending entry), so that the
// record never holds more than the ledger counts.
func (ss Snapshots) saveFilled(ctx context.Context, sid SnapshotID, s *Snapshot) error {
	if reflinked(s) > 0 {
		tx, end, err := ss.p.Ledger().begin(ctx)
		if err != nil {
			return err
		}
		var before int64
		if old, err := ss.Load(sid); err == nil {
			before = reflinked(old)
		}
		err = tx.apply(func(l *ledger) {
			l.ReflinkedBytes += reflinked(s) - before
			l.Pending = pending{Kind: pendingSnapshot, Key: sid.Key, Bytes: reflinked(s)}
		})
		if err == nil {
			err = ss.save(s)
		}
		end()
		return err
	}
	return ss.save(s)
}

// Allocated measures what a snapshot's data holds on the pool's
// filesystem; data that is missing is ErrNotFound.
func (ss Snapshots) Allocated(id SnapshotID, s *Snapshot) (int64, error) {
	if s.Layout == LayoutDir {
		n, err := TreeAllocated(ss.DataPath(id))
		return n, notFound(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(ss.ImagePath(id), &st); err != nil {
		return 0, fmt.Errorf("snapshot %s: %w", id, notFound(err))
	}
	return st.Blocks * 512, nil
}

// SourceAllocated is what the data of volume id, a snapshot's source, holds on
// the pool's filesystem: what a full copy of it would allocate; data that is
// missing is ErrNotFound.
func (ss Snapshots) SourceAllocated(id VolumeID, v *Volume) (int64, error) {
	if v.Layout == LayoutDir {
		n, err := TreeAllocated(ss.p.DataPath(id))
		return n, notFound(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(ss.p.ImagePath(id), &st); err != nil {
		return 0, fmt.Errorf("volume %s: %w", id, notFound(err))
	}
	return st.Blocks * 512, nil
}

// TreeAllocated sums the blocks allocated to the files under root (without
// following symlinks or crossing into other filesystems' mounts it finds).
func TreeAllocated(root string) (int64, error) {
	var total int64
	err := filepath.WalkDir(root, func(path string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			return err
		}
		total += st.Blocks * 512
		return nil
	})
	return total, err
}

// Fill copies volume src's data into the reserved snapshot s, measures
// what the copy holds and marks the snapshot ready. Whatever an interrupted
// attempt copied is thrown away first. quiesce, if not nil, runs just before an
// image is copied and the function it returns just after (the driver freezes
// the filesystem staged on a node there); an error of either fails the fill,
// and a copy that resume says was not quiesced throughout is removed.
func (ss Snapshots) Fill(ctx context.Context, s *Snapshot, src *Volume, quiesce func() (resume func() error, err error)) error {
	sid, err := ParseSnapshotID(s.ID)
	if err != nil {
		return err
	}
	vid, err := ParseVolumeID(src.ID)
	if err != nil {
		return err
	}
	if err := ss.p.files().checkDir(snapshotRel(sid)); err != nil {
		return err
	}
	var method string
	if src.Layout == LayoutDir {
		from, err := ss.p.OpenData(vid)
		if err != nil {
			return fmt.Errorf("snapshot %s of volume %s: %w", sid, vid, err)
		}
		defer from.Close()
		data := ss.DataPath(sid)
		if err := os.RemoveAll(data); err != nil {
			return fmt.Errorf("snapshot %s: remove half-made copy: %w", sid, err)
		}
		if err := os.Mkdir(data, 0o750); err != nil {
			return fmt.Errorf("snapshot %s: %w", sid, err)
		}
		if err := fsx.CopyTree(ctx, from.Path(), data); err != nil {
			return fmt.Errorf("snapshot %s of volume %s: %w", sid, vid, err)
		}
		method = CopyFull
	} else {
		from, err := ss.p.OpenImage(vid)
		if err != nil {
			return fmt.Errorf("snapshot %s of volume %s: %w", sid, vid, err)
		}
		defer from.Close()
		image := ss.ImagePath(sid)
		if err := os.Remove(image); err != nil && !missing(err) {
			return fmt.Errorf("snapshot %s: remove half-made copy: %w", sid, err)
		}
		method, err = func() (_ string, err error) {
			if quiesce != nil {
				resume, qerr := quiesce()
				if qerr != nil {
					return "", qerr
				}
				// Deferred, so a panic in the copy cannot leave it quiesced.
				defer func() {
					if rerr := resume(); rerr != nil && err == nil {
						err = rerr
					}
				}()
			}
			return fsx.CopyImage(ctx, from.Path(), image, 0)
		}()
		if err != nil {
			// Not kept for the retry to find: it may be a copy of a volume
			// that was written to while it was made.
			if rerr := os.Remove(image); rerr != nil && !missing(rerr) {
				err = errors.Join(err, fmt.Errorf("remove the failed copy: %w", rerr))
			}
			return fmt.Errorf("snapshot %s of volume %s: %w", sid, vid, err)
		}
	}
	alloc, err := ss.Allocated(sid, s)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", sid, err)
	}
	s.CopyMethod, s.AllocatedBytes, s.ReadyToUse = method, alloc, true
	return ss.saveFilled(ctx, sid, s)
}
