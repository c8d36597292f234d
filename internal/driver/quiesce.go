package driver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Freezing across nodes (docs/snapshots.md#freezing-across-nodes). The
// controller that copies an image volume freezes its filesystem wherever it
// is staged read-write: on its own node directly (freezeIfStagedHere), on
// another through a request in that node's inbox in the pool, which the
// node's agent (quiesce_node.go) answers. No clock is compared between
// nodes: the node writes "thawed" before it thaws early, so a controller
// that still reads "frozen" after its copy knows the whole copy happened
// while the filesystem was frozen.

// FreezeTiming is the schedule of freezes across nodes.
type FreezeTiming struct {
	// Poll is how often a node's agent reads its inbox.
	Poll time.Duration
	// MaxHold is the longest a node keeps a filesystem frozen for a
	// request, by its own clock: a controller that dies mid-copy never
	// leaves it frozen for longer.
	MaxHold time.Duration
	// AckTimeout is how long a controller waits for a node to confirm a
	// freeze before it looks at the node's lease.
	AckTimeout time.Duration
	// Budget is the most a node keeps one volume frozen for requests
	// within any hour (0: DefaultFreezeBudget, or MaxHold if that is
	// longer). After each hold the volume is not frozen again for as long
	// as that hold lasted. Requests cannot change either: a pool writer
	// that sends new nonces gets no more frozen time.
	Budget time.Duration
}

// DefaultFreezeBudget is the frozen time per volume and hour a node allows
// when FreezeTiming.Budget is zero: five holds of the default maximum.
const DefaultFreezeBudget = 5 * time.Minute

// budget is the budget in force.
func (t FreezeTiming) budget() time.Duration {
	if t.Budget > 0 {
		return t.Budget
	}
	return max(DefaultFreezeBudget, t.MaxHold)
}

// DefaultFreezeTiming is the schedule when none is given.
var DefaultFreezeTiming = FreezeTiming{Poll: 500 * time.Millisecond, MaxHold: 60 * time.Second, AckTimeout: 10 * time.Second}

// Validate refuses a schedule in which a node could not answer in time.
func (t FreezeTiming) Validate() error {
	switch {
	case t.Poll <= 0 || t.MaxHold <= 0 || t.AckTimeout <= 0:
		return errors.New("freeze poll interval, maximum hold and acknowledgement timeout must be positive")
	case t.AckTimeout < 2*t.Poll:
		return fmt.Errorf("freeze acknowledgement timeout %s must be at least two poll intervals (%s)", t.AckTimeout, t.Poll)
	case t.MaxHold < 2*t.Poll:
		return fmt.Errorf("freeze maximum hold %s must be at least two poll intervals (%s)", t.MaxHold, t.Poll)
	case t.Budget < 0 || (t.Budget > 0 && t.Budget < t.MaxHold):
		return fmt.Errorf("freeze budget %s must be at least the maximum hold (%s)", t.Budget, t.MaxHold)
	}
	return nil
}

// freezable tells whether quiesce can freeze v where it is staged: only an
// image volume's own filesystem. A block volume may hold a filesystem poolcsi
// never made and a pod's mount of it poolcsi cannot see; a dir volume is a
// directory of the pool's filesystem, which a freeze would stop for every
// volume in it.
func freezable(v *pool.Volume) bool {
	return v.Layout == pool.LayoutImage && v.AccessType == pool.AccessFilesystem
}

// quiesceMember is one volume to freeze.
type quiesceMember struct {
	pool *pool.Pool
	id   pool.VolumeID
	vol  *pool.Volume
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
func (d *Driver) quiesce(ctx context.Context, p *pool.Pool, vid pool.VolumeID, v *pool.Volume) (thaw func() error, err error) {
	return d.quiesceAll(ctx, []quiesceMember{{pool: p, id: vid, vol: v}})
}

// quiesceAll is quiesce over several volumes: every one is frozen before it
// returns, so copies made before thaw are of one point in time. On error
// nothing is left frozen or requested.
func (d *Driver) quiesceAll(ctx context.Context, members []quiesceMember) (thaw func() error, err error) {
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
		if !freezable(m.vol) {
			continue // block: no filesystem poolcsi knows of; dir: many writers by design
		}
		// A controller-only process does not see the node plugin's mounts,
		// even on the node it runs on (its pod has no kubelet directory): it
		// asks its own node through the inbox, as it asks any other.
		here := d.opts.Mode.node()
		if here {
			local = append(local, d.freezeIfStagedHere(ctx, m.pool, m.id, m.vol))
		}
		for _, st := range m.vol.Staged {
			if st.ReadOnly || (here && st.Node == d.opts.NodeID) {
				continue
			}
			r := &remoteFreeze{pool: m.pool, id: m.id, node: st.Node, nonce: pool.NewFreezeNonce(), asked: time.Now()}
			if err := m.pool.Freezes().WriteRequest(pool.FreezeRequest{Volume: m.id.String(), Node: st.Node, Path: st.Path, Nonce: r.nonce}); err != nil {
				return nil, fmt.Errorf("ask node %s to freeze volume %s: %w", st.Node, m.id, err)
			}
			remote = append(remote, r)
		}
	}
	if err := d.awaitFreezes(ctx, remote); err != nil {
		return nil, err
	}
	return func() error {
		err := d.checkStillFrozen(remote)
		if lerr := release(); err == nil {
			err = lerr
		}
		d.awaitThaws(ctx, remote)
		return err
	}, nil
}

// pollNodes calls step at once and then every tick (the nodes' poll interval,
// at most 100 ms) until it reports done or fails, for at most the
// acknowledgement timeout; done is false when that passed first. ctx ending
// is an error.
func (d *Driver) pollNodes(ctx context.Context, step func() (done bool, err error)) (bool, error) {
	tick := time.NewTicker(min(d.freezeTiming.Poll, 100*time.Millisecond))
	defer tick.Stop()
	timeout := time.NewTimer(d.freezeTiming.AckTimeout)
	defer timeout.Stop()
	for {
		if done, err := step(); done || err != nil {
			return done, err
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-timeout.C:
			return false, nil
		case <-tick.C:
		}
	}
}

// awaitFreezes waits for every node's answer, or for the acknowledgement
// timeout; a node that does not answer in time is passed over only if its
// lease has expired by this controller's clock (it has fenced itself: its
// devices take no I/O).
func (d *Driver) awaitFreezes(ctx context.Context, remote []*remoteFreeze) error {
	if len(remote) == 0 {
		return nil
	}
	log := klog.FromContext(ctx)
	answered, err := d.pollNodes(ctx, func() (bool, error) {
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
		verdict, err := d.leases.Verdict(r.pool, r.node, true)
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
			d.freezeTiming.AckTimeout, strings.Join(live, "; "))
	}
	return nil
}

// awaitThaws waits, at most the acknowledgement timeout, until every node
// that froze a volume has thawed it and let it go (its answer gone from its
// inbox, its last step), so that a snapshot returns with nothing frozen: the
// pod writes again, and an unstage right after is not refused as busy. A node
// that is slow to notice only delays the return; the copy stands.
func (d *Driver) awaitThaws(ctx context.Context, remote []*remoteFreeze) {
	var held []*remoteFreeze
	for _, r := range remote {
		if r.frozen {
			held = append(held, r)
		}
	}
	if len(held) == 0 {
		return
	}
	if done, _ := d.pollNodes(ctx, func() (bool, error) {
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
func (d *Driver) checkStillFrozen(remote []*remoteFreeze) error {
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
