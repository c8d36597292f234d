package freeze

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// A group snapshot whose members sit on several nodes (docs/design/central-controller.md
// §7.1): central asks every node holding members to freeze and hold them
// (HoldGroup), and only once every node answered frozen asks each to copy its
// members under its hold; then the node lets the hold go (ThawGroup). A hold lasts
// across calls, so unlike a one-node group's freeze it holds each member's volume
// lock from its freeze to its thaw (a stage of a member that is not staged yet
// waits: ABORTED, retried after the thaw) and thaws by itself at its bound,
// whatever central does. Its freezes are FreezeVolumeHere's, recorded first in this
// node's own records, so a restart thaws them (ThawAfterCrash) and its hold is gone
// (a copy then answers ABORTED); each is charged to its volume's budget.

// HolderGroupHold is the holder of a member's in-process lock while a group's
// hold lasts.
const HolderGroupHold = "a group snapshot's hold across nodes"

// GroupMember is a member volume of a group hold, in a pool this node serves.
type GroupMember struct {
	Pool *pool.Pool
	ID   pool.VolumeID
}

// GroupHold is a hold in force: its nonce and how long it lasts from its start.
type GroupHold struct {
	Nonce string
	Bound time.Duration
}

// groupHold is one hold of a group on this node.
type groupHold struct {
	group   string
	nonce   string
	members []string // sorted
	since   time.Time
	bound   time.Duration
	frozen  []*groupFrozen
	release []func() // the members' volume locks
	timer   *time.Timer
}

type groupFrozen struct {
	local *localHold
	key   string
}

// HoldGroup freezes every member staged here and holds every member's lock for at
// most bound (capped by --freeze-max-hold and each frozen volume's budget). A hold
// of the group with the same members still in force is answered again (a retried
// call); one with other members, or one no longer in force, is let go first. On
// error nothing is left frozen or locked.
func (f *Freezer) HoldGroup(ctx context.Context, group string, members []GroupMember, bound time.Duration) (GroupHold, error) {
	log := klog.FromContext(ctx).WithValues("groupSnapshot", group)
	if bound <= 0 {
		return GroupHold{}, csierr.Failf(csierr.ErrInvalid, "a group hold needs a positive bound, not %s", bound)
	}
	if !f.Recovered() {
		return GroupHold{}, csierr.Failf(pool.ErrBusy, "group snapshot %s: the thaws after this node plugin's restart are not done yet; retry", group)
	}
	ids := make([]string, len(members))
	for i, m := range members {
		ids[i] = m.ID.String()
	}
	sort.Strings(ids)
	if h := f.groupHoldOf(group); h != nil {
		if slices.Equal(h.members, ids) && f.inForce(h) == "" {
			return GroupHold{Nonce: h.nonce, Bound: h.bound}, nil
		}
		f.endGroupHold(ctx, h, "a new hold of the group was asked for")
	}
	sorted := slices.Clone(members)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].ID.String() < sorted[j].ID.String() })
	h := &groupHold{group: group, nonce: pool.NewFreezeNonce(), members: ids, since: f.Now(), bound: min(bound, f.Timing.MaxHold)}
	ok := false
	defer func() {
		if !ok {
			f.letGo(ctx, h)
		}
	}()
	for _, m := range sorted {
		release, err := f.deps.Lock(m.ID.String(), HolderGroupHold)
		if err != nil {
			return GroupHold{}, err
		}
		h.release = append(h.release, release)
		if err := f.holdMember(ctx, h, m); err != nil {
			return GroupHold{}, fmt.Errorf("group snapshot %s: volume %s: %w", group, m.ID, err)
		}
	}
	f.mu.Lock()
	if f.groups == nil {
		f.groups = map[string]*groupHold{}
	}
	f.groups[group] = h
	// Armed last, for the shortest bound of its freezes: the kernel's thaw armed
	// with each freeze fires no earlier.
	h.timer = time.AfterFunc(h.bound, func() {
		f.endGroupHold(context.WithoutCancel(ctx), h, "its bound passed")
	})
	f.mu.Unlock()
	ok = true
	log.Info("Holding a group snapshot's members for a copy across nodes", "members", ids, "frozen", len(h.frozen), "bound", h.bound)
	return GroupHold{Nonce: h.nonce, Bound: h.bound}, nil
}

