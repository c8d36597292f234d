package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"
)

const (
	groupsDir     = "groupsnapshots"
	groupMetaFile = "group.json"
	// groupKeyPrefix starts the key part of a group snapshot ID. A snapshot
	// key is 32 hex digits and never starts with it, so a group snapshot ID
	// never parses as a snapshot ID, nor the other way round.
	groupKeyPrefix = "g-"
	// MaxGroupMembers bounds the volumes of one group snapshot: every member
	// is frozen at once, and group.json stays small.
	MaxGroupMembers = 64
	maxGroupMeta    = 64 << 10
)

// GroupSnapshotSchemaVersion is the version of group.json this code writes.
const GroupSnapshotSchemaVersion = 1

// Groups is the pool's view for volume group snapshots: their records
// (groupsnapshots/<key>/group.json) and the IDs of their members. The
// members are ordinary snapshots (Snapshots). A narrow store over the one
// Pool, as Freezes is.
type Groups struct{ p *Pool }

// Groups is the pool's group snapshot records.
func (p *Pool) Groups() Groups { return Groups{p} }

// GroupSnapshotID is the handle of a volume group snapshot: "<pool>@g-<key>",
// or on a share "<pool>@g-<key>.<share>", the rest as in a SnapshotID.
type GroupSnapshotID struct{ SnapshotID }

// String is the group snapshot's identity, never with the tag.
func (id GroupSnapshotID) String() string {
	s := id.SnapshotID.String()
	return id.Pool + SnapshotSep + groupKeyPrefix + s[len(id.Pool)+len(SnapshotSep):]
}

// Wire is the ID as the CO holds it: String and, on a share, the tag.
func (id GroupSnapshotID) Wire() string { return withTag(id.String(), id.Tag) }

// ParseGroupSnapshotID validates a group snapshot ID from the wire before any
// path is built from it, under the rules of ParseSnapshotID.
func ParseGroupSnapshotID(s string) (GroupSnapshotID, error) {
	poolName, rest, ok := strings.Cut(s, SnapshotSep)
	key, isGroup := strings.CutPrefix(rest, groupKeyPrefix)
	if !ok || !isGroup {
		return GroupSnapshotID{}, fmt.Errorf("%w: %q is not a poolcsi group snapshot ID (<pool>@g-<32 hex digits>)", ErrInvalidID, s)
	}
	sid, err := ParseSnapshotID(poolName + SnapshotSep + key)
	if err != nil {
		return GroupSnapshotID{}, fmt.Errorf("%w: %q is not a poolcsi group snapshot ID (<pool>@g-<32 hex digits>)", ErrInvalidID, s)
	}
	return GroupSnapshotID{sid}, nil
}

// NewID is the ID of the group snapshot named name in this pool.
func (gs Groups) NewID(name string) GroupSnapshotID {
	return GroupSnapshotID{gs.p.Snapshots().IDOf(KeyForName(name))}
}

// GroupMember is one volume of a group snapshot and the snapshot of it.
type GroupMember struct {
	SourceVolumeID string `json:"sourceVolumeId"`
	SnapshotID     string `json:"snapshotId"`
}

// GroupSnapshot is the content of group.json: the volumes snapshotted
// together and their member snapshots, ordinary snapshots that name the group.
type GroupSnapshot struct {
	SchemaVersion int           `json:"schemaVersion"`
	ID            string        `json:"id"`
	Name          string        `json:"name"`
	Pool          string        `json:"pool"`
	Members       []GroupMember `json:"members"`
	CreatedAt     time.Time     `json:"createdAt"`
	// ReadyToUse is set once every member is copied; a record without it is
	// a create under way or one a crash interrupted, which the next create of
	// the same name rolls back and starts again.
	ReadyToUse bool `json:"readyToUse"`
	// GroupSources, set only on a part of a group whose members sit on
	// several nodes (docs/design/central-controller.md §7.1), are the IDs of
	// every volume of the whole group, sorted, Members' among them: a Get or
	// Delete names every member snapshot of the group, and each node checks
	// them against these. Empty: the group is this record's members alone.
	GroupSources []string `json:"groupSources,omitempty"`
}

// MemberIDs are the IDs of the member snapshots of the whole group, this
// record's and, for a part, those of the other nodes' parts, sorted.
func (gs Groups) MemberIDs(gid GroupSnapshotID, g *GroupSnapshot) []string {
	sources := g.GroupSources
	if len(sources) == 0 {
		sources = g.Sources()
	}
	out := make([]string, len(sources))
	for i, v := range sources {
		out[i] = gs.MemberID(gid, v).String()
	}
	sort.Strings(out)
	return out
}

// GroupMemberID is the ID of the snapshot of volume vid in group gid, as the node
// holding vid makes it (Groups.MemberID), for whoever does not hold the pool.
func GroupMemberID(gid GroupSnapshotID, vid string) SnapshotID {
	return NewSnapshotID(gid.Pool, memberSnapshotName(gid, vid))
}

// Sources are the IDs of the group's volumes, sorted.
func (g *GroupSnapshot) Sources() []string {
	out := make([]string, len(g.Members))
	for i, m := range g.Members {
		out[i] = m.SourceVolumeID
	}
	return out
}

