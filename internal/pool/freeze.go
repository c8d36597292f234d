package pool

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// Freeze requests between nodes (docs/snapshots.md#freezing-across-nodes).
// A controller that snapshots an image volume staged read-write on another
// node asks that node to freeze it through the pool, the only channel poolcsi
// has between nodes. freeze/<node>/ is the node's inbox, found with one
// readdir:
//
//	<key>.request  written by a controller (atomically), removed by it after its copy
//	<key>.ack      written by the node (in place), removed by it after the thaw
//
// Each file has one writer. The ack is rewritten in place, as a lease is: a
// reader on another NFS client that opens it anew gets the current content
// of the same inode, where a name cached across a rename could still show the
// "frozen" a later "thawed" replaced, and that is the one change the
// controller must never miss.

const (
	freezeDir     = "freeze"
	requestSuffix = ".request"
	ackSuffix     = ".ack"
	// maxFreezeRequest and freezeAckSize bound both files: a request holds
	// two IDs, a path and a nonce; an ack is padded to its fixed size.
	maxFreezeRequest = 8 << 10
	freezeAckSize    = 2 << 10
	maxFreezeReason  = 1 << 10
)

// Freezes is the pool's view for the freeze protocol between nodes: the
// inboxes of requests and answers, and the freeze records older versions
// wrote. Like every view of the pool it is a narrow store over the one Pool
// (as containerd's metadata stores are over one database): the format keeps
// one owner, and Pool's own verbs stay the volume lifecycle.
type Freezes struct{ p *Pool }

// Freezes is the pool's freeze inboxes and records.
func (p *Pool) Freezes() Freezes { return Freezes{p} }

var nonceRE = regexp.MustCompile(`^[0-9a-f]{32}$`)

// FreezeRequest asks Node to freeze the filesystem of Volume staged at Path.
// Nonce tells one request from the next of the same volume.
type FreezeRequest struct {
	Volume string `json:"volume"`
	Node   string `json:"node"`
	Path   string `json:"path"`
	Nonce  string `json:"nonce"`
}

// FreezeState is a node's answer to a freeze request.
type FreezeState string

const (
	// FreezeFrozen: the filesystem is frozen, until the request goes.
	FreezeFrozen FreezeState = "frozen"
	// FreezeThawed: thawed while the request was still there (its maximum
	// hold passed, the node plugin stopped or restarted). Written before
	// the thaw, so a controller that still reads "frozen" after its copy
	// knows the copy ended before the thaw began.
	FreezeThawed FreezeState = "thawed"
	// FreezeNotStaged: nothing of the volume is mounted read-write at that
	// path on the node, so nothing there writes to it.
	FreezeNotStaged FreezeState = "notStaged"
	// FreezeFailed: the node could not freeze it (Reason says why).
	FreezeFailed FreezeState = "failed"
)

// FreezeAck is a node's answer to the request with the same Nonce.
type FreezeAck struct {
	Volume string      `json:"volume"`
	Node   string      `json:"node"`
	Nonce  string      `json:"nonce"`
	State  FreezeState `json:"state"`
	Reason string      `json:"reason,omitempty"`
	// HoldMillis, with "frozen", is the node's bound on the freeze in
	// milliseconds: it is thawed then at the latest, by the node's clock,
	// whether or not it could write "thawed" first.
	HoldMillis int64 `json:"holdMs,omitempty"`
}

// NewFreezeNonce is a random nonce for a request.
func NewFreezeNonce() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func freezeRel(node string, id VolumeID, suffix string) string {
	return filepath.Join(freezeDir, node, id.Key+suffix)
}

// validateRequest checks what a request must be before it is written or acted on.
func (fr Freezes) validateRequest(r FreezeRequest) (VolumeID, error) {
	id, err := ParseVolumeID(r.Volume)
	if err != nil {
		return id, err
	}
	if id.Pool != fr.p.cfg.Name || id.String() != fr.p.IDOf(id.Key).String() {
		return id, fmt.Errorf("%w: freeze request names volume %s of another pool than %s", ErrInvalidID, r.Volume, fr.p.cfg.Name)
	}
	if err := ValidateNodeID(r.Node); err != nil {
		return id, err
	}
	if !filepath.IsAbs(r.Path) || filepath.Clean(r.Path) != r.Path || strings.ContainsRune(r.Path, 0) {
		return id, fmt.Errorf("%w: freeze request path %q is not a clean absolute path", ErrInvalidID, r.Path)
	}
	if !nonceRE.MatchString(r.Nonce) {
		return id, fmt.Errorf("%w: freeze request nonce %q is not 32 hex digits", ErrInvalidID, r.Nonce)
	}
	return id, nil
}

