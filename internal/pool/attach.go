package pool

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// The per-node publish index answers "how many volumes of this pool are
// published to node N?" at the cost of N's volumes, for the attach limit
// (--max-volumes-per-node) that ControllerPublishVolume holds, instead of
// reading every volume.json of the pool:
//
//	nodes/<node>.published/<key>   one empty file per volume published to node
//	nodes/<node>.lock              flock: serialises count-then-publish to node
//	nodes/.published-index-v1      the index was built; absent, it is rebuilt
//
// volume.json's publish records stay the truth; the index is derived, kept a
// superset of them across crashes, and repaired from them:
//   - a marker is made, and made durable, before the publish record is saved,
//     and removed only after the record is gone, so a crash can leave a marker
//     without a record (a stale one) but never a record without a marker;
//   - a stale marker only ever counts one volume too many, which can only
//     refuse a publish; so markers are checked against volume.json (and
//     stale ones removed) only when the count reaches the limit, just before
//     a refusal. A marker whose volume's lock is held is a publish in flight,
//     and counts;
//   - a pool without the index (made by an older version) gets it rebuilt from
//     every volume.json once, the old cost, before its first count.
//
// The node names in these paths are validated node IDs: no '/', no "..";
// each node's entries end in their own suffix, so no two nodes' names meet.

const (
	publishedSuffix  = ".published"
	nodeLockSuffix   = ".lock"
	publishIndexDone = ".published-index-v1"
)

func (pb Publications) publishedDir(node string) string {
	return filepath.Join(pb.p.cfg.Path, nodesDir, node+publishedSuffix)
}

// LockNode takes node's attach-count lock in this pool: on a shared pool the
// other counter is another controller, so it is a lock file. Lock order: a
// volume's lock file, then node locks in pool-name order, then the pool lock.
func (pb Publications) LockNode(ctx context.Context, node string) (unlock func(), err error) {
	if err := ValidateNodeID(node); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(pb.p.cfg.Path, nodesDir), 0o750); err != nil {
		return nil, fmt.Errorf("pool %s: lock node %s: %w", pb.p.cfg.Name, node, err)
	}
	return pb.p.files().lockFileAt(ctx, filepath.Join(nodesDir, node+nodeLockSuffix), true)
}

// Mark adds volume id to node's index, durably: it must be on disk
// before the publish record it stands for.
func (pb Publications) Mark(node string, id VolumeID) error {
	return pb.mark(node, id, true)
}

func (pb Publications) mark(node string, id VolumeID, durable bool) error {
	if err := ValidateNodeID(node); err != nil {
		return err
	}
	dir := pb.publishedDir(node)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("pool %s: index volume %s on node %s: %w", pb.p.cfg.Name, id, node, err)
	}
	if err := pb.p.files().touch(filepath.Join(nodesDir, node+publishedSuffix, id.Key)); err != nil {
		return fmt.Errorf("pool %s: index volume %s on node %s: %w", pb.p.cfg.Name, id, node, err)
	}
	if !durable {
		return nil
	}
	return syncDir(dir)
}

// Unmark removes volume id from node's index, after its publish
// record is gone. Not fsynced: a removal a crash undoes leaves a stale marker,
// which the count repairs.
func (pb Publications) Unmark(node string, id VolumeID) error {
	if err := ValidateNodeID(node); err != nil {
		return err
	}
	err := os.Remove(filepath.Join(pb.publishedDir(node), id.Key))
	if err != nil && !missing(err) {
		return fmt.Errorf("pool %s: unindex volume %s on node %s: %w", pb.p.cfg.Name, id, node, err)
	}
	return nil
}

// Count counts the volumes of this pool node's index holds, leaving
// out except (the volume being published, which may have a stale marker).
// With verify, each marker is checked against its volume.json first and stale
// ones are removed. The caller holds node's lock (LockNode).
func (pb Publications) Count(node string, except VolumeID, verify bool) (int64, error) {
	if err := ValidateNodeID(node); err != nil {
		return 0, err
	}
	dir := pb.publishedDir(node)
	names, err := readNames(dir)
	if missing(err) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("pool %s: count volumes published to node %s: %w", pb.p.cfg.Name, node, err)
	}
	var n int64
	for _, name := range names {
		if name == except.Key || !keyRE.MatchString(name) {
			continue
		}
		if verify && pb.staleMarker(node, VolumeID{Pool: pb.p.cfg.Name, Key: name}) {
			if err := os.Remove(filepath.Join(dir, name)); err != nil && !missing(err) {
				return 0, fmt.Errorf("pool %s: remove stale index entry %s of node %s: %w", pb.p.cfg.Name, name, node, err)
			}
			continue
		}
		n++
	}
	return n, nil
}

// staleMarker tells whether node's marker of id stands for no publish record:
// the volume is gone or not published to node, and no call holds its lock
// (a publish holds it from before it makes the marker until its record is
// saved). Anything unclear (a damaged volume.json) counts as published.
func (pb Publications) staleMarker(node string, id VolumeID) bool {
	if lockHeld(pb.p.cfg.Path, volumeRel(id, lockFile)) {
		return false
	}
	v, err := pb.p.Load(id)
	switch {
	case missing(err):
		return true
	case err != nil:
		return false
	}
	_, published := v.PublishedTo(node)
	return !published
}

// EnsureIndex builds the per-node publish index from every volume.json
// if this pool does not have it yet (a pool an older version made), once per
// pool and process. Markers are only ever added here, so it may run beside
// publishes (which add their marker before their record) and beside another
// controller's rebuild.
func (pb Publications) EnsureIndex() error {
	if pb.p.indexed.Load() {
		return nil
	}
	done := filepath.Join(pb.p.cfg.Path, nodesDir, publishIndexDone)
	if _, err := os.Stat(done); err == nil {
		pb.p.indexed.Store(true)
		return nil
	}
	entries, err := pb.p.List()
	if err != nil {
		return fmt.Errorf("pool %s: build the publish index: %w", pb.p.cfg.Name, err)
	}
	dirs := map[string]bool{}
	for _, e := range entries {
		if e.Volume == nil {
			continue
		}
		for _, r := range e.Volume.Published {
			if err := pb.mark(r.Node, e.ID, false); err != nil {
				return err
			}
			dirs[pb.publishedDir(r.Node)] = true
		}
	}
	for d := range dirs {
		if err := syncDir(d); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Join(pb.p.cfg.Path, nodesDir), 0o750); err != nil {
		return fmt.Errorf("pool %s: build the publish index: %w", pb.p.cfg.Name, err)
	}
	if err := fsx.WriteFilePath(done, []byte("1\n"), true); err != nil {
		return err
	}
	pb.p.indexed.Store(true)
	return nil
}
