package fence

import (
	"context"
	"sort"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// What the lease cannot cover (docs/fencing.md): a node plugin that is down
// while its node runs renews nothing and fences nothing, and its pods may
// still write. The controller cannot fence that node, but it can make the
// state visible before it matters: it watches every node's lease in every
// shared pool, by its own clock, and reports how long each has not changed and
// how many image volumes the node holds staged read-write there. A lease that
// stopped renewing while volumes are staged is logged, and exported
// (poolcsi_peer_lease_unchanged_seconds, poolcsi_peer_lease_rw_stages).

// stageScanPeriod is how often the watch counts the read-write stages (it
// reads every volume's record); leases are read every renewal interval.
const stageScanPeriod = 30 * time.Second

// PeerLease is one node's lease in one shared pool as this controller sees it.
type PeerLease struct {
	Pool, Node string
	// Unchanged is how long this controller has seen the node's record
	// unchanged (a record it cannot read is left out).
	Unchanged time.Duration
	// Present: the node has a lease entry; Released: it says released;
	// Damaged: what is there is no lease record.
	Present, Released, Damaged bool
	// Stages is how many image volumes of the pool the node holds staged
	// read-write, by the records at the last scan.
	Stages int
}

// peerWatch is the controller's view of the other nodes' leases.
type peerWatch struct {
	observer *lease.Observer

	mu     sync.Mutex
	leases []PeerLease
	warned map[[2]string]bool // logged as silent while holding stages
	stages map[string]map[string]int
	// scanned is when each pool's stages were last counted.
	scanned map[string]time.Time
}

func newPeerWatch(now func() time.Time) *peerWatch {
	return &peerWatch{observer: lease.NewObserverClock(now), warned: map[[2]string]bool{}, stages: map[string]map[string]int{}, scanned: map[string]time.Time{}}
}

// WatchPeers reads every node's lease in every shared pool once, and logs the
// nodes whose lease has stopped changing while they hold read-write stages.
func (k *Keeper) WatchPeers(ctx context.Context) {
	log := klog.FromContext(ctx)
	ls, w := k, k.peers
	silentAfter := ls.timing.Duration / 2
	var all []PeerLease
	for _, p := range k.SharedPools() {
		stages := k.peerStages(ctx, p)
		nodes, err := p.Leases().Nodes()
		if err != nil {
			log.V(2).Info("Listing the leases of a shared pool", "pool", p.Name(), "err", err)
			continue
		}
		seen := map[string]bool{}
		// A node holding stages without any lease entry is watched too.
		for n := range stages {
			nodes = append(nodes, n)
		}
		sort.Strings(nodes)
		for _, n := range nodes {
			if seen[n] {
				continue
			}
			seen[n] = true
			rec, ok, err := p.Leases().Read(n)
			if err != nil {
				log.V(2).Info("Reading a node's lease", "pool", p.Name(), "node", n, "err", err)
				continue
			}
			pl := PeerLease{Pool: p.Name(), Node: n, Unchanged: w.observer.Unchanged(p.Name(), n, rec, ok),
				Present: ok, Released: rec.Released, Damaged: rec.Damaged != "", Stages: stages[n]}
			all = append(all, pl)
			k := [2]string{p.Name(), n}
			w.mu.Lock()
			warned := w.warned[k]
			silent := pl.Stages > 0 && pl.Unchanged >= silentAfter
			w.warned[k] = silent
			w.mu.Unlock()
			switch {
			case silent && !warned:
				log.Error(nil, "A node's lease has stopped changing while it holds image volumes staged read-write: its node plugin is down or cut off from the pool. If the node still runs with its plugin down, nothing fences its pods' writes: restart the plugin, or make sure the node is down before any force-detach (docs/fencing.md)",
					"pool", p.Name(), "node", n, "unchanged", pl.Unchanged.Round(time.Second), "stages", pl.Stages, "present", ok, "released", rec.Released, "damaged", rec.Damaged)
			case !silent && warned:
				log.Info("A node's lease changes again, or it holds no read-write stage any more", "pool", p.Name(), "node", n, "stages", pl.Stages)
			}
		}
	}
	w.mu.Lock()
	w.leases = all
	w.mu.Unlock()
}

// peerStages counts, per node, the image volumes of p staged read-write,
// rescanning the pool at most every stageScanPeriod.
func (k *Keeper) peerStages(ctx context.Context, p *pool.Pool) map[string]int {
	w := k.peers
	now := k.now()
	w.mu.Lock()
	counts, at := w.stages[p.Name()], w.scanned[p.Name()]
	w.mu.Unlock()
	if counts != nil && now.Sub(at) < stageScanPeriod {
		return counts
	}
	entries, err := p.List()
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Listing a shared pool's volumes for the lease watch", "pool", p.Name(), "err", err)
		return counts
	}
	counts = map[string]int{}
	for _, e := range entries {
		if e.Err != nil || e.Volume.Layout != pool.LayoutImage {
			continue
		}
		for _, n := range layout.Writers(e.Volume, "") {
			counts[n]++
		}
	}
	w.mu.Lock()
	w.stages[p.Name()], w.scanned[p.Name()] = counts, now
	w.mu.Unlock()
	return counts
}

// PeerLeases is what the last watch saw of every node's lease, for metrics.
func (k *Keeper) PeerLeases() []PeerLease {
	if k == nil || k.peers == nil {
		return nil
	}
	w := k.peers
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]PeerLease(nil), w.leases...)
}
