package driver

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolset"
)

// registerNode records this node in every present pool's node registry, once per
// pool and process. A node plugin that registered with a pool is how a controller
// (possibly on another machine, sharing the pool) tells a real node ID from a
// wrong one in ControllerPublishVolume.
func (d *core) registerNode(ctx context.Context) {
	if !d.opts.Mode.node() {
		return
	}
	for _, pn := range d.pools.Names() {
		if p := d.pools.Pool(pn); p != nil {
			d.registerPool(ctx, p)
		}
	}
}

// registerPool is registerNode for one pool (a start-up pass, start.go).
func (d *core) registerPool(ctx context.Context, p *pool.Pool) {
	if _, done := d.registered.Load(p.Name()); done {
		return
	}
	if p.Check() != nil {
		return // not mounted yet: Probe tries again
	}
	if p.Shared() && d.leases.VerifyWriters(p) != nil {
		// The path does not show the images this node's loop devices
		// hold (another pool of the name over it, seen first by this
		// process after a restart): nothing is written there. The
		// renewals fail alike, and the node fences.
		return
	}
	if err := p.Publications().RegisterNode(d.opts.NodeID, d.pools.Topology(), d.opts.MaxVolumesPerNode); err != nil {
		klog.FromContext(ctx).Error(err, "Registering this node with the pool failed", "pool", p.Name())
		return
	}
	d.registered.Store(p.Name(), true)
	klog.FromContext(ctx).V(2).Info("Registered node with pool", "pool", p.Name(), "node", d.opts.NodeID)
}

// checkNode validates a node ID for a volume: syntactically, then that the node
// has registered with the volume's pool and, for a local pool, that it is the node
// holding the volume.
func checkNode(p *pool.Pool, v *pool.Volume, node string) error {
	if err := pool.ValidateNodeID(node); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if owner, ok := v.Topology[TopologyKey]; ok && owner != node {
		return csierr.Failf(csierr.ErrNoNode, "node %s cannot reach volume %s: it lives in pool %s, local to node %s", node, v.ID, p.Name(), owner)
	}
	if p.Config().Share != nil {
		// A node registers with a share's pool when it first mounts the share,
		// which is at its first NodeStageVolume, after this call: the registry
		// cannot know it yet.
		return nil
	}
	known, err := p.Publications().NodeRegistered(node)
	if err != nil {
		return err
	}
	if !known {
		return csierr.Failf(csierr.ErrNoNode, "node %s is unknown to pool %s: no poolcsi node plugin with that --node-id has registered there (is the node plugin running on it and does it see the pool?)", node, p.Name())
	}
	return nil
}

func (d controllerServer) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (_ *csi.ControllerPublishVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	node, vc := req.GetNodeId(), req.GetVolumeCapability()
	var caps params.Caps
	acc := poolset.Access{Secrets: req.GetSecrets(), VolumeContext: req.GetVolumeContext(), MountFlags: vc.GetMount().GetMountFlags()}
	rq, err := d.resolve(ctx, rpcControllerPublishVolume, req.GetVolumeId(), acc, func() (err error) {
		if node == "" {
			return status.Error(codes.InvalidArgument, "node_id is required")
		}
		if vc == nil {
			return status.Error(codes.InvalidArgument, "volume_capability is required")
		}
		caps, err = params.ParseCaps([]*csi.VolumeCapability{vc}, "")
		return err
	})
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p := rq.id, rq.pool
	// Update holds the pool's volume lock, a lock file: controllers of other
	// nodes sharing the pool wait on the same one, so two of them cannot both
	// grant a writer.
	readOnly := req.GetReadonly() || params.ReadOnlyMode(vc.GetAccessMode().GetMode())
	var v *pool.Volume
	err = updateVolume(ctx, p, vid, func(cur *pool.Volume) (bool, error) {
		v = cur
		if v.State != pool.StateReady {
			return false, csierr.Failf(pool.ErrNotReady, "volume %s is still being created", vid)
		}
		if err := layout.NotEphemeral(v, "be published by a controller"); err != nil {
			return false, err
		}
		if err := checkNode(p, v, node); err != nil {
			return false, err
		}
		if err := d.Compatible(caps, v); err != nil {
			return false, status.Error(codes.InvalidArgument, err.Error())
		}
		if r, ok := v.PublishedTo(node); ok {
			if r.ReadOnly != readOnly {
				return false, csierr.Failf(pool.ErrExists, "volume %s is already published to node %s with read-only=%t, the request asks read-only=%t", vid, node, r.ReadOnly, readOnly)
			}
			return false, nil
		}
		if err := d.layoutOf(v.Layout).Fence(v, node, readOnly); err != nil {
			return false, err
		}
		if err := d.reserveAttachSlot(ctx, p, vid, node); err != nil {
			return false, err
		}
		v.SetPublished(node, readOnly, time.Now())
		return true, nil
	})
	if err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Published volume to node", "volume", vid, "node", node, "readOnly", readOnly, "layout", v.Layout)
	return &csi.ControllerPublishVolumeResponse{PublishContext: publishContext(v)}, nil
}

func publishContext(v *pool.Volume) map[string]string {
	return map[string]string{ParamLayout: string(v.Layout)}
}

