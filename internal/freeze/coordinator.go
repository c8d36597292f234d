package freeze

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Freezing across nodes (docs/snapshots.md#freezing-across-nodes). The
// controller that copies an image volume freezes its filesystem wherever it
// is staged read-write: on its own node directly (freezeIfStagedHere), on
// another through a request in that node's inbox in the pool, which the
// node's agent (agent.go) answers. No clock is compared between
// nodes: the node writes "thawed" before it thaws early, so a controller
// that still reads "frozen" after its copy knows the whole copy happened
// while the filesystem was frozen.

// Member is one volume to freeze.
type Member struct {
	Pool *pool.Pool
	ID   pool.VolumeID
	Vol  *pool.Volume
}

// remoteFreeze is a request this controller put in another node's inbox.
type remoteFreeze struct {
	pool  *pool.Pool
	id    pool.VolumeID
	node  string
	nonce string
	// asked is when the request was written, by this controller's clock:
	// the node's freeze began after it, so it lasts at least the bound its
	// answer gives from then.
	asked time.Time
	// answered: the node's answer settled it (frozen, or nothing to freeze);
	// frozen: the answer was "frozen", to be checked again after the copy.
	answered, frozen bool
}

// quiesce freezes the filesystem of image volume v wherever it is staged
// read-write, and returns thaw, to be called after the copy: it fails
// (ABORTED, retryable) when a node thawed before the copy ended, and thaws
// everything in any case. Callers hold the volume's locks.
func (f *Freezer) Quiesce(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (thaw func() error, err error) {
	return f.QuiesceAll(ctx, []Member{{Pool: p, ID: vid, Vol: v}})
}

// QuiesceAll is quiesce over several volumes: every one is frozen before it
// returns, so copies made before thaw are of one point in time. On error
// nothing is left frozen or requested.
func (f *Freezer) QuiesceAll(ctx context.Context, members []Member) (thaw func() error, err error) {
	log := klog.FromContext(ctx)
	var local []func() error
	var remote []*remoteFreeze
	release := func() error {
		for _, r := range remote {
			if err := r.pool.Freezes().RemoveRequest(r.node, r.id); err != nil {
				// The node thaws at its maximum hold anyway.
				log.Error(err, "Withdrawing a freeze request failed", "volume", r.id, "node", r.node)
			}
		}
		var errs []error
		for i := len(local) - 1; i >= 0; i-- {
			errs = append(errs, local[i]())
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			_ = release()
		}
	}()
	for _, m := range members {
		if !Freezable(m.Vol) {
			continue // block: no filesystem poolcsi knows of; dir: many writers by design
		}
		// A controller-only process does not see the node plugin's mounts,
		// even on the node it runs on (its pod has no kubelet directory): it
		// asks its own node through the inbox, as it asks any other.
		here := f.deps.NodePlugin
		if here {
			local = append(local, f.freezeIfStagedHere(ctx, m.Pool, m.ID, m.Vol))
		}
		for _, st := range m.Vol.Staged {
			if st.ReadOnly || (here && st.Node == f.deps.NodeID) {
				continue
			}
			r := &remoteFreeze{pool: m.Pool, id: m.ID, node: st.Node, nonce: pool.NewFreezeNonce(), asked: time.Now()}
			if err := m.Pool.Freezes().WriteRequest(pool.FreezeRequest{Volume: m.ID.String(), Node: st.Node, Path: st.Path, Nonce: r.nonce}); err != nil {
				return nil, fmt.Errorf("ask node %s to freeze volume %s: %w", st.Node, m.ID, err)
			}
			remote = append(remote, r)
		}
	}
	if err := f.awaitFreezes(ctx, remote); err != nil {
		return nil, err
	}
	return func() error {
		err := f.checkStillFrozen(remote)
		if lerr := release(); err == nil {
			err = lerr
		}
		f.awaitThaws(ctx, remote)
		return err
	}, nil
}

// pollNodes calls step at once and then every tick (the nodes' poll interval,
// at most 100 ms) until it reports done or fails, for at most the
// acknowledgement timeout; done is false when that passed first. ctx ending
// is an error.
func (f *Freezer) pollNodes(ctx context.Context, step func() (done bool, err error)) (bool, error) {
	var stepErr error
	err := wait.PollUntilContextTimeout(ctx, min(f.Timing.Poll, 100*time.Millisecond), f.Timing.AckTimeout, true, func(context.Context) (bool, error) {
		done, err := step()
		stepErr = err
		return done, err
	})
	switch {
	case stepErr != nil:
		return false, stepErr
	case err == nil:
		return true, nil
	case ctx.Err() != nil:
		return false, ctx.Err()
	}
	return false, nil // the acknowledgement timeout passed
}

// awaitFreezes waits for every node's answer, or for the acknowledgement
// timeout; a node that does not answer in time is passed over only if its
// lease has expired by this controller's clock (it has fenced itself: its
// devices take no I/O).
func (f *Freezer) awaitFreezes(ctx context.Context, remote []*remoteFreeze) error {
	if len(remote) == 0 {
		return nil
	}
	log := klog.FromContext(ctx)
	answered, err := f.pollNodes(ctx, func() (bool, error) {
		pending := 0
		for _, r := range remote {
			if r.answered {
				continue
			}
			a, ok, err := r.pool.Freezes().ReadAck(r.node, r.id)
			if err != nil || !ok || a.Nonce != r.nonce {
				pending++ // not (yet) an answer to this request
				continue
			}
			switch a.State {
			case pool.FreezeFrozen:
				r.answered, r.frozen = true, true
				log.Info("Node froze the filesystem for a snapshot", "volume", r.id, "node", r.node)
			case pool.FreezeNotStaged:
				r.answered = true
				log.Info("Node has nothing of the volume mounted read-write where it is recorded: nothing to freeze there", "volume", r.id, "node", r.node, "reason", a.Reason)
			default:
				return false, csierr.Failf(pool.ErrUnavailable, "node %s could not freeze volume %s for a consistent copy (%s: %s): retry later", r.node, r.id, a.State, a.Reason)
			}
		}
		return pending == 0, nil
	})
	if ctx.Err() != nil {
		return fmt.Errorf("waiting for nodes to freeze volumes for a snapshot: %w", err)
	}
	if err != nil {
		return err
	}
	if answered {
		return nil
	}
	var live []string
	for _, r := range remote {
		if r.answered {
			continue
		}
		verdict, err := f.deps.Verdict(r.pool, r.node, true)
		if err == nil && verdict.Expired {
			log.Info("Node did not answer the freeze request, and its lease has expired: it has fenced itself off the pool, so nothing of it writes to the volume; copying without its freeze", "volume", r.id, "node", r.node, "lease", verdict.Why)
			r.answered = true
			continue
		}
		why := verdict.Why
		if err != nil {
			why = "its lease cannot be read: " + err.Error()
		}
		live = append(live, fmt.Sprintf("node %s for volume %s (%s)", r.node, r.id, why))
	}
	if len(live) > 0 {
		return csierr.Failf(pool.ErrUnavailable, "no acknowledgement of a freeze for a snapshot within %s from %s; a node that still renews its lease may be writing, so no copy is made (is its node plugin running and reading the pool?): retry later",
			f.Timing.AckTimeout, strings.Join(live, "; "))
	}
	return nil
}

// awaitThaws waits, at most the acknowledgement timeout, until every node
// that froze a volume has thawed it and let it go (its answer gone from its
// inbox, its last step), so that a snapshot returns with nothing frozen: the
// pod writes again, and an unstage right after is not refused as busy. A node
// that is slow to notice only delays the return; the copy stands.
func (f *Freezer) awaitThaws(ctx context.Context, remote []*remoteFreeze) {
	var held []*remoteFreeze
	for _, r := range remote {
		if r.frozen {
			held = append(held, r)
		}
	}
	if len(held) == 0 {
		return
	}
	if done, _ := f.pollNodes(ctx, func() (bool, error) {
		pending := held[:0]
		for _, r := range held {
			if a, ok, err := r.pool.Freezes().ReadAck(r.node, r.id); err != nil || (ok && a.Nonce == r.nonce) {
				pending = append(pending, r)
			}
		}
		held = pending
		return len(held) == 0, nil
	}); !done {
		klog.FromContext(ctx).Info("A node has not let go of a frozen volume yet; the snapshot returns all the same (it thaws on its next poll or at its maximum hold)", "volume", held[0].id, "node", held[0].node)
	}
}

// outlasted is how long after its request a controller still trusts a
// freeze of the given bound: 5% less, far more than two clocks' rates differ.
func outlasted(bound time.Duration) time.Duration { return bound - bound/20 }

// checkStillFrozen tells whether every node that froze a volume still said
// "frozen" after the copy: a node writes "thawed" before it thaws early, so
// that answer proves the copy ended before any thaw.
func (f *Freezer) checkStillFrozen(remote []*remoteFreeze) error {
	var thawed []string
	for _, r := range remote {
		if !r.frozen {
			continue
		}
		a, ok, err := r.pool.Freezes().ReadAck(r.node, r.id)
		switch {
		case err != nil:
			thawed = append(thawed, fmt.Sprintf("volume %s on node %s (its answer cannot be read: %v)", r.id, r.node, err))
		case !ok || a.Nonce != r.nonce || a.State != pool.FreezeFrozen:
			why := "its answer is gone"
			if ok {
				why = fmt.Sprintf("%s: %s", a.State, a.Reason)
			}
			thawed = append(thawed, fmt.Sprintf("volume %s on node %s (%s)", r.id, r.node, why))
		case a.HoldMillis > 0 && time.Since(r.asked) >= outlasted(time.Duration(a.HoldMillis)*time.Millisecond):
			// The node's bound thaws without writing anything first (it
			// must not wait on the pool): past it by this controller's
			// own clock, with a margin for the two clocks' rates, the
			// copy may have outlived the freeze.
			thawed = append(thawed, fmt.Sprintf("volume %s on node %s (the copy outlasted the node's bound of %s)", r.id, r.node, time.Duration(a.HoldMillis)*time.Millisecond))
		}
	}
	if len(thawed) > 0 {
		return csierr.Failf(pool.ErrBusy, "a filesystem was thawed before the copy ended, so the copy is not of one point in time: %s; the copy is discarded, retry (a copy that outlasts --freeze-max-hold never succeeds)", strings.Join(thawed, "; "))
	}
	return nil
}

// freezeIfStagedHere is QuiesceAll's part on this node: it freezes the
// filesystem of an image volume staged here, so its image is clean while it is
// copied, and returns the thaw, which fails (ABORTED, retried) if the freeze's
// bound (--freeze-max-hold) thawed it first. Other nodes are asked through
// their freeze inboxes (QuiesceAll). The filesystem is found as the agent
// finds it (ownDevice, FreezeVolumeHere): this node's own mount of the loop
// device it staged the volume on, never the staging path the pool records. A stage it cannot tell is
// the volume's mount is not frozen, never a wrong filesystem. Callers hold
// the volume's in-process lock, so no unstage runs meanwhile.
func (f *Freezer) freezeIfStagedHere(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (thaw func() error) {
	noop := func() error { return nil }
	if !Freezable(v) || !slices.ContainsFunc(v.Staged, func(st pool.StageRecord) bool { return st.Node == f.deps.NodeID }) {
		return noop
	}
	log := klog.FromContext(ctx)
	if !f.Recovered() {
		log.Info("Not freezing: the thaws after this node plugin's restart are not done yet; the snapshot is crash-consistent", "volume", vid)
		return noop
	}
	start := time.Now()
	dev, _, err := f.ownDevice(p, vid)
	if err != nil {
		log.Info("Cannot freeze the filesystem; the snapshot is crash-consistent", "volume", vid, "err", err)
		return noop
	}
	h, why, err := f.FreezeVolumeHere(ctx, vid, dev, f.Timing.MaxHold)
	if err != nil || h == nil {
		// Not known to be the volume's mount: not frozen (the snapshot is
		// then crash-consistent), never a wrong filesystem frozen.
		log.Info("Cannot freeze the filesystem; the snapshot is crash-consistent", "volume", vid, "why", why, "err", err)
		return noop
	}
	log.Info("Froze filesystem for a snapshot", "volume", vid, "path", h.path)
	return func() error {
		expired := h.fs.Expired()
		if err := f.thawHere(ctx, h); err != nil {
			log.Error(err, "Thawing the filesystem after a snapshot failed; its bound thaws it", "volume", vid, "path", h.path)
		} else {
			log.Info("Thawed filesystem", "volume", vid, "path", h.path)
		}
		if expired {
			return csierr.Failf(pool.ErrBusy, "the filesystem of volume %s was thawed at its bound of %s (--freeze-max-hold) before the copy ended (it took %s), so the copy is not of one point in time: retry (raise --freeze-max-hold for copies this long)",
				vid, f.Timing.MaxHold, time.Since(start).Round(time.Millisecond))
		}
		return nil
	}
}
