package pool

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
)

// MaxNameLength bounds CreateVolume names. Kubernetes names PVs "pvc-<uuid>" (40
// characters); the CSI spec asks plugins to accept at least 128.
const MaxNameLength = 253

var (
	poolNameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$`)
	keyRE      = regexp.MustCompile(`^[0-9a-f]{32}$`)
)

// ValidatePoolName accepts DNS-label-like names of at most 32 characters, so a pool
// name is safe in a path, a volume ID, a metric label and a Kubernetes object.
func ValidatePoolName(name string) error {
	if !poolNameRE.MatchString(name) {
		return fmt.Errorf("%w: pool name %q must be 1-32 lowercase letters, digits or '-', starting and ending with a letter or digit", ErrInvalidID, name)
	}
	return nil
}

// ValidateVolumeName checks a CreateVolume name. Names are never used in paths (only
// their hash is), so the rules only keep logs and metadata sane.
func ValidateVolumeName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: volume name is empty", ErrInvalidID)
	case len(name) > MaxNameLength:
		return fmt.Errorf("%w: volume name is %d bytes, the limit is %d", ErrInvalidID, len(name), MaxNameLength)
	case strings.ContainsRune(name, 0):
		return fmt.Errorf("%w: volume name contains a NUL byte", ErrInvalidID)
	}
	return nil
}

// KeyForName derives the directory key of a volume from its request name, so a
// retried CreateVolume lands on the volume the first attempt made.
func KeyForName(name string) string {
	sum := sha256.Sum256([]byte(name))
	return hex.EncodeToString(sum[:16])
}

// VolumeID is the handle Kubernetes stores in the PV: "<pool>.<key>", or for a
// volume on a share a StorageClass names, "<pool>.<key>.<share>" (share.go).
// Only Pool and Key ever become parts of a path.
type VolumeID struct {
	Pool string
	Key  string
	// Share is the base64url encoding of the share's ShareRef, "" for a
	// volume of an operator-configured pool.
	Share string
	// Tag is the share tag the ID carried on the wire ("" for none): a
	// credential checked at the driver's door, not part of the volume's
	// identity. String leaves it out, Wire puts it in.
	Tag string
	// ref is Share decoded, once, where the ID was parsed or built.
	ref ShareRef
}

// String is the volume's identity: what volume.json records, what locks and
// logs name. It never carries the tag.
func (id VolumeID) String() string {
	if id.Share != "" {
		return id.Pool + "." + id.Key + "." + id.Share
	}
	return id.Pool + "." + id.Key
}

// Wire is the ID as the CO holds it: String and, on a share, the tag.
func (id VolumeID) Wire() string { return withTag(id.String(), id.Tag) }

// NewVolumeID builds the ID of the volume named name in pool poolName.
func NewVolumeID(poolName, name string) VolumeID {
	return VolumeID{Pool: poolName, Key: KeyForName(name)}
}

// ParseVolumeID validates an ID received over the wire before any path is built
// from it: only "<pool name>.<32 lowercase hex>" passes, which cannot contain "/",
// "..", NUL or anything else that leaves the pool, or for a volume on a share
// "s-<16 hex>.<32 hex>.<share>[.<tag>]", whose share part decodes to a valid ShareRef
// whose pool name is exactly the ID's pool (so one share has one pool name, and
// an ID cannot pair a share with another share's pool). A share pool's name
// without its share part is refused: such a pool is only ever reached through
// its share.
func ParseVolumeID(s string) (VolumeID, error) {
	if len(s) > MaxVolumeIDLength {
		return VolumeID{}, fmt.Errorf("%w: volume ID is %d bytes long", ErrInvalidID, len(s))
	}
	bad := func() (VolumeID, error) {
		return VolumeID{}, fmt.Errorf("%w: %q is not a poolcsi volume ID (<pool>.<32 hex digits>, or s-<16 hex digits>.<32 hex digits>.<share> for a share)", ErrInvalidID, s)
	}
	parts := strings.SplitN(s, ".", 3)
	if len(parts) < 2 || ValidatePoolName(parts[0]) != nil || !keyRE.MatchString(parts[1]) {
		return bad()
	}
	id := VolumeID{Pool: parts[0], Key: parts[1]}
	if IsSharePoolName(id.Pool) != (len(parts) == 3) {
		return bad()
	}
	if len(parts) == 3 {
		share, tag, err := splitTag(parts[2])
		if err != nil {
			return VolumeID{}, err
		}
		ref, err := checkSharePart(s, id.Pool, share)
		if err != nil {
			return VolumeID{}, err
		}
		id.Share, id.Tag, id.ref = share, tag, ref
	}
	return id, nil
}