// makeInbox makes freeze/<node>/ if it is missing, each level through a
// descriptor of its parent opened below the pool's root without links, so a
// link planted in its place makes nothing outside the pool.
func (fr Freezes) makeInbox(node string) error {
	for _, rel := range []string{freezeDir, filepath.Join(freezeDir, node)} {
		parent, err := fsx.OpenDir(fr.p.cfg.Path, filepath.Clean("./"+filepath.Dir(rel)))
		if err != nil {
			return fr.p.files().classify(err)
		}
		err = unix.Mkdirat(int(parent.Fd()), filepath.Base(rel), 0o750)
		parent.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("pool %s: make %s: %w", fr.p.cfg.Name, rel, err)
		}
		if err := fr.p.files().checkDir(rel); err != nil {
			return err
		}
	}
	return nil
}

// WriteRequest puts r into its node's inbox (the controller's side).
func (fr Freezes) WriteRequest(r FreezeRequest) error {
	id, err := fr.validateRequest(r)
	if err != nil {
		return err
	}
	if err := fr.makeInbox(r.Node); err != nil {
		return err
	}
	raw, _ := json.Marshal(r)
	return fr.p.files().writeBeneath(freezeRel(r.Node, id, requestSuffix), append(raw, '\n'), true)
}

// RemoveRequest withdraws the request for volume id from node's inbox;
// nil when it is not there.
func (fr Freezes) RemoveRequest(node string, id VolumeID) error {
	return fr.removeInInbox(node, id, requestSuffix)
}

// RemoveAck removes the node's answer about volume id (the node's side).
func (fr Freezes) RemoveAck(node string, id VolumeID) error {
	return fr.removeInInbox(node, id, ackSuffix)
}

func (fr Freezes) removeInInbox(node string, id VolumeID, suffix string) error {
	if err := ValidateNodeID(node); err != nil {
		return err
	}
	d, err := fsx.OpenDir(fr.p.cfg.Path, filepath.Join(freezeDir, node))
	if missing(err) {
		return nil
	}
	if err != nil {
		return fr.p.files().classify(err)
	}
	defer d.Close()
	if err := unix.Unlinkat(int(d.Fd()), id.Key+suffix, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("pool %s: remove %s: %w", fr.p.cfg.Name, freezeRel(node, id, suffix), err)
	}
	return nil
}

// InboxEntry is one request found in an inbox, or why it was not usable
// (Err: a link, a FIFO, an oversized or malformed file, a bad name). Name is
// the directory entry, for messages.
type InboxEntry struct {
	Name    string
	Volume  VolumeID
	Request FreezeRequest
	Err     error
}

// Inbox lists node's inbox: its requests, and the volumes it has answered
// about (acks). A missing inbox is empty.
func (fr Freezes) Inbox(node string) (requests []InboxEntry, acked []VolumeID, err error) {
	if err := ValidateNodeID(node); err != nil {
		return nil, nil, err
	}
	des, err := fr.p.files().readDir(filepath.Join(freezeDir, node))
	if missing(err) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("%w: pool %s: freeze inbox of node %s: %w", ErrUnavailable, fr.p.cfg.Name, node, err)
	}
	for _, de := range des {
		name := de.Name()
		if fsx.IsTemp(name) {
			continue
		}
		if key, ok := strings.CutSuffix(name, ackSuffix); ok && keyRE.MatchString(key) {
			acked = append(acked, fr.p.IDOf(key))
			continue
		}
		e := InboxEntry{Name: name}
		key, ok := strings.CutSuffix(name, requestSuffix)
		if !ok || !keyRE.MatchString(key) {
			e.Err = fmt.Errorf("%w: %s is not a freeze request poolcsi writes", ErrCorrupt, filepath.Join(fr.p.cfg.Path, freezeDir, node, name))
			requests = append(requests, e)
			continue
		}
		e.Volume = fr.p.IDOf(key)
		e.Request, e.Err = fr.readRequest(node, e.Volume)
		requests = append(requests, e)
	}
	return requests, acked, nil
}

