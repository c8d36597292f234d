package params

import (
	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/poolcsi/poolcsi/internal/cgroup"
)

// PodUIDKey is the volume_context key kubelet fills with the pod's UID when
// the CSIDriver object asks for podInfoOnMount.
const PodUIDKey = K8sPrefix + "pod.uid"

// PodUID returns the pod UID of a publish's volume context, "" without one
// (no podInfoOnMount). One that is not a UUID is an error: it becomes part of
// a cgroup path, so anything else is never used; but it is no reason to
// refuse the pod its volume (a static pod's UID is a hash, not a UUID): the
// caller logs it, and that pod is just not held to I/O limits.
func PodUID(volumeContext map[string]string) (string, error) {
	uid, ok := volumeContext[PodUIDKey]
	if !ok || uid == "" {
		return "", nil
	}
	if err := cgroup.ValidatePodUID(uid); err != nil {
		return "", err
	}
	return uid, nil
}

// ReadOnlyMode tells whether an access mode only ever reads.
func ReadOnlyMode(m csi.VolumeCapability_AccessMode_Mode) bool {
	return m == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY ||
		m == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

// ReadOnly tells whether every access mode of c only ever reads (false for
// none).
func (c Caps) ReadOnly() bool {
	if len(c.Modes) == 0 {
		return false
	}
	for _, m := range c.Modes {
		if !ReadOnlyMode(m) {
			return false
		}
	}
	return true
}
