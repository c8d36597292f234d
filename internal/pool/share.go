package pool

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
)

// A share is a filesystem a StorageClass names (an NFS export, a CephFS path,
// …) that the driver mounts itself, on demand, and keeps a pool on. Its pool
// has no operator-given name: the name is derived from the share, so every
// node and every controller replica calls one share by one name, and the
// share's volume IDs carry the share itself (see ShareRef and ParseVolumeID),
// so a call that brings only an ID (DeleteVolume, ControllerUnpublishVolume,
// NodeUnstageVolume, …) can find the share after a restart on another node.

// MaxVolumeIDLength is the CSI limit on a string field, which volume IDs of
// shares (the longest IDs) must respect.
const MaxVolumeIDLength = 128

// MaxShareLength bounds a share's type and source together, so the ID of each
// of its volumes as the CO holds it, "s-<16 hex>.<32 hex>.<base64url(type +
// " " + source)>.<tag>", fits MaxVolumeIDLength: 64 base64 characters hold 48
// bytes.
const MaxShareLength = 48

// ShareTagLength is the length of a share ID's tag: 8 bytes of a MAC in
// base64url. The tag proves the share was named by a StorageClass of a driver
// that holds the cluster's share key (the driver computes and checks it; the
// pool only parses it): a volume ID cannot introduce a share by itself.
const ShareTagLength = 11