// memberSnapshotName is the snapshot name of a group's member: derived from
// the group's key and the volume, so a retried create finds its members, and
// a record can name no other snapshot (Groups().Load checks it).
func memberSnapshotName(gid GroupSnapshotID, vid string) string {
	return gid.Key + "/" + vid
}

// MemberID is the ID of the snapshot of volume vid in group gid.
func (gs Groups) MemberID(gid GroupSnapshotID, vid string) SnapshotID {
	return gs.p.Snapshots().NewID(memberSnapshotName(gid, vid))
}

func groupRel(id GroupSnapshotID, name ...string) string {
	return filepath.Join(append([]string{groupsDir, id.Key}, name...)...)
}

// Load reads group.json; a missing group is ErrNotFound. A record
// is refused (ErrCorrupt) unless each member is a volume and the snapshot
// derived from it: a record planted in a shared pool cannot make a delete of
// the group remove any other snapshot.
func (gs Groups) Load(id GroupSnapshotID) (*GroupSnapshot, error) {
	raw, err := gs.p.files().readBeneath(groupRel(id, groupMetaFile), maxGroupMeta)
	if err != nil {
		return nil, fmt.Errorf("read metadata of group snapshot %s: %w", id, notFound(err))
	}
	var g GroupSnapshot
	if err := json.Unmarshal(raw, &g); err != nil {
		return nil, fmt.Errorf("%w: group snapshot %s: %w", ErrCorrupt, id, err)
	}
	if g.SchemaVersion > GroupSnapshotSchemaVersion {
		return nil, fmt.Errorf("%w: group snapshot %s has schema version %d, this driver understands up to %d", ErrCorrupt, id, g.SchemaVersion, GroupSnapshotSchemaVersion)
	}
	if g.ID != id.String() || g.Pool != gs.p.cfg.Name || len(g.Members) == 0 || len(g.Members) > MaxGroupMembers {
		return nil, fmt.Errorf("%w: %s: ID, pool or members are not what a driver writes", ErrCorrupt, filepath.Join(gs.p.cfg.Path, groupRel(id, groupMetaFile)))
	}
	for i, m := range g.Members {
		if _, err := ParseVolumeID(m.SourceVolumeID); err != nil || m.SnapshotID != gs.MemberID(id, m.SourceVolumeID).String() ||
			(i > 0 && g.Members[i-1].SourceVolumeID >= m.SourceVolumeID) {
			return nil, fmt.Errorf("%w: %s: member %d is not one a driver writes", ErrCorrupt, filepath.Join(gs.p.cfg.Path, groupRel(id, groupMetaFile)), i)
		}
	}
	if err := checkGroupSources(g.GroupSources, g.Sources()); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrCorrupt, filepath.Join(gs.p.cfg.Path, groupRel(id, groupMetaFile)), err)
	}
	return &g, nil
}

func (gs Groups) save(id GroupSnapshotID, g *GroupSnapshot) error {
	if err := gs.p.files().checkDir(groupRel(id)); err != nil {
		return err
	}
	g.SchemaVersion = GroupSnapshotSchemaVersion
	raw, err := json.MarshalIndent(g, "", "  ")
	if err != nil {
		return fmt.Errorf("encode metadata of group snapshot %s: %w", id, err)
	}
	return gs.p.files().writeBeneath(groupRel(id, groupMetaFile), append(raw, '\n'), true)
}

// checkGroupSources checks a part's GroupSources: none, or at most
// MaxGroupMembers volume IDs of one pool, sorted, each once, and holding
// every one of members.
func checkGroupSources(all, members []string) error {
	if len(all) == 0 {
		return nil
	}
	if len(all) > MaxGroupMembers {
		return fmt.Errorf("%w: a group snapshot takes at most %d volumes, not %d", ErrInvalidID, MaxGroupMembers, len(all))
	}
	var first VolumeID
	for i, v := range all {
		vid, err := ParseVolumeID(v)
		if err != nil {
			return err
		}
		if i == 0 {
			first = vid
		}
		if vid.Pool != first.Pool || vid.Share != first.Share || (i > 0 && all[i-1] >= v) {
			return fmt.Errorf("%w: the group's volumes are not of one pool, sorted, each once", ErrInvalidID)
		}
	}
	for _, m := range members {
		if _, ok := slices.BinarySearch(all, m); !ok {
			return fmt.Errorf("%w: volume %s is not among the group's volumes", ErrInvalidID, m)
		}
	}
	return nil
}

// Reserve finds or starts the group snapshot named name of the
// volumes sources: its directory and a group.json with readyToUse false,
// under the pool lock, so two controllers of a shared pool agree on one
// record. A group of that name with other volumes is ErrExists.
func (gs Groups) Reserve(ctx context.Context, name string, sources []VolumeID) (*GroupSnapshot, error) {
	return gs.ReservePart(ctx, name, sources, nil)
}

