package driver

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// The node's side of freezing across nodes (quiesce.go): an agent reads this
// node's inbox in every pool, freezes what a request names once it has
// checked it against the stage records and the mount table (the pool is
// hostile: a request can name anything), answers, and thaws when the request
// goes or its maximum hold has passed.

// freezer is the agent's state.
type freezer struct {
	mu   sync.Mutex
	held map[string]*heldFreeze // by volume ID
	// warned holds the inbox entries already reported as unusable, so a
	// planted file is logged once, not every poll.
	warned map[string]bool
	// now is the agent's clock; tests replace it. Only differences of its
	// readings matter.
	now func() time.Time
}

// heldFreeze is a filesystem this node froze for a request.
type heldFreeze struct {
	pool    *pool.Pool
	id      pool.VolumeID
	nonce   string
	path    string
	since   time.Time
	thaw    func() error
	release func() // the volume's in-process lock, held while frozen
}

func newFreezer() *freezer {
	return &freezer{held: map[string]*heldFreeze{}, warned: map[string]bool{}, now: time.Now}
}

// runFreezeAgent answers freeze requests every poll interval until ctx ends,
// then thaws whatever it still holds.
func (d *Driver) runFreezeAgent(ctx context.Context) {
	tick := time.NewTicker(d.freezeTiming.Poll)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			d.thawAllHeld(klog.NewContext(context.Background(), klog.FromContext(ctx)), "the node plugin stopped")
			return
		case <-tick.C:
			d.freezeTick(ctx)
		}
	}
}

// freezeTick reads every shared pool's inbox once: thaws what was withdrawn
// or held too long, then answers new requests. A local pool has no other
// node to ask: its controller runs in this process and freezes in place, so
// its inbox is never read (two directory reads a second saved per pool).
func (d *Driver) freezeTick(ctx context.Context) {
	log := klog.FromContext(ctx)
	node := d.opts.NodeID
	for _, pn := range d.names() {
		p := d.pool(pn)
		if p == nil || !p.Shared() {
			continue
		}
		entries, acked, listErr := p.Inbox(node)
		if listErr != nil {
			log.V(2).Info("Cannot read this node's freeze inbox", "pool", pn, "err", listErr)
		}
		requests := map[string]pool.FreezeRequest{}
		seen := map[string]bool{}
		for _, e := range entries {
			if e.Err != nil {
				seen[pn+"/"+e.Name] = true
				if !d.freezer.warnOnce(pn + "/" + e.Name) {
					log.Error(e.Err, "Ignoring an unusable entry of this node's freeze inbox", "pool", pn, "entry", e.Name)
				}
				continue
			}
			requests[e.Volume.String()] = e.Request
		}
		d.freezer.forgetWarnings(pn, seen)
		now := d.freezer.now()
		for _, h := range d.freezer.heldIn(p) {
			r, ok := requests[h.id.String()]
			switch {
			case listErr == nil && (!ok || r.Nonce != h.nonce):
				d.thawHeld(ctx, h, "")
			case now.Sub(h.since) >= d.freezeTiming.MaxHold:
				d.thawHeld(ctx, h, fmt.Sprintf("held for the maximum of %s (--freeze-max-hold) by node %s's clock, and the request is still there", d.freezeTiming.MaxHold, node))
			}
		}
		if listErr != nil {
			continue
		}
		for _, id := range acked {
			if _, ok := requests[id.String()]; !ok && !d.freezer.holds(id) {
				if err := p.RemoveFreezeAck(node, id); err != nil {
					log.Error(err, "Removing an answer to a withdrawn freeze request", "volume", id)
				}
			}
		}
		for _, r := range requests {
			if !d.freezer.holds(mustVolumeID(r.Volume)) {
				d.answerFreeze(ctx, p, r)
			}
		}
	}
}

func mustVolumeID(s string) pool.VolumeID {
	id, _ := pool.ParseVolumeID(s) // the pool parsed it already
	return id
}

func (f *freezer) warnOnce(key string) (warned bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	warned = f.warned[key]
	f.warned[key] = true
	return warned
}