// ControllerUnpublishVolume forgets node's publish record (every node's when no
// node is named, as the spec asks). A volume or record that is already gone is
// success: the volume is then certainly not published there.
func (d controllerServer) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (_ *csi.ControllerUnpublishVolumeResponse, err error) {
	defer csierr.ToStatus(&err)
	node := req.GetNodeId()
	rq, err := d.resolve(ctx, rpcControllerUnpublishVolume, req.GetVolumeId(), poolset.Access{Secrets: req.GetSecrets()}, func() error {
		if node != "" {
			if err := pool.ValidateNodeID(node); err != nil {
				return status.Error(codes.InvalidArgument, err.Error())
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	defer rq.release()
	vid, p := rq.id, rq.pool
	if p == nil {
		return &csi.ControllerUnpublishVolumeResponse{}, nil // no such pool or volume: certainly not published
	}
	var cleared, forced []string
	err = updateVolume(ctx, p, vid, func(v *pool.Volume) (bool, error) {
		// A node that still has an image staged read-write never unstaged
		// it: the CO is force-detaching (a node out of service). Its records
		// go only once its lease has expired, by this controller's clock.
		if p.Shared() && v.Layout == pool.LayoutImage {
			if forced = layout.Writers(v, node); len(forced) > 0 {
				if err := d.forceDetachable(p, v, forced); err != nil {
					return false, err
				}
				for _, n := range forced {
					v.ClearStaged(n)
				}
			}
		}
		before := v.PublishedNodes()
		v.ClearPublished(node)
		if len(v.Published) == len(before) {
			return len(forced) > 0, nil
		}
		for _, n := range before {
			if _, still := v.PublishedTo(n); !still {
				cleared = append(cleared, n)
			}
		}
		return true, nil
	})
	if err != nil && !csierr.Gone(err) {
		return nil, err
	}
	if csierr.Gone(err) && node != "" {
		cleared = append(cleared, node) // a marker the volume's deletion left, if any
	}
	// The index entries go after the records they stand for (attach.go).
	for _, n := range cleared {
		if err := p.Publications().Unmark(n, vid); err != nil {
			klog.FromContext(ctx).Error(err, "Removing a publish index entry; the next count at the node's limit removes it", "volume", vid, "node", n)
		}
	}
	if len(cleared) > 0 && err == nil {
		klog.FromContext(ctx).Info("Unpublished volume from node", "volume", vid, "nodes", strings.Join(cleared, ","))
	}
	if len(forced) > 0 && err == nil {
		klog.FromContext(ctx).Info("Force-detached volume: the nodes that still had it staged read-write let their lease expire, so they have fenced themselves off", "volume", vid, "nodes", strings.Join(forced, ","))
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// publishedError refuses to delete a volume that is published somewhere.
func publishedError(v *pool.Volume) error {
	if len(v.Published) == 0 {
		return nil
	}
	return csierr.Failf(csierr.ErrInUse, "volume %s is still published to node(s) %s; unpublish it before deleting", v.ID, strings.Join(v.PublishedNodes(), ", "))
}

// reserveAttachSlot enters volume vid in node's publish index of its pool
// before ControllerPublishVolume saves the publish record, and refuses when
// node already holds its --max-volumes-per-node. The scheduler enforces the
// same limit from CSINode; this catches whatever reaches the controller
// regardless. The count reads the node's index in every pool (internal/pool
// attach.go), which costs what the node holds, not what the pools hold, and
// it and the new entry are made under the node's lock file in every pool
// (taken in pool-name order), so two calls, or two controllers sharing the
// pools, publishing different volumes to one node cannot both take its last
// slot. The caller holds vid's volume lock file until the record is saved,
// which is what keeps the entry from being taken for a stale one meanwhile.
func (d controllerServer) reserveAttachSlot(ctx context.Context, p *pool.Pool, vid pool.VolumeID, node string) error {
	rec, ok, err := p.Publications().Node(node)
	if err != nil {
		return err
	}
	if !ok || rec.MaxVolumes <= 0 {
		// No limit to hold: the entry only keeps the index whole, for a limit
		// set later.
		return p.Publications().Mark(node, vid)
	}
	// One set of pools for the locks and the count: a share's pool joining
	// meanwhile is not counted unlocked.
	names := d.pools.Names()
	for _, pn := range names {
		q := d.pools.Pool(pn)
		if err := q.Check(); err != nil {
			return fmt.Errorf("count volumes published to node %s: %w", node, err)
		}
		if err := q.Publications().EnsureIndex(); err != nil {
			return fmt.Errorf("count volumes published to node %s: %w", node, err)
		}
		unlock, err := q.Publications().LockNode(ctx, node)
		if err != nil {
			return fmt.Errorf("count volumes published to node %s: %w", node, err)
		}
		defer unlock()
	}
	count := func(verify bool) (int64, error) {
		var held int64
		for _, pn := range names {
			n, err := d.pools.Pool(pn).Publications().Count(node, vid, verify)
			if err != nil {
				return 0, fmt.Errorf("count volumes published to node %s: %w", node, err)
			}
			held += n
		}
		return held, nil
	}
	held, err := count(false)
	if err == nil && held >= rec.MaxVolumes {
		// About to refuse: make sure no entry is one a crash or a failed
		// publish left behind.
		held, err = count(true)
	}
	if err != nil {
		return err
	}
	if held >= rec.MaxVolumes {
		return csierr.Failf(csierr.ErrNodeFull, "node %s already has %d volumes published, its limit (--max-volumes-per-node); unpublish one first", node, held)
	}
	return p.Publications().Mark(node, vid)
}