var (
	sharePoolRE   = regexp.MustCompile(`^s-[0-9a-f]{16}$`)
	shareTypeRE   = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,23}$`)
	shareSourceRE = regexp.MustCompile(`^[A-Za-z0-9._:/=@,+\[\]-]+$`)
	payloadRE     = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
	tagRE         = regexp.MustCompile(`^[A-Za-z0-9_-]{11}$`)
)

// ShareRef names a share: the mount type and the source, nothing else. Mount
// options and secrets are never part of it: they do not make another share,
// and an ID carries a ShareRef, so an ID must not be able to carry options.
type ShareRef struct {
	Type   string `json:"type"`
	Source string `json:"source"`
}

// Validate checks the syntax every share must have, whatever its type: a type
// in lowercase letters, digits and ".-_"; a source of letters, digits and
// "._:/=@,+-[]" only (nothing a shell or mount(8) reads specially; brackets
// for an IPv6 address), not
// starting with "-" (mount(8) would read it as an option); both short enough
// for a volume ID. Which types a driver mounts is its own allow-list.
func (r ShareRef) Validate() error {
	if err := ValidateShareType(r.Type); err != nil {
		return err
	}
	switch {
	case r.Source == "":
		return fmt.Errorf("%w: share source is empty", ErrInvalidID)
	case !shareSourceRE.MatchString(r.Source):
		return fmt.Errorf("%w: share source %q may hold only letters, digits and . _ : / = @ , + - [ ]", ErrInvalidID, r.Source)
	case strings.HasPrefix(r.Source, "-"):
		return fmt.Errorf("%w: share source %q must not start with '-'", ErrInvalidID, r.Source)
	case len(r.Type)+1+len(r.Source) > MaxShareLength:
		return fmt.Errorf("%w: share type and source are %d bytes together, the limit is %d (each volume ID carries them, and CSI limits IDs to %d bytes); mount a shorter path or use a shorter server name",
			ErrInvalidID, len(r.Type)+1+len(r.Source), MaxShareLength, MaxVolumeIDLength)
	}
	return nil
}

// ValidateShareType checks the syntax of a share type (a mount type).
func ValidateShareType(t string) error {
	if !shareTypeRE.MatchString(t) {
		return fmt.Errorf("%w: share type %q must be 1-24 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit", ErrInvalidID, t)
	}
	return nil
}

// PoolName is the name of the share's pool: "s-" and 16 hex digits of a hash
// of type and source. Operator-configured pools may not have names of this
// form (IsSharePoolName).
func (r ShareRef) PoolName() string {
	sum := sha256.Sum256([]byte("poolcsi share\x00" + r.Type + "\x00" + r.Source))
	return "s-" + hex.EncodeToString(sum[:8])
}

// String is how logs and messages show the share.
func (r ShareRef) String() string { return r.Type + " " + r.Source }

func (r ShareRef) payload() string {
	return base64.RawURLEncoding.EncodeToString([]byte(r.Type + " " + r.Source))
}

func parsePayload(s string) (ShareRef, error) {
	if !payloadRE.MatchString(s) {
		return ShareRef{}, fmt.Errorf("%w: share part %q of a volume ID is not 1-64 base64url characters", ErrInvalidID, s)
	}
	raw, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return ShareRef{}, fmt.Errorf("%w: share part %q of a volume ID: %w", ErrInvalidID, s, err)
	}
	typ, src, ok := strings.Cut(string(raw), " ")
	if !ok {
		return ShareRef{}, fmt.Errorf("%w: share part %q of a volume ID has no source", ErrInvalidID, s)
	}
	r := ShareRef{Type: typ, Source: src}
	if err := r.Validate(); err != nil {
		return ShareRef{}, err
	}
	// One share, one encoding: a second spelling of the same bytes would be a
	// second ID of one volume.
	if r.payload() != s {
		return ShareRef{}, fmt.Errorf("%w: share part %q of a volume ID is not in canonical form", ErrInvalidID, s)
	}
	return r, nil
}

// IsSharePoolName tells whether name has the form of a share's pool name,
// which operator-configured pools may not use.
func IsSharePoolName(name string) bool { return sharePoolRE.MatchString(name) }

// NewShareVolumeID is the ID of the volume named name on share r.
func NewShareVolumeID(r ShareRef, name string) VolumeID {
	return VolumeID{Pool: r.PoolName(), Key: KeyForName(name), Share: r.payload(), ref: r}
}

// ShareRef returns the share an ID names, if it names one.
// The share part was decoded where the ID was parsed or built; it is not
// decoded again.
func (id VolumeID) ShareRef() (ShareRef, bool) { return refOf(id.ref, id.Share) }

// splitTag splits the tag off the last part of a share ID: "" when the part
// holds none.
func splitTag(last string) (share, tag string, err error) {
	share, tag, tagged := strings.Cut(last, ".")
	if !tagged {
		return last, "", nil
	}
	if !tagRE.MatchString(tag) {
		return "", "", fmt.Errorf("%w: tag %q of a share ID is not %d base64url characters", ErrInvalidID, tag, ShareTagLength)
	}
	return share, tag, nil
}

// withTag is an ID string with its tag, as the CO holds it.
func withTag(s, tag string) string {
	if tag == "" {
		return s
	}
	return s + "." + tag
}

// checkSharePart validates the share part of the volume or snapshot ID id,
// whose pool is poolName: a valid share, and one whose pool that is (so one
// share has one pool name, and an ID cannot pair a share with another's pool).
func checkSharePart(id, poolName, part string) (ShareRef, error) {
	r, err := parsePayload(part)
	if err != nil {
		return ShareRef{}, err
	}
	if r.PoolName() != poolName {
		return ShareRef{}, fmt.Errorf("%w: ID %q names share %s, whose pool is %s, not %s", ErrInvalidID, id, r, r.PoolName(), poolName)
	}
	return r, nil
}

// refOf is the share of an ID: ref, decoded when the ID was parsed or built.
// An ID built field by field (no parse) has only its share part, decoded here.
func refOf(ref ShareRef, part string) (ShareRef, bool) {
	if part == "" {
		return ShareRef{}, false
	}
	if ref != (ShareRef{}) {
		return ref, true
	}
	return shareOfPart(part)
}

// shareOfPart is the share of an ID's (already validated) share part.
func shareOfPart(part string) (ShareRef, bool) {
	if part == "" {
		return ShareRef{}, false
	}
	r, err := parsePayload(part)
	return r, err == nil
}