// forgetWarnings drops the warnings of pool pn's entries that are gone.
func (f *freezer) forgetWarnings(pn string, present map[string]bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for k := range f.warned {
		if len(k) > len(pn) && k[:len(pn)+1] == pn+"/" && !present[k] {
			delete(f.warned, k)
		}
	}
}

func (f *freezer) holds(id pool.VolumeID) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.held[id.String()]
	return ok
}

func (f *freezer) heldIn(p *pool.Pool) []*heldFreeze {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*heldFreeze
	for _, h := range f.held {
		if h.pool == p {
			out = append(out, h)
		}
	}
	return out
}

// answerFreeze acts on a request not answered yet: it freezes the volume if
// the request names a read-write stage of this node at the recorded path that
// the mount table shows is the volume's, and writes the answer.
func (d *Driver) answerFreeze(ctx context.Context, p *pool.Pool, r pool.FreezeRequest) {
	node := d.opts.NodeID
	id := mustVolumeID(r.Volume)
	log := klog.FromContext(ctx).WithValues("volume", id, "path", r.Path)
	if prev, ok, err := p.ReadFreezeAck(node, id); err == nil && ok && prev.Nonce == r.Nonce {
		return // answered; a request thawed early is not frozen again
	}
	// Held while frozen: an unstage (its unmount) meanwhile is ABORTED and
	// retried after the thaw, never an unmount of a frozen filesystem.
	release, err := d.locks.acquire(id.String(), "a freeze for a snapshot")
	if err != nil {
		log.V(2).Info("Volume busy; answering the freeze request at the next poll", "err", err)
		return
	}
	ack := pool.FreezeAck{Volume: id.String(), Node: node, Nonce: r.Nonce}
	h, state, reason := d.freezeForRequest(ctx, p, id, r)
	ack.State, ack.Reason = state, reason
	if err := p.WriteFreezeAck(ack); err != nil {
		log.Error(err, "Cannot answer a freeze request; not keeping the filesystem frozen")
		if h != nil {
			d.thawNow(ctx, h)
		}
		release()
		return
	}
	if h == nil {
		release()
		log.Info("Answered a freeze request without freezing", "state", state, "reason", reason)
		return
	}
	h.release = release
	d.freezer.mu.Lock()
	d.freezer.held[id.String()] = h
	d.freezer.mu.Unlock()
	log.Info("Froze filesystem for another node's snapshot", "maxHold", d.freezeTiming.MaxHold)
}

// freezeForRequest checks a request against this node's stage record and
// mount table and freezes: a hold, or no hold and the answer that says why.
func (d *Driver) freezeForRequest(ctx context.Context, p *pool.Pool, id pool.VolumeID, r pool.FreezeRequest) (*heldFreeze, pool.FreezeState, string) {
	v, err := p.Load(id)
	switch {
	case errors.Is(err, pool.ErrNotFound):
		return nil, pool.FreezeNotStaged, "the volume does not exist"
	case err != nil:
		return nil, pool.FreezeFailed, fmt.Sprintf("read the volume: %v", err)
	case v.Layout != pool.LayoutImage || v.AccessType != pool.AccessFilesystem:
		return nil, pool.FreezeNotStaged, "not an image volume with a filesystem"
	}
	staged := false
	for _, st := range v.Staged {
		staged = staged || (st.Node == d.opts.NodeID && st.Path == r.Path && !st.ReadOnly)
	}
	if !staged {
		return nil, pool.FreezeNotStaged, "no read-write stage of this node at that path"
	}
	info, mounted, err := d.mounts.Info(r.Path)
	if err != nil {
		return nil, pool.FreezeFailed, fmt.Sprintf("read the mount table: %v", err)
	}
	if !mounted {
		return nil, pool.FreezeNotStaged, "nothing is mounted at the staging path"
	}
	if ours, err := d.isVolumeMount(info, p.ImagePath(id)); err != nil {
		return nil, pool.FreezeFailed, fmt.Sprintf("find the volume's loop device: %v", err)
	} else if !ours {
		return nil, pool.FreezeNotStaged, "the staging path shows another filesystem"
	}
	// Recorded first: a crash of this process while frozen is thawed at the
	// next start (thawAfterCrash).
	if err := p.RecordFreeze(id, d.opts.NodeID, r.Path); err != nil {
		return nil, pool.FreezeFailed, fmt.Sprintf("record the freeze: %v", err)
	}
	thaw, err := d.fs.Freeze(r.Path)
	if err != nil {
		d.clearFreeze(ctx, p, id)
		return nil, pool.FreezeFailed, fmt.Sprintf("freeze: %v", err)
	}
	return &heldFreeze{pool: p, id: id, nonce: r.Nonce, path: r.Path, since: d.freezer.now(), thaw: thaw}, pool.FreezeFrozen, ""
}

