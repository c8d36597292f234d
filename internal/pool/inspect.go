package pool

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// OpenExisting opens a pool directory that already exists for inspection by an
// operator tool: the name comes from its pool.json, and nothing is created.
func OpenExisting(path string) (*Pool, error) {
	path = filepath.Clean(path)
	raw, err := fsx.ReadFile(path, poolMeta, maxPoolMeta)
	if err != nil {
		return nil, fmt.Errorf("%s is not a poolcsi pool (no readable %s): %w", path, poolMeta, err)
	}
	var info poolInfo
	if err := json.Unmarshal(raw, &info); err != nil {
		return nil, fmt.Errorf("%s: %s is damaged: %w", path, poolMeta, err)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	// Shared, so that Open never creates or initialises anything.
	return Open(Config{Name: info.Name, Path: abs, Shared: true, Share: info.Share, NoLayout: true})
}

// Leftover is something in a pool's volumes directory that is not a volume: the
// remains of an interrupted create or delete, or a stranger.
type Leftover struct {
	Path   string
	Reason string
}

// StaleCreate is how long a volume may stay in state creating before Leftovers
// reports it: a create that has not finished by then was abandoned, and its
// CreateVolume retry will never come if the PVC is gone.
const StaleCreate = time.Hour

// Leftovers lists what does not belong in the pool's volumes directory. It only
// reads; removing anything is the operator's decision.
func (p *Pool) Leftovers(now time.Time) ([]Leftover, error) {
	dir := filepath.Join(p.cfg.Path, volumesDir)
	des, err := p.files().readDir(volumesDir)
	if err != nil {
		return nil, fmt.Errorf("list pool %s: %w", p.cfg.Name, err)
	}
	var out []Leftover
	for _, de := range des {
		path := filepath.Join(dir, de.Name())
		switch {
		case strings.HasPrefix(de.Name(), ".deleting-"):
			if !p.files().changing() { // else a delete under way, maybe on another node
				out = append(out, Leftover{path, "an interrupted DeleteVolume; the volume is gone, its data may remain: remove it"})
			}
		case !de.IsDir() || !keyRE.MatchString(de.Name()):
			out = append(out, Leftover{path, "not a poolcsi volume directory"})
		default:
			id := p.IDOf(de.Name())
			if !lockHeld(p.cfg.Path, volumeRel(id, lockFile)) && !p.files().changing() { // else a write under way
				out = append(out, tempLeftovers(path)...)
			}
			e, listed := p.loadListed(nil, id)
			v, err := e.Volume, e.Err
			switch {
			case !listed: // deleted since, or a create under way
			case missing(err):
				out = append(out, Leftover{path, "volume directory without volume.json (a create interrupted before its metadata was written)"})
			case err == nil && v.State == StateCreating && now.Sub(v.CreatedAt) > StaleCreate:
				out = append(out, Leftover{path, fmt.Sprintf("volume %q has been creating since %s; if its PVC is gone, delete the volume", v.Name, v.CreatedAt.Format(time.RFC3339))})
			}
		}
	}
	out = append(out, p.files().trashLeftovers(now)...)
	out = append(out, p.files().damagedFiles()...)
	sdir := filepath.Join(p.cfg.Path, snapshotsDir)
	if sdes, err := p.files().readDir(snapshotsDir); err == nil {
		for _, de := range sdes {
			if de.IsDir() && keyRE.MatchString(de.Name()) {
				out = append(out, tempLeftovers(filepath.Join(sdir, de.Name()))...)
			}
		}
	}
	out = append(out, p.Groups().leftovers(now)...)
	out = append(out, p.Freezes().leftovers(now)...)
	return out, nil
}

// StaleFreeze is how old a freeze request, answer or record must be before
// Leftovers names it: a freeze lasts one copy, and a node lets go after its
// --freeze-max-hold (a minute by default) whatever the controller does.
const StaleFreeze = 10 * time.Minute

// leftovers lists what freezes across nodes (freeze.go) left behind: a
// filesystem a node recorded as frozen long ago (its writers are held until
// that node's plugin thaws it), requests no controller withdrew, answers no
// node removed, and whatever else sits in an inbox.
func (fr Freezes) leftovers(now time.Time) []Leftover {
	var out []Leftover
	age := func(rel string) (time.Duration, bool) {
		fi, err := os.Lstat(filepath.Join(fr.p.cfg.Path, rel))
		if err != nil {
			return 0, false
		}
		return now.Sub(fi.ModTime()), true
	}
	if fs, err := fr.Records(); err == nil {
		for _, f := range fs {
			rel := volumeRel(f.Volume, freezeFile)
			if a, ok := age(rel); ok && a > StaleFreeze {
				out = append(out, Leftover{filepath.Join(fr.p.cfg.Path, rel), fmt.Sprintf(
					"node %s froze this volume's filesystem at %s %s ago and has not thawed it since: its node plugin thaws it when it starts and at its maximum hold (is it running?); the volume's writers there wait until then",
					f.Node, f.Path, a.Round(time.Second))})
			}
		}
	}
	des, err := fr.p.files().readDir(freezeDir)
	if err != nil {
		if !missing(err) {
			out = append(out, Leftover{filepath.Join(fr.p.cfg.Path, freezeDir), "damaged: " + err.Error()})
		}
		return out
	}
	for _, de := range des {
		path := filepath.Join(fr.p.cfg.Path, freezeDir, de.Name())
		if !de.IsDir() || ValidateNodeID(de.Name()) != nil {
			out = append(out, Leftover{path, "not a node's freeze inbox"})
			continue
		}
		node := de.Name()
		reqs, acked, err := fr.Inbox(node)
		if err != nil {
			out = append(out, Leftover{path, "damaged: " + err.Error()})
			continue
		}
		asked := map[string]bool{}
		for _, r := range reqs {
			rel := filepath.Join(freezeDir, node, r.Name)
			if r.Err != nil {
				out = append(out, Leftover{filepath.Join(fr.p.cfg.Path, rel), "damaged: " + r.Err.Error()})
				continue
			}
			asked[r.Volume.Key] = true // its answer goes with it
			if a, ok := age(rel); ok && a > StaleFreeze {
				out = append(out, Leftover{filepath.Join(fr.p.cfg.Path, rel), fmt.Sprintf(
					"a freeze request no controller withdrew (%s old: its controller died during a copy?); node %s thawed at its maximum hold and will not freeze for it again: remove it", a.Round(time.Second), node)})
			}
		}
		for _, id := range acked {
			rel := freezeRel(node, id, ackSuffix)
			if a, ok := age(rel); ok && a > StaleFreeze && !asked[id.Key] {
				out = append(out, Leftover{filepath.Join(fr.p.cfg.Path, rel), fmt.Sprintf(
					"node %s's answer to a freeze request that is gone (%s old), which its node plugin removes at its next look (is it running?): harmless", node, a.Round(time.Second))})
			}
		}
	}
	return out
}

// leftovers lists what interrupted group snapshot creates and deletes
// left: a group directory without its record, a record never finished, a
// finished one missing a member, a member whose group record is gone. A
// group's record and its members are what they should be otherwise: known,
// never orphans.
func (gs Groups) leftovers(now time.Time) []Leftover {
	var out []Leftover
	gdir := filepath.Join(gs.p.cfg.Path, groupsDir)
	des, err := gs.p.files().readDir(groupsDir)
	if err != nil && !missing(err) {
		return []Leftover{{gdir, "damaged: " + err.Error()}}
	}
	for _, de := range des {
		path := filepath.Join(gdir, de.Name())
		if !de.IsDir() || !keyRE.MatchString(de.Name()) {
			out = append(out, Leftover{path, "not a poolcsi group snapshot directory"})
			continue
		}
		out = append(out, tempLeftovers(path)...)
		id := GroupSnapshotID{gs.p.Snapshots().IDOf(de.Name())}
		g, err := gs.Load(id)
		switch {
		case missing(err):
			out = append(out, Leftover{path, "group snapshot directory without group.json (a create interrupted before its record was written): remove it"})
		case err != nil:
			// damagedFiles names a link or an oversized file; this, the rest.
			if !errors.Is(err, fsx.ErrUnsafe) {
				out = append(out, Leftover{path, "damaged: " + err.Error()})
			}
		case !g.ReadyToUse && now.Sub(g.CreatedAt) > StaleCreate:
			out = append(out, Leftover{path, fmt.Sprintf("group snapshot %q has been creating since %s; its next create cuts it again, or DeleteVolumeGroupSnapshot removes it", g.Name, g.CreatedAt.Format(time.RFC3339))})
		case g.ReadyToUse:
			for _, m := range g.Members {
				if !gs.p.Snapshots().Exists(gs.MemberID(id, m.SourceVolumeID)) {
					out = append(out, Leftover{path, fmt.Sprintf("group snapshot %q lacks its member %s (of volume %s): delete the group", g.Name, m.SnapshotID, m.SourceVolumeID)})
				}
			}
		}
	}
	snaps, err := gs.p.Snapshots().List()
	if err != nil {
		return out
	}
	for _, e := range snaps {
		if e.Err != nil || e.Snapshot.GroupSnapshotID == "" {
			continue
		}
		gid, err := ParseGroupSnapshotID(e.Snapshot.GroupSnapshotID)
		if err != nil {
			continue // Snapshots().Load refuses such a record
		}
		if _, err := gs.Load(gid); missing(err) {
			out = append(out, Leftover{gs.p.Snapshots().Dir(e.ID), fmt.Sprintf("a member of group snapshot %s, whose record is gone (an interrupted group delete): delete the snapshot", gid)})
		}
	}
	return out
}

// tempLeftovers lists the temp files of metadata writes in dir (a volume's or
// a snapshot's directory): a write in progress, or one a crash interrupted.
// Those older than fsx.StaleTemp are certainly the latter.
func tempLeftovers(dir string) []Leftover {
	des, err := fsx.ReadDir(filepath.Dir(dir), filepath.Base(dir))
	if err != nil {
		return nil
	}
	var out []Leftover
	for _, de := range des {
		if fsx.IsTemp(de.Name()) {
			out = append(out, Leftover{filepath.Join(dir, de.Name()), "a metadata write interrupted by a crash (or in progress right now); the metadata itself is intact: remove it"})
		}
	}
	return out
}

// damagedFiles lists the pool's own small files (not volume.json, which the
// volume scan reads) that are not what poolcsi writes there: a link, a FIFO, a
// device, a directory or a file larger than its kind ever is. Anyone who can
// write a shared pool can plant one; the driver refuses each (ErrCorrupt), and
// this is where the operator hears which.
func (fl files) damagedFiles() []Leftover {
	var out []Leftover
	check := func(rel string, max int64) {
		if err := fsx.CheckFile(fl.root, rel, max); err != nil && !missing(err) {
			out = append(out, Leftover{filepath.Join(fl.root, rel), "damaged: " + err.Error()})
		}
	}
	check(poolMeta, maxPoolMeta)
	check(poolLock, maxLockFile)
	check(ledgerFile, maxLedger)
	check(reserveFile, reserveBytes)
	check(filepath.Join(quotaIDsDir, quotaIndexDone), maxMarker)
	if kinds, err := fl.readDir(quotaIDsDir); err == nil {
		for _, k := range kinds {
			if !k.IsDir() {
				continue
			}
			claims, err := fl.readDir(filepath.Join(quotaIDsDir, k.Name()))
			if err != nil {
				out = append(out, Leftover{filepath.Join(fl.root, quotaIDsDir, k.Name()), "damaged: " + err.Error()})
			}
			for _, c := range claims {
				check(filepath.Join(quotaIDsDir, k.Name(), c.Name()), maxQuotaClaim)
			}
		}
	}
	// The small files of each volume, snapshot and group snapshot directory.
	for _, kind := range []struct {
		dir   string
		files map[string]int64
	}{
		{volumesDir, map[string]int64{lockFile: maxLockFile, freezeFile: maxFreezeRecord}},
		{snapshotsDir, map[string]int64{snapshotMetaFile: maxSnapshotMeta}},
		{groupsDir, map[string]int64{groupMetaFile: maxGroupMeta}},
	} {
		des, _ := fl.readDir(kind.dir)
		for _, de := range des {
			if de.IsDir() && keyRE.MatchString(de.Name()) {
				for name, max := range kind.files {
					check(filepath.Join(kind.dir, de.Name(), name), max)
				}
			}
		}
	}
	if leases, err := fl.readDir(leasesDir); err == nil {
		for _, de := range leases {
			check(filepath.Join(leasesDir, de.Name()), maxLease)
		}
	}
	des, err := fl.readDir(nodesDir)
	if err != nil && !missing(err) {
		out = append(out, Leftover{filepath.Join(fl.root, nodesDir), "damaged: " + err.Error()})
	}
	for _, de := range des {
		name := de.Name()
		switch {
		case strings.HasSuffix(name, ".json"):
			check(filepath.Join(nodesDir, name), maxNodeRecord)
		case strings.HasSuffix(name, nodeLockSuffix):
			check(filepath.Join(nodesDir, name), maxLockFile)
		case name == publishIndexDone:
			check(filepath.Join(nodesDir, name), maxMarker)
		case strings.HasSuffix(name, publishedSuffix):
			marks, err := fl.readDir(filepath.Join(nodesDir, name))
			if err != nil {
				out = append(out, Leftover{filepath.Join(fl.root, nodesDir, name), "damaged: " + err.Error()})
			}
			for _, m := range marks {
				check(filepath.Join(nodesDir, name, m.Name()), maxMarker)
			}
		}
	}
	return out
}

// trashGrace is how long a trash entry may stay before Leftovers reports it
// even though nobody holds its lock: a delete removes its entry right after
// renaming it there, outside the pool lock (snapshots have no lock file).
const trashGrace = 10 * time.Minute

// trashEntryTime is the time a trash entry's name gives (<prefix><key>-<unix
// nanoseconds>, toTrash).
func trashEntryTime(name string) (time.Time, bool) {
	i := strings.LastIndexByte(name, '-')
	if i < 0 {
		return time.Time{}, false
	}
	ns, err := strconv.ParseInt(name[i+1:], 10, 64)
	if err != nil || ns <= 0 {
		return time.Time{}, false
	}
	return time.Unix(0, ns), true
}

// trashLeftovers lists what interrupted deletes left in the pool's trash.
func (fl files) trashLeftovers(now time.Time) []Leftover {
	des, err := fl.readDir(trashDir)
	if err != nil {
		return nil
	}
	var out []Leftover
	for _, de := range des {
		path := filepath.Join(fl.root, trashDir, de.Name())
		if lockHeld(fl.root, filepath.Join(trashDir, de.Name(), lockFile)) {
			continue // a delete under way, here or on another node
		}
		// The change time: a rename sets it, and keeps the mtime. Not every
		// filesystem's rename sets it (a CephFS kept the old one, and a
		// delete still under way on another node was reported), so the
		// time in the entry's name, which the rename gave it, counts too. A
		// name anyone wrote can only hide a leftover from this report.
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err == nil && now.Sub(time.Unix(st.Ctim.Unix())) < trashGrace {
			continue
		}
		if at, ok := trashEntryTime(de.Name()); ok && now.Sub(at) < trashGrace {
			continue
		}
		out = append(out, Leftover{path, "an interrupted delete; the volume or snapshot is gone, its data remains: retry the delete or remove it"})
	}
	return out
}
