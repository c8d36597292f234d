package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// SchemaVersion is the version of volume.json this code writes. Readers refuse a
// newer version rather than misread it and act on a guess.
const SchemaVersion = 1

// Layout is how a volume's data is kept in the pool.
type Layout string

const (
	// LayoutImage is a sparse image file attached through a loop device.
	LayoutImage Layout = "image"
	// LayoutDir is a subdirectory bind-mounted into pods.
	LayoutDir Layout = "dir"
)

// AccessType is what the volume was created for: a filesystem or a raw block device.
type AccessType string

const (
	AccessFilesystem AccessType = "filesystem"
	AccessBlock      AccessType = "block"
)

// State tracks a volume through creation, so a crash half way is finished or undone
// by the next attempt instead of leaving a half-made volume that looks ready.
type State string

const (
	StateCreating State = "creating"
	StateReady    State = "ready"
)

// Volume is the content of volume.json: everything the driver knows of a volume.
type Volume struct {
	SchemaVersion int               `json:"schemaVersion"`
	ID            string            `json:"id"`
	Name          string            `json:"name"`
	Pool          string            `json:"pool"`
	Layout        Layout            `json:"layout"`
	AccessType    AccessType        `json:"accessType"`
	FSType        string            `json:"fsType,omitempty"`
	CapacityBytes int64             `json:"capacityBytes"`
	State         State             `json:"state"`
	Parameters    map[string]string `json:"parameters,omitempty"`
	Topology      map[string]string `json:"topology,omitempty"`
	CreatedAt     time.Time         `json:"createdAt"`
	// Staged lists the nodes whose staging path holds the volume, so the controller
	// can refuse to delete data a node still has mounted.
	Staged []StageRecord `json:"staged,omitempty"`
	// Published lists the nodes the controller published the volume to
	// (ControllerPublishVolume); for image volumes it is the attach fence.
	Published []PublishRecord `json:"published,omitempty"`
	// Quota says how a dir volume's size is enforced; nil for image volumes,
	// whose size is exact by construction.
	Quota *DirQuota `json:"quota,omitempty"`
	// Source is the snapshot or volume the volume was made from (CSI
	// volume_content_source); nil for an empty volume.
	Source *ContentSource `json:"source,omitempty"`
	// IOLimits and Preallocate are the volume's mutable parameters
	// (CreateVolume's mutable_parameters, ControllerModifyVolume): the block
	// throttling the node holds its pods to, and whether its image is kept
	// fully allocated. Image volumes only.
	IOLimits    IOLimits `json:"ioLimits,omitzero"`
	Preallocate bool     `json:"preallocate,omitempty"`
	// Ephemeral marks a CSI ephemeral inline volume; nil for every other.
	Ephemeral *EphemeralRecord `json:"ephemeral,omitempty"`
}

// ContentSource names what a volume's first content was copied from: exactly one
// of a snapshot ID and a volume ID.
type ContentSource struct {
	Snapshot string `json:"snapshot,omitempty"`
	Volume   string `json:"volume,omitempty"`
}

// StageRecord says that node has the volume staged at path. For an image
// volume a record with ReadOnly false fences every other node, as a publish
// record does (a record written before the field existed counts as
// read-write).
type StageRecord struct {
	Node     string    `json:"node"`
	Path     string    `json:"path"`
	ReadOnly bool      `json:"readOnly,omitempty"`
	At       time.Time `json:"at"`
}

const (
	metadataFile = "volume.json"
	imageFile    = "disk.img"
	lockFile     = "lock"
)

// Dir is the directory holding one volume.
func (p *Pool) Dir(id VolumeID) string { return filepath.Join(p.cfg.Path, volumesDir, id.Key) }

// ImagePath is the image file of an image-layout volume.
func (p *Pool) ImagePath(id VolumeID) string { return filepath.Join(p.Dir(id), imageFile) }

// Load reads volume.json. A missing volume is ErrNotFound where the path
// shows the pool; where it does not (no pool.json, or not the pool this
// process saw there), ErrUnavailable.
func (p *Pool) Load(id VolumeID) (*Volume, error) {
	raw, err := p.files().readBeneath(volumeRel(id, metadataFile), maxVolumeMeta)
	if missing(err) {
		// A volume is missing from the pool only if the path shows the
		// pool: over an empty filesystem covering it (or another pool's),
		// every volume is missing, and "not found" would tell the caller
		// (kubelet) to give up on one that exists.
		if merr := p.readMeta(); merr != nil {
			if !errors.Is(merr, ErrUnavailable) {
				merr = fmt.Errorf("%w: pool %s: %s does not show the pool: %w", ErrUnavailable, p.cfg.Name, p.cfg.Path, merr)
			}
			return nil, fmt.Errorf("volume %s: %w", id, merr)
		}
	}
	return p.parseVolume(id, raw, err)
}

// loadIn is Load through a tree of the pool opened once for a batch of reads
// (nil: Load).
func (p *Pool) loadIn(t *fsx.Tree, id VolumeID) (*Volume, error) {
	if t == nil {
		return p.Load(id)
	}
	raw, err := t.ReadFile(volumeRel(id, metadataFile), maxVolumeMeta)
	if err != nil {
		err = p.files().classify(err)
	}
	return p.parseVolume(id, raw, err)
}