// readRequest reads and checks one request: it must name the volume its
// file is named after, in this pool, for this node.
func (fr Freezes) readRequest(node string, id VolumeID) (FreezeRequest, error) {
	var r FreezeRequest
	raw, err := fr.p.files().readBeneath(freezeRel(node, id, requestSuffix), maxFreezeRequest)
	if err != nil {
		return r, err
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return r, fmt.Errorf("%w: freeze request for volume %s: %w", ErrCorrupt, id, err)
	}
	rid, err := fr.validateRequest(r)
	if err != nil {
		return r, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	if rid.String() != id.String() || r.Node != node {
		return r, fmt.Errorf("%w: the freeze request in %s names volume %s of node %s", ErrCorrupt, freezeRel(node, id, requestSuffix), r.Volume, r.Node)
	}
	return r, nil
}

// WriteAck writes the node's answer about a volume, in place, padded
// to a fixed size so that no tail of an earlier answer is left, and fsynced.
func (fr Freezes) WriteAck(a FreezeAck) error {
	id, err := ParseVolumeID(a.Volume)
	if err != nil {
		return err
	}
	if err := ValidateNodeID(a.Node); err != nil {
		return err
	}
	if len(a.Reason) > maxFreezeReason {
		a.Reason = a.Reason[:maxFreezeReason]
	}
	raw, _ := json.Marshal(a)
	if len(raw) >= freezeAckSize {
		return fmt.Errorf("freeze ack of volume %s is %d bytes, over %d", a.Volume, len(raw), freezeAckSize-1)
	}
	if err := fr.makeInbox(a.Node); err != nil {
		return err
	}
	line := append(raw, []byte(strings.Repeat(" ", freezeAckSize-1-len(raw))+"\n")...)
	f, err := fsx.OpenRegular(fr.p.cfg.Path, freezeRel(a.Node, id, ackSuffix), unix.O_RDWR|unix.O_CREAT, 0o640)
	if err != nil {
		return fmt.Errorf("pool %s: freeze ack of volume %s: %w", fr.p.cfg.Name, id, unsafe(err))
	}
	defer f.Close()
	if _, err := f.WriteAt(line, 0); err != nil {
		return fmt.Errorf("pool %s: write freeze ack of volume %s: %w", fr.p.cfg.Name, id, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("pool %s: fsync freeze ack of volume %s: %w", fr.p.cfg.Name, id, err)
	}
	return nil
}

// ReadAck reads node's answer about volume id; ok is false when there
// is none.
func (fr Freezes) ReadAck(node string, id VolumeID) (a FreezeAck, ok bool, err error) {
	if err := ValidateNodeID(node); err != nil {
		return a, false, err
	}
	raw, err := fr.p.files().readBeneath(freezeRel(node, id, ackSuffix), freezeAckSize)
	switch {
	case missing(err):
		return a, false, nil
	case err != nil:
		return a, false, err
	}
	if err := json.Unmarshal([]byte(strings.TrimSpace(string(raw))), &a); err != nil {
		return a, false, fmt.Errorf("%w: freeze ack of volume %s by node %s: %w", ErrCorrupt, id, node, err)
	}
	if a.Volume != id.String() || a.Node != node {
		return a, false, fmt.Errorf("%w: the freeze ack of volume %s by node %s names volume %s of node %s", ErrCorrupt, id, node, a.Volume, a.Node)
	}
	return a, true, nil
}

// freezeFile marks, in a volume's directory, that a node froze its filesystem
// for a snapshot. Only older versions write it: a node now records its freezes
// in its own records, outside every pool. A start still reads the ones naming
// its node, for the volume only (the path is pool content and never used),
// and removes them; pool check reports them.
const freezeFile = "frozen"

// Freeze is a record an older version wrote when node froze the filesystem of
// a volume mounted at Path for a snapshot (volumes/<key>/frozen,
// "<node>\n<path>"). Path is whatever the pool says: never open it.
type Freeze struct {
	Volume VolumeID
	Node   string
	Path   string
}

// WriteRecord writes the freeze record of a volume as older versions did
// before a freeze (tests and tools make such records with it).
func (fr Freezes) WriteRecord(id VolumeID, node, path string) error {
	if err := ValidateNodeID(node); err != nil {
		return err
	}
	if err := fr.p.files().checkDir(volumeRel(id)); err != nil {
		return err
	}
	return fr.p.files().writeBeneath(volumeRel(id, freezeFile), []byte(node+"\n"+path), true)
}

// ClearRecord removes a volume's freeze record (an older version's).
// The volume's directory is opened below the pool's root without links and
// the record unlinked relative to it, so a link swapped in for the directory
// removes nothing outside the pool.
func (fr Freezes) ClearRecord(id VolumeID) error {
	d, err := fsx.OpenDir(fr.p.cfg.Path, volumeRel(id))
	if missing(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("volume %s: clear freeze record: %w", id, fr.p.files().classify(err))
	}
	defer d.Close()
	if err := unix.Unlinkat(int(d.Fd()), freezeFile, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("volume %s: clear freeze record: %w", id, err)
	}
	return nil
}

// Records lists the pool's freeze records. One that cannot be read or parsed is
// skipped: it names nothing this node could safely thaw.
func (fr Freezes) Records() ([]Freeze, error) {
	des, err := fr.p.files().readDir(volumesDir)
	if err != nil {
		return nil, fmt.Errorf("%w: list pool %s: %w", ErrUnavailable, fr.p.cfg.Name, err)
	}
	var out []Freeze
	for _, de := range des {
		if !de.IsDir() || !keyRE.MatchString(de.Name()) {
			continue
		}
		raw, err := fr.p.files().readBeneath(volumeRel(fr.p.IDOf(de.Name()), freezeFile), maxFreezeRecord)
		if err != nil {
			continue
		}
		node, path, ok := strings.Cut(string(raw), "\n")
		if !ok || ValidateNodeID(node) != nil || !filepath.IsAbs(path) {
			continue
		}
		out = append(out, Freeze{Volume: fr.p.IDOf(de.Name()), Node: node, Path: path})
	}
	return out, nil
}
