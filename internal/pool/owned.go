package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// This file holds what the driver and the health checks need to know about a
// pool's files without knowing their names: existence, the freeze markers, the
// snapshot fill and a dir volume's data directory. Nothing outside this package
// builds a path inside a pool.

const freezeFile = "frozen"

// MetadataPath is a volume's volume.json, for messages that tell an operator
// which file to repair.
func (p *Pool) MetadataPath(id VolumeID) string { return filepath.Join(p.Dir(id), metadataFile) }

// VolumeExists tells whether the volume's directory exists, metadata or not.
func (p *Pool) VolumeExists(id VolumeID) bool {
	_, err := os.Lstat(p.Dir(id))
	return err == nil
}

// SnapshotExists tells whether the snapshot's directory exists, ready or not.
func (p *Pool) SnapshotExists(id SnapshotID) bool {
	_, err := os.Lstat(p.SnapshotDir(id))
	return err == nil
}

// Freeze is a record that node froze the filesystem of a volume mounted at Path
// for a snapshot: it outlives a crash of the freezing process, so the next start
// thaws what it froze (volumes/<key>/frozen, "<node>\n<path>").
type Freeze struct {
	Volume VolumeID
	Node   string
	Path   string
}

// RecordFreeze writes the freeze record of a volume, before the freeze.
func (p *Pool) RecordFreeze(id VolumeID, node, path string) error {
	if err := ValidateNodeID(node); err != nil {
		return err
	}
	if err := p.checkDir(volumeRel(id)); err != nil {
		return err
	}
	return p.writeBeneath(volumeRel(id, freezeFile), []byte(node+"\n"+path), true)
}

// ClearFreeze removes a volume's freeze record, after the thaw.
func (p *Pool) ClearFreeze(id VolumeID) error {
	err := os.Remove(filepath.Join(p.Dir(id), freezeFile))
	if err != nil && !missing(err) {
		return fmt.Errorf("volume %s: clear freeze record: %w", id, err)
	}
	return nil
}

// Freezes lists the pool's freeze records. One that cannot be read or parsed is
// skipped: it names nothing this node could safely thaw.
func (p *Pool) Freezes() ([]Freeze, error) {
	des, err := p.readDir(volumesDir)
	if err != nil {
		return nil, fmt.Errorf("%w: list pool %s: %w", ErrUnavailable, p.cfg.Name, err)
	}
	var out []Freeze
	for _, de := range des {
		if !de.IsDir() || !keyRE.MatchString(de.Name()) {
			continue
		}
		raw, err := p.readBeneath(volumeRel(p.IDOf(de.Name()), freezeFile), maxFreezeRecord)
		if err != nil {
			continue
		}
		node, path, ok := strings.Cut(string(raw), "\n")
		if !ok || ValidateNodeID(node) != nil || !filepath.IsAbs(path) {
			continue
		}
		out = append(out, Freeze{Volume: p.IDOf(de.Name()), Node: node, Path: path})
	}
	return out, nil
}

// FillSnapshot copies volume src's data into the reserved snapshot s, measures
// what the copy holds and marks the snapshot ready. Whatever an interrupted
// attempt copied is thrown away first. quiesce, if not nil, runs just before an
// image is copied and the function it returns just after (the driver freezes
// the filesystem staged on a node there); an error of either fails the fill,
// and a copy that resume says was not quiesced throughout is removed.
func (p *Pool) FillSnapshot(ctx context.Context, s *Snapshot, src *Volume, quiesce func() (resume func() error, err error)) error {
	sid, err := ParseSnapshotID(s.ID)
	if err != nil {
		return err
	}
	vid, err := ParseVolumeID(src.ID)
	if err != nil {
		return err
	}
	if err := p.checkDir(snapshotRel(sid)); err != nil {
		return err
	}
	var method string
	if src.Layout == LayoutDir {
		from, err := p.OpenData(vid)
		if err != nil {
			return fmt.Errorf("snapshot %s of volume %s: %w", sid, vid, err)
		}
		defer from.Close()
		data := p.SnapshotDataPath(sid)
		if err := os.RemoveAll(data); err != nil {
			return fmt.Errorf("snapshot %s: remove half-made copy: %w", sid, err)
		}
		if err := os.Mkdir(data, 0o750); err != nil {
			return fmt.Errorf("snapshot %s: %w", sid, err)
		}
		if err := CopyTree(ctx, from.Path(), data); err != nil {
			return fmt.Errorf("snapshot %s of volume %s: %w", sid, vid, err)
		}
		method = CopyFull
	} else {
		from, err := p.OpenImage(vid)
		if err != nil {
			return fmt.Errorf("snapshot %s of volume %s: %w", sid, vid, err)
		}
		defer from.Close()
		image := p.SnapshotImagePath(sid)
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
			return CopyImage(ctx, from.Path(), image, 0)
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
	alloc, err := p.SnapshotAllocated(sid, s)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", sid, err)
	}
	s.CopyMethod, s.AllocatedBytes, s.ReadyToUse = method, alloc, true
	return p.saveFilled(ctx, sid, s)
}

// MakeData makes the data directory of a dir volume still in state creating.
// A half-made data directory from an interrupted attempt holds no user data
// and is removed first. create makes the directory (a plain directory, a btrfs
// subvolume, a project-quota directory) with its limit and returns the quota
// ID it took; claim takes a quota ID of kind for this volume through the
// pool's quota ID index (quotaids.go), or tells that another volume holds it.
// The caller holds the volume's lock (Finish); no pool-wide lock is taken and
// no other volume is read.
func (p *Pool) MakeData(ctx context.Context, v *Volume, kind string, create func(data string, claim func(qid uint64) (bool, error)) (uint64, error)) (uint64, error) {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return 0, err
	}
	if v.State != StateCreating {
		return 0, fmt.Errorf("volume %s is %s, not creating: refusing to remake its data", id, v.State)
	}
	if err := p.checkDir(volumeRel(id)); err != nil {
		return 0, err
	}
	data := p.DataPath(id)
	if err := os.RemoveAll(data); err != nil {
		return 0, fmt.Errorf("remove half-made data of volume %s: %w", id, err)
	}
	return create(data, func(qid uint64) (bool, error) { return p.ClaimQuotaID(ctx, kind, id, qid) })
}

// DataExists tells whether a dir volume's data directory is there.
func (p *Pool) DataExists(id VolumeID) bool {
	h, err := p.OpenData(id)
	if err != nil {
		return false
	}
	_ = h.Close()
	return true
}

// ImageSize is the size of a volume's image file. A missing image is
// ErrNotFound; a link or anything but a regular file is ErrCorrupt and is
// never followed.
func (p *Pool) ImageSize(id VolumeID) (int64, error) {
	h, err := p.OpenImage(id)
	if err != nil {
		return 0, fmt.Errorf("volume %s: image: %w", id, err)
	}
	defer h.Close()
	fi, err := h.f.Stat()
	if err != nil {
		return 0, fmt.Errorf("volume %s: image: %w", id, err)
	}
	return fi.Size(), nil
}

// ImageStat is the size of a volume's image file and the bytes it holds on the
// pool's filesystem, from a descriptor opened without following links (errors
// as ImageSize).
func (p *Pool) ImageStat(id VolumeID) (size, allocated int64, err error) {
	h, err := p.OpenImage(id)
	if err != nil {
		return 0, 0, fmt.Errorf("volume %s: image: %w", id, err)
	}
	defer h.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(h.f.Fd()), &st); err != nil {
		return 0, 0, fmt.Errorf("volume %s: image: %w", id, err)
	}
	return st.Size, st.Blocks * 512, nil
}