func (p *Pool) parseVolume(id VolumeID, raw []byte, err error) (*Volume, error) {
	if err != nil {
		return nil, fmt.Errorf("read metadata of volume %s: %w", id, notFound(err))
	}
	var v Volume
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, fmt.Errorf("%w: volume %s: %w", ErrCorrupt, id, err)
	}
	if v.SchemaVersion > SchemaVersion {
		return nil, fmt.Errorf("%w: volume %s has schema version %d, this driver understands up to %d", ErrCorrupt, id, v.SchemaVersion, SchemaVersion)
	}
	if v.ID != id.String() {
		return nil, fmt.Errorf("%w: %s records ID %q", ErrCorrupt, filepath.Join(p.Dir(id), metadataFile), v.ID)
	}
	if err := v.validate(); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrCorrupt, filepath.Join(p.Dir(id), metadataFile), err)
	}
	return &v, nil
}

// validate checks every field a decision is made on: volume.json is input like
// any request (on a shared pool, anyone who can write the pool wrote it), and a
// value no driver writes is damage, not something to act on.
func (v *Volume) validate() error {
	switch {
	case v.CapacityBytes <= 0 || v.CapacityBytes > MaxCapacity:
		return fmt.Errorf("capacityBytes %d is outside 1..%d", v.CapacityBytes, int64(MaxCapacity))
	case v.Layout != LayoutImage && v.Layout != LayoutDir:
		return fmt.Errorf("layout %q is unknown", v.Layout)
	case v.AccessType != AccessFilesystem && v.AccessType != AccessBlock:
		return fmt.Errorf("accessType %q is unknown", v.AccessType)
	case v.State != StateCreating && v.State != StateReady:
		return fmt.Errorf("state %q is unknown", v.State)
	case v.FSType != "" && v.FSType != "ext4" && v.FSType != "xfs" && v.FSType != "btrfs":
		return fmt.Errorf("fsType %q is unknown", v.FSType)
	}
	if err := ValidateVolumeName(v.Name); err != nil {
		return err
	}
	if err := v.IOLimits.validate(); err != nil {
		return err
	}
	if v.Layout != LayoutImage && (!v.IOLimits.IsZero() || v.Preallocate) {
		return fmt.Errorf("layout %s has no I/O limits or preallocation", v.Layout)
	}
	if v.Ephemeral != nil {
		if err := v.Ephemeral.validate(v.Name); err != nil {
			return err
		}
	}
	for _, s := range v.Staged {
		if err := ValidateNodeID(s.Node); err != nil {
			return fmt.Errorf("staged: %w", err)
		}
		if !filepath.IsAbs(s.Path) || filepath.Clean(s.Path) != s.Path {
			return fmt.Errorf("staged: path %q is not a clean absolute path", s.Path)
		}
	}
	for _, r := range v.Published {
		if err := ValidateNodeID(r.Node); err != nil {
			return fmt.Errorf("published: %w", err)
		}
	}
	return nil
}

// save writes volume.json atomically: a reader sees the old or the new
// content, never a torn one, even across a crash or power loss. It is not
// exported: Update is the one read-modify-write for everyone else. durable
// false leaves out the fsync of the directory, so the rename may not survive a
// crash (the content, if it does, is whole: the temp file is still fsynced
// before the rename, or xfs could leave an empty volume.json). Only for a write
// a later durable one in the same directory supersedes, and whose loss the
// caller recovers from.
func (p *Pool) save(v *Volume, durable bool) error {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return err
	}
	if err := p.files().checkDir(volumeRel(id)); err != nil {
		return err
	}
	v.SchemaVersion = SchemaVersion
	raw, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encode metadata of volume %s: %w", id, err)
	}
	return p.files().writeBeneath(volumeRel(id, metadataFile), append(raw, '\n'), durable)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// GetStaged returns the stage records; nil-safe.
func (v *Volume) GetStaged() []StageRecord {
	if v == nil {
		return nil
	}
	return v.Staged
}

// IsStaged reports whether any node has the volume staged.
func (v *Volume) IsStaged() bool { return len(v.Staged) > 0 }

// SetStaged records (node, path) as staged, replacing an older record of the node.
func (v *Volume) SetStaged(node, path string, readOnly bool, now time.Time) {
	v.ClearStaged(node)
	v.Staged = append(v.Staged, StageRecord{Node: node, Path: path, ReadOnly: readOnly, At: now.UTC()})
}

// ClearStaged forgets node's staging.
func (v *Volume) ClearStaged(node string) {
	kept := v.Staged[:0]
	for _, s := range v.Staged {
		if s.Node != node {
			kept = append(kept, s)
		}
	}
	v.Staged = kept
	if len(v.Staged) == 0 {
		v.Staged = nil
	}
}

// Update applies change to a volume's metadata under its cross-process lock and
// saves it when change reports a difference: the one read-modify-write of
// volume.json, so no caller can save a copy it loaded without the lock.
// change may refuse (an error, returned as is, and nothing is saved). The
// volume may be in any state; change checks what it needs.
func (p *Pool) Update(ctx context.Context, id VolumeID, change func(*Volume) (changed bool, err error)) error {
	unlock, err := p.LockVolume(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	raw, err := p.files().readBeneath(volumeRel(id, metadataFile), maxVolumeMeta)
	v, err := p.parseVolume(id, raw, err)
	if err != nil {
		return err
	}
	changed, err := change(v)
	if err != nil || !changed {
		return err
	}
	if !v.grows(len(raw)) {
		// A record that does not grow (an unstage, an unpublish) takes no
		// room for good: on a full pool it may spend the reserve, so that
		// a volume can always be let go.
		return p.Ledger().freeing(func() error { return p.save(v, true) })
	}
	return p.save(v, true)
}

// grows tells whether v's record is larger than size bytes, as save writes it.
func (v *Volume) grows(size int) bool {
	raw, err := json.MarshalIndent(v, "", "  ")
	return err != nil || len(raw)+1 > size
}
