package pool

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"
)

// PublishRecord says that the controller published the volume to Node. For an
// image volume a record with ReadOnly false is the attach fence: no other node may
// hold the volume while it exists.
type PublishRecord struct {
	Node     string    `json:"node"`
	ReadOnly bool      `json:"readOnly"`
	At       time.Time `json:"at"`
}

// DirQuota records how a dir volume's size is enforced, so operators and the
// driver see the same answer the creating driver saw.
type DirQuota struct {
	// Kind is the mechanism: btrfs-qgroup, xfs-project, ext4-project or none.
	Kind string `json:"kind"`
	// Enforced is false when the pool's filesystem cannot limit the volume: its
	// capacity is then a promise, not a limit.
	Enforced bool `json:"enforced"`
	// ID is the btrfs subvolume (qgroup 0/ID) or the project ID.
	ID uint64 `json:"id,omitempty"`
	// Reason says why the size is not enforced.
	Reason string `json:"reason,omitempty"`
}

const (
	dataDir  = "data"
	nodesDir = "nodes"
)

// DataPath is the directory a dir-layout volume's data lives in (a plain directory
// or a btrfs subvolume). It is one level below the volume's own directory so that
// volume.json and the lock file are never visible to pods.
func (p *Pool) DataPath(id VolumeID) string { return filepath.Join(p.Dir(id), dataDir) }

// PublishedTo returns node's publish record, if any.
func (v *Volume) PublishedTo(node string) (PublishRecord, bool) {
	for _, r := range v.Published {
		if r.Node == node {
			return r, true
		}
	}
	return PublishRecord{}, false
}

// SetPublished records node, replacing an older record of the node.
func (v *Volume) SetPublished(node string, readOnly bool, now time.Time) {
	v.ClearPublished(node)
	v.Published = append(v.Published, PublishRecord{Node: node, ReadOnly: readOnly, At: now.UTC()})
}

// ClearPublished forgets node's publish record; an empty node forgets them all.
func (v *Volume) ClearPublished(node string) {
	kept := v.Published[:0]
	for _, r := range v.Published {
		if node != "" && r.Node != node {
			kept = append(kept, r)
		}
	}
	v.Published = kept
	if len(v.Published) == 0 {
		v.Published = nil
	}
}

// PublishedNodes lists the nodes the volume is published to, sorted.
func (v *Volume) PublishedNodes() []string {
	var out []string
	for _, r := range v.Published {
		out = append(out, r.Node)
	}
	sort.Strings(out)
	return out
}

// MaxNodeIDLength bounds node IDs: a Kubernetes node name is a DNS subdomain.
const MaxNodeIDLength = 253

var nodeIDRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$`)

// ValidateNodeID accepts Kubernetes node names (and similar): letters, digits,
// '.', '_' and '-', at most 253 bytes, no "..". A node ID becomes a file name in
// the pool's node registry, so anything else is refused before a path is built.
func ValidateNodeID(node string) error {
	if len(node) > MaxNodeIDLength || !nodeIDRE.MatchString(node) || strings.Contains(node, "..") {
		return fmt.Errorf("%w: node ID %q must be 1-%d letters, digits, '.', '_' or '-' (a Kubernetes node name)", ErrInvalidID, node, MaxNodeIDLength)
	}
	return nil
}

// Publications is the pool's view for where its volumes are published: the
// registry of the nodes that serve the pool (nodes/<node>.json), the per-node
// publish index and attach-count locks (attach.go), and the operator's
// Unfence. A narrow store over the one Pool, as Freezes is; the publish
// records themselves stay in volume.json (Volume.SetPublished, Pool.Update).
type Publications struct{ p *Pool }

// Publications is the pool's node registry and publish index.
func (p *Pool) Publications() Publications { return Publications{p} }

// NodeRecord is <pool>/nodes/<node>.json: the node plugin of node serves this pool.
type NodeRecord struct {
	Node     string            `json:"node"`
	Topology map[string]string `json:"topology,omitempty"`
	// MaxVolumes is the node's --max-volumes-per-node (0: no limit), so every
	// controller sharing the pool can hold ControllerPublishVolume to it.
	MaxVolumes   int64     `json:"maxVolumes,omitempty"`
	RegisteredAt time.Time `json:"registeredAt"`
}

func (pb Publications) nodeRel(node string) string { return filepath.Join(nodesDir, node+".json") }

func (pb Publications) nodePath(node string) string {
	return filepath.Join(pb.p.cfg.Path, pb.nodeRel(node))
}

// RegisterNode records that node's node plugin serves this pool. Nodes are known
// nowhere else (poolcsi talks to no API server), and a controller must be able to
// tell a node that can reach the pool from a typo: the registry in the pool itself
// answers that for every controller replica that shares it.
func (pb Publications) RegisterNode(node string, topology map[string]string, maxVolumes int64) error {
	if err := ValidateNodeID(node); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(pb.p.cfg.Path, nodesDir), 0o750); err != nil {
		return fmt.Errorf("pool %s: register node %s: %w", pb.p.cfg.Name, node, err)
	}
	raw, _ := json.MarshalIndent(NodeRecord{Node: node, Topology: topology, MaxVolumes: maxVolumes, RegisteredAt: time.Now().UTC()}, "", "  ")
	return pb.p.files().writeBeneath(pb.nodeRel(node), append(raw, '\n'), true)
}

// Node reads node's registration; ok is false when it never registered.
func (pb Publications) Node(node string) (rec NodeRecord, ok bool, err error) {
	if err := ValidateNodeID(node); err != nil {
		return rec, false, err
	}
	raw, err := pb.p.files().readBeneath(pb.nodeRel(node), maxNodeRecord)
	switch {
	case missing(err):
		return rec, false, nil
	case err != nil:
		return rec, false, fmt.Errorf("pool %s: read node %s: %w", pb.p.cfg.Name, node, err)
	}
	if err := json.Unmarshal(raw, &rec); err != nil {
		return rec, false, fmt.Errorf("pool %s: node record %s is damaged: %w", pb.p.cfg.Name, node, err)
	}
	return rec, true, nil
}

// NodeRegistered tells whether node has registered with the pool.
func (pb Publications) NodeRegistered(node string) (bool, error) {
	if err := ValidateNodeID(node); err != nil {
		return false, err
	}
	_, err := os.Lstat(pb.nodePath(node))
	switch {
	case err == nil:
		return true, nil
	case missing(err):
		return false, nil
	default:
		return false, fmt.Errorf("pool %s: look up node %s: %w", pb.p.cfg.Name, node, err)
	}
}

// Unfence forgets node's publish record of volume id (every node's when node is
// empty) under the volume's lock, and returns the nodes it forgot. It is the
// operator's way out when a node died holding an image volume read-write and
// Kubernetes cannot unpublish it (see docs/fencing.md).
func (pb Publications) Unfence(ctx context.Context, id VolumeID, node string) ([]string, error) {
	if node != "" {
		if err := ValidateNodeID(node); err != nil {
			return nil, err
		}
	}
	var gone, unpublished []string
	err := pb.p.Update(ctx, id, func(v *Volume) (bool, error) {
		for _, r := range v.Published {
			if node == "" || r.Node == node {
				gone = append(gone, r.Node)
				unpublished = append(unpublished, r.Node)
			}
		}
		v.ClearPublished(node)
		// A dead node's stage record fences the volume too.
		kept := v.Staged[:0]
		for _, s := range v.Staged {
			if node == "" || s.Node == node {
				gone = append(gone, s.Node+" (staged)")
				continue
			}
			kept = append(kept, s)
		}
		v.Staged = kept
		if len(v.Staged) == 0 {
			v.Staged = nil
		}
		return len(gone) > 0, nil
	})
	if err != nil {
		return gone, err
	}
	// After the records, as ControllerUnpublishVolume does (attach.go).
	for _, n := range unpublished {
		if err := pb.Unmark(n, id); err != nil {
			return gone, err
		}
	}
	return gone, nil
}