// ReservePart is Reserve of this node's part of a group whose volumes sit on
// several nodes: sources are this node's, all (sorted, holding sources) the
// whole group's; nil all is Reserve.
func (gs Groups) ReservePart(ctx context.Context, name string, sources []VolumeID, all []string) (*GroupSnapshot, error) {
	if err := ValidateVolumeName(name); err != nil {
		return nil, err
	}
	if len(sources) == 0 || len(sources) > MaxGroupMembers {
		return nil, fmt.Errorf("%w: a group snapshot takes 1 to %d volumes, not %d", ErrInvalidID, MaxGroupMembers, len(sources))
	}
	id := gs.NewID(name)
	members := make([]GroupMember, len(sources))
	for i, vid := range sources {
		if vid.Pool != gs.p.cfg.Name {
			return nil, fmt.Errorf("%w: volume %s is not in pool %s", ErrInvalidID, vid, gs.p.cfg.Name)
		}
		members[i] = GroupMember{SourceVolumeID: vid.String(), SnapshotID: gs.MemberID(id, vid.String()).String()}
	}
	sort.Slice(members, func(i, j int) bool { return members[i].SourceVolumeID < members[j].SourceVolumeID })
	for i := 1; i < len(members); i++ {
		if members[i].SourceVolumeID == members[i-1].SourceVolumeID {
			return nil, fmt.Errorf("%w: volume %s is named twice", ErrInvalidID, members[i].SourceVolumeID)
		}
	}
	all = slices.Clone(all)
	if len(all) > 0 {
		srcs := make([]string, len(members))
		for i, m := range members {
			srcs[i] = m.SourceVolumeID
		}
		if err := checkGroupSources(all, srcs); err != nil {
			return nil, err
		}
	}
	unlock, err := gs.p.lockToCreate(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if g, err := gs.Load(id); err == nil {
		switch {
		case g.Name != name:
			return nil, fmt.Errorf("%w: group snapshot key %s is taken by %q (hash collision)", ErrCorrupt, id.Key, g.Name)
		case !slices.Equal(g.Members, members) || !slices.Equal(g.GroupSources, all):
			return nil, fmt.Errorf("%w: group snapshot %q already exists of volumes %s", ErrExists, name, strings.Join(g.Sources(), ", "))
		}
		return g, nil
	} else if !missing(err) {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(gs.p.cfg.Path, groupRel(id)), 0o750); err != nil {
		return nil, fmt.Errorf("create group snapshot %s: %w", id, err)
	}
	g := &GroupSnapshot{ID: id.String(), Name: name, Pool: gs.p.cfg.Name, Members: members, CreatedAt: time.Now().UTC(), GroupSources: all}
	if err := gs.save(id, g); err != nil {
		return nil, err
	}
	return g, nil
}

// MarkReady records that every member of the group is copied.
func (gs Groups) MarkReady(id GroupSnapshotID, g *GroupSnapshot) error {
	g.ReadyToUse = true
	return gs.save(id, g)
}

// ReserveMember reserves the snapshot of src as a member of group g, as
// Snapshots().Reserve does for an independent one; its record names the group and
// carries the group's creation time.
func (gs Groups) ReserveMember(ctx context.Context, gid GroupSnapshotID, g *GroupSnapshot, src *Volume, needBytes int64) (*Snapshot, error) {
	return gs.p.Snapshots().reserve(ctx, memberSnapshotName(gid, src.ID), gid.String(), g.CreatedAt, src, needBytes)
}

// Delete removes a group's record, after its members; nil when it
// does not exist. Like a snapshot, it goes through the trash under the pool
// lock.
func (gs Groups) Delete(ctx context.Context, id GroupSnapshotID) error {
	unlock, err := gs.p.LockPool(ctx)
	if err != nil {
		return err
	}
	var ours []string
	if err = gs.p.files().checkDir(groupsDir); err == nil {
		_, ours, err = gs.p.files().toTrash(groupsDir, id.Key, "g-", false)
	} else if missing(err) {
		err = nil
	}
	unlock()
	if err != nil {
		return fmt.Errorf("delete group snapshot %s: %w", id, err)
	}
	if err := gs.p.files().emptyTrash("g-"+id.Key, ours, nil); err != nil {
		return fmt.Errorf("delete group snapshot %s: %w", id, err)
	}
	return nil
}

// GroupSnapshotEntry is one listed group snapshot, or the error that kept it
// from loading.
type GroupSnapshotEntry struct {
	ID    GroupSnapshotID
	Group *GroupSnapshot
	Err   error
}

// List returns the pool's group snapshots sorted by ID.
func (gs Groups) List() ([]GroupSnapshotEntry, error) {
	des, err := gs.p.files().readDir(groupsDir)
	if missing(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%w: list group snapshots of pool %s: %w", ErrUnavailable, gs.p.cfg.Name, err)
	}
	var out []GroupSnapshotEntry
	for _, de := range des {
		if !de.IsDir() || !keyRE.MatchString(de.Name()) {
			continue
		}
		id := GroupSnapshotID{gs.p.Snapshots().IDOf(de.Name())}
		g, err := gs.Load(id)
		if missing(err) {
			continue // a create or delete under way
		}
		out = append(out, GroupSnapshotEntry{ID: id, Group: g, Err: err})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID.Key < out[j].ID.Key })
	return out, nil
}
