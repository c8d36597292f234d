package pool

import (
	"fmt"
	"path/filepath"
	"regexp"
)

// EphemeralRecord marks a CSI ephemeral inline volume: made by one node's
// NodePublishVolume for one pod and removed by its NodeUnpublishVolume (or by
// that node's sweep once its target holds it no more). Nothing else may delete
// it: the CO knows it only by the handle kubelet made up, never by its pool ID.
type EphemeralRecord struct {
	// Handle is the volume_id kubelet made up ("csi-<sha256 hex>").
	Handle string `json:"handle"`
	// Node is the node that made it and the only one that removes it.
	Node string `json:"node"`
	// Target is the pod's target path it is published at.
	Target string `json:"target"`
	// Pod names the pod, for operators (namespace/name); never a decision.
	Pod string `json:"pod,omitempty"`
}

// ephemeralHandleRE is the volume_id kubelet makes for an inline volume:
// "csi-" and the hex SHA-256 of the pod UID and volume name. It has no '.',
// so it is never a poolcsi volume ID, and nothing of it reaches a path: the
// volume's key is the hash of EphemeralName.
var ephemeralHandleRE = regexp.MustCompile(`^csi-[0-9a-f]{64}$`)

// ValidateEphemeralHandle accepts the volume_id kubelet makes up for an inline volume.
func ValidateEphemeralHandle(h string) error {
	if !ephemeralHandleRE.MatchString(h) {
		if len(h) > 80 {
			h = h[:80] + "…"
		}
		return fmt.Errorf("%w: %q is not an ephemeral inline volume handle (csi-<64 hex digits>, as kubelet makes them)", ErrInvalidID, h)
	}
	return nil
}

// IsEphemeralHandle tells whether a volume_id has the form of an inline
// volume's handle.
func IsEphemeralHandle(h string) bool { return ephemeralHandleRE.MatchString(h) }

// EphemeralPrefix begins the name of every ephemeral volume; a CreateVolume
// name may not (a PV name never has a '/').
const EphemeralPrefix = "csi.storage.k8s.io/ephemeral/"

// EphemeralName is the volume name of the inline volume with handle h: its
// key, like any volume's, is the hash of its name, the same in every pool.
func EphemeralName(h string) string { return EphemeralPrefix + h }

func (r *EphemeralRecord) validate(name string) error {
	if err := ValidateEphemeralHandle(r.Handle); err != nil {
		return fmt.Errorf("ephemeral: %w", err)
	}
	if name != EphemeralName(r.Handle) {
		return fmt.Errorf("ephemeral: handle %s does not match the volume name %q", r.Handle, name)
	}
	if err := ValidateNodeID(r.Node); err != nil {
		return fmt.Errorf("ephemeral: %w", err)
	}
	if !filepath.IsAbs(r.Target) || filepath.Clean(r.Target) != r.Target {
		return fmt.Errorf("ephemeral: target %q is not a clean absolute path", r.Target)
	}
	if len(r.Pod) > 2*MaxNameLength {
		return fmt.Errorf("ephemeral: pod name is %d bytes long", len(r.Pod))
	}
	return nil
}

// AllowsEphemeral tells whether inline volumes may be made in the pool: a
// local pool unless its config says ephemeral: false, a shared pool only when
// it says ephemeral: true (a volume whose life is one node's, on storage
// every node sees, is the admin's choice). Never a share's pool.
func (c Config) AllowsEphemeral() bool {
	if c.Share != nil {
		return false
	}
	if c.Ephemeral != nil {
		return *c.Ephemeral
	}
	return !c.Shared
}