// holdMember freezes m if this node staged it read-write and it can be frozen; a
// member written here that cannot be frozen refuses the group (its copy would be of
// another instant).
func (f *Freezer) holdMember(ctx context.Context, h *groupHold, m GroupMember) error {
	v, err := m.Pool.Load(m.ID)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return csierr.Failf(pool.ErrNotFound, "volume %s does not exist in pool %s on node %s", m.ID, m.Pool.Name(), f.deps.NodeID)
	case err != nil:
		return err
	case v.State != pool.StateReady:
		return csierr.Failf(pool.ErrNotReady, "volume %s is still being created", m.ID)
	}
	var writers []string
	for _, st := range v.Staged {
		if !st.ReadOnly {
			writers = append(writers, st.Node)
		}
	}
	if len(writers) == 0 {
		return nil // nothing writes to it, and its lock keeps it so
	}
	if !Freezable(v) {
		return csierr.Failf(csierr.ErrInUse, "volume %s cannot be frozen (not an image volume with a filesystem) and is staged read-write on %s: the group would not be one instant; stop its writers and retry",
			m.ID, strings.Join(writers, ", "))
	}
	dev, key, err := f.ownDevice(m.Pool, m.ID)
	if err != nil {
		return err
	}
	if dev == "" {
		return nil // staged, but no device of it here: nothing writes to it here
	}
	allowed, refused := f.allowance(key, f.Now(), f.Timing)
	if refused != "" {
		return csierr.Failf(pool.ErrBusy, "%s", refused)
	}
	for _, fr := range h.frozen {
		if fr.key == key {
			return nil // the same device, through another member
		}
	}
	h.bound = min(h.bound, allowed)
	local, why, err := f.FreezeVolumeHere(ctx, m.ID, dev, h.bound)
	switch {
	case err != nil:
		return csierr.Failf(pool.ErrUnavailable, "freeze: %w", err)
	case local == nil:
		klog.FromContext(ctx).Info("Not freezing a member of a group hold", "volume", m.ID, "why", why)
		return nil
	}
	h.frozen = append(h.frozen, &groupFrozen{local: local, key: key})
	return nil
}

func (f *Freezer) groupHoldOf(group string) *groupHold {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.groups[group]
}

// inForce is "" when h still holds: its bound not passed by this node's clock and
// no filesystem thawed by the kernel's armed thaw; else why not.
func (f *Freezer) inForce(h *groupHold) string {
	if f.Now().Sub(h.since) >= h.bound {
		return fmt.Sprintf("its bound of %s passed", h.bound)
	}
	for _, fr := range h.frozen {
		if fr.local.fs.Expired() {
			return fmt.Sprintf("the filesystem of volume %s was thawed at its bound", fr.local.id)
		}
	}
	return ""
}

// GroupHeld checks that the hold of group with nonce is in force over exactly
// members: nil, or ABORTED saying why not.
func (f *Freezer) GroupHeld(group, nonce string, members []string) error {
	h := f.groupHoldOf(group)
	switch {
	case h == nil || h.nonce != nonce:
		return csierr.Failf(pool.ErrBusy, "group snapshot %s: node %s holds no hold of nonce %q (it ended, or this node plugin restarted): retry", group, f.deps.NodeID, nonce)
	case !slices.Equal(h.members, sortedCopy(members)):
		return csierr.Failf(pool.ErrBusy, "group snapshot %s: node %s holds other members (%s): retry", group, f.deps.NodeID, strings.Join(h.members, ", "))
	}
	if why := f.inForce(h); why != "" {
		return csierr.Failf(pool.ErrBusy, "group snapshot %s: the hold on node %s ended (%s), so a copy would not be of the group's instant: retry", group, f.deps.NodeID, why)
	}
	return nil
}

func sortedCopy(s []string) []string {
	out := slices.Clone(s)
	sort.Strings(out)
	return out
}

// ThawGroup lets the hold of group go: the one of nonce, or any with nonce "". A
// hold already gone is success.
func (f *Freezer) ThawGroup(ctx context.Context, group, nonce string) {
	h := f.groupHoldOf(group)
	if h == nil || (nonce != "" && h.nonce != nonce) {
		return
	}
	f.endGroupHold(ctx, h, "thawed after the copy, or on central's word")
}

// endGroupHold thaws and unlocks h, once, if it is still the group's hold.
func (f *Freezer) endGroupHold(ctx context.Context, h *groupHold, why string) {
	f.mu.Lock()
	if f.groups[h.group] != h {
		f.mu.Unlock()
		return
	}
	delete(f.groups, h.group)
	if h.timer != nil {
		h.timer.Stop()
	}
	f.mu.Unlock()
	f.letGo(ctx, h)
	klog.FromContext(ctx).Info("Let a group snapshot's hold go", "groupSnapshot", h.group, "why", why, "held", f.Now().Sub(h.since).Round(time.Millisecond))
}

// letGo thaws h's freezes (charging each to its budget) and releases its locks.
func (f *Freezer) letGo(ctx context.Context, h *groupHold) {
	now := f.Now()
	for i := len(h.frozen) - 1; i >= 0; i-- {
		fr := h.frozen[i]
		if err := f.thawHere(ctx, fr.local); err != nil {
			klog.FromContext(ctx).Error(err, "Thawing a member of a group hold failed; its bound thaws it", "volume", fr.local.id, "path", fr.local.path)
		}
		f.spend(fr.key, h.since, now)
	}
	h.frozen = nil
	for i := len(h.release) - 1; i >= 0; i-- {
		h.release[i]()
	}
	h.release = nil
}

// endAllGroupHolds lets every hold go (the node plugin stops).
func (f *Freezer) endAllGroupHolds(ctx context.Context, why string) {
	f.mu.Lock()
	var all []*groupHold
	for _, h := range f.groups {
		all = append(all, h)
	}
	f.mu.Unlock()
	for _, h := range all {
		f.endGroupHold(ctx, h, why)
	}
}