// thawHeld thaws a hold. early, when not empty, says why it ends while the
// request is still there (the controller then learns its copy may not be of
// one point in time); empty, the request was withdrawn. Either way the answer
// says "thawed" before the thaw, so "frozen" is only ever read while it is;
// a withdrawn request's answer then goes.
func (d *Driver) thawHeld(ctx context.Context, h *heldFreeze, early string) {
	log := klog.FromContext(ctx).WithValues("volume", h.id, "path", h.path)
	node := d.opts.NodeID
	why := early
	if why == "" {
		why = "the request was withdrawn"
	}
	if err := h.pool.WriteFreezeAck(pool.FreezeAck{Volume: h.id.String(), Node: node, Nonce: h.nonce, State: pool.FreezeThawed, Reason: why}); err != nil {
		// Thawed all the same: a frozen filesystem hangs every writer.
		log.Error(err, "Cannot write down the thaw; thawing all the same")
	}
	if early != "" {
		log.Info("Thawing a filesystem before the snapshot's controller withdrew its request", "why", early)
	}
	d.thawNow(ctx, h)
	d.freezer.mu.Lock()
	delete(d.freezer.held, h.id.String())
	d.freezer.mu.Unlock()
	if h.release != nil {
		h.release()
	}
	// Last: an inbox without the answer means the volume is free again.
	if early == "" {
		if err := h.pool.RemoveFreezeAck(node, h.id); err != nil {
			log.Error(err, "Removing the answer to a withdrawn freeze request")
		}
		log.Info("Thawed filesystem after another node's snapshot")
	}
}

// thawNow thaws and drops the freeze record.
func (d *Driver) thawNow(ctx context.Context, h *heldFreeze) {
	if err := h.thaw(); err != nil {
		klog.FromContext(ctx).Error(err, "Thawing the filesystem failed", "volume", h.id, "path", h.path)
		return
	}
	d.clearFreeze(ctx, h.pool, h.id)
}

// thawAllHeld thaws every hold, as early thaws.
func (d *Driver) thawAllHeld(ctx context.Context, why string) {
	d.freezer.mu.Lock()
	var all []*heldFreeze
	for _, h := range d.freezer.held {
		all = append(all, h)
	}
	d.freezer.mu.Unlock()
	for _, h := range all {
		d.thawHeld(ctx, h, why)
	}
}

// abandonFreezeAnswers rewrites as "thawed" every "frozen" answer of this node
// in p, before a start thaws what a crashed process left frozen: the
// controller must not take a thaw it was not told of for a freeze.
func (d *Driver) abandonFreezeAnswers(ctx context.Context, p *pool.Pool) {
	node := d.opts.NodeID
	_, acked, err := p.Inbox(node)
	if err != nil {
		return
	}
	for _, id := range acked {
		a, ok, err := p.ReadFreezeAck(node, id)
		if err != nil || !ok || a.State != pool.FreezeFrozen {
			continue
		}
		a.State, a.Reason = pool.FreezeThawed, "the node plugin of node "+node+" restarted while the filesystem was frozen"
		if err := p.WriteFreezeAck(a); err != nil {
			klog.FromContext(ctx).Error(err, "Cannot write down the thaw of a freeze a crash interrupted", "volume", id)
		}
	}
}
