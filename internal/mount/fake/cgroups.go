package fake

import (
	"fmt"

	"github.com/poolcsi/poolcsi/internal/cgroup"
)

// AddPod gives a pod a cgroup: until then, Apply finds none, as for a pod
// kubelet has not set up (or has torn down).
func (h *Host) AddPod(uid string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pods[uid] == nil {
		h.pods[uid] = map[string]cgroup.Limits{}
	}
}

// RestartContainers forgets what the pod's cgroup holds, as a container
// restarted under cgroup v1 sits in a new cgroup that holds nothing.
func (h *Host) RestartContainers(uid string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.pods[uid] != nil {
		h.pods[uid] = map[string]cgroup.Limits{}
	}
}

// RemovePod takes a pod's cgroup away.
func (h *Host) RemovePod(uid string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.pods, uid)
}

// PodLimits is what was last written for device in the pod's cgroup.
func (h *Host) PodLimits(uid, device string) (cgroup.Limits, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	l, ok := h.pods[uid][device]
	return l, ok
}

// Apply records limits in the pod's fake cgroup. Like the real one, it
// refuses a UID that is not a UUID before anything else, and knows only
// devices that exist (attached loop devices).
func (h *Host) Apply(uid, device string, l cgroup.Limits) (string, error) {
	if err := h.Faults.hit("Apply"); err != nil {
		return "", err
	}
	if err := cgroup.ValidatePodUID(uid); err != nil {
		return "", err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	pod, ok := h.pods[uid]
	if !ok {
		return "", fmt.Errorf("%w %s (fake)", cgroup.ErrNoPodCgroup, uid)
	}
	if _, ok := h.devices[device]; !ok {
		return "", fmt.Errorf("%s is not a block device (fake)", device)
	}
	pod[device] = l
	return "fake:/kubepods/pod" + uid, nil
}

// Held is what the pod's fake cgroup holds for device, as the real one reads
// it: zero Limits when nothing was written.
func (h *Host) Held(uid, device string) (cgroup.Limits, string, error) {
	if err := h.Faults.hit("Held"); err != nil {
		return cgroup.Limits{}, "", err
	}
	if err := cgroup.ValidatePodUID(uid); err != nil {
		return cgroup.Limits{}, "", err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	pod, ok := h.pods[uid]
	if !ok {
		return cgroup.Limits{}, "", fmt.Errorf("%w %s (fake)", cgroup.ErrNoPodCgroup, uid)
	}
	if _, ok := h.devices[device]; !ok {
		return cgroup.Limits{}, "", fmt.Errorf("%s is not a block device (fake)", device)
	}
	return pod[device], "fake:/kubepods/pod" + uid, nil
}
