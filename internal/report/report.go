// Package report is what `poolcsi status` shows: the model of what a driver's
// CSI socket answers (Report), gathering it through calls that change nothing
// (Gather, over any grpc.ClientConnInterface) and rendering it for a person
// (WriteText) or a program (WriteJSON). Everything in a Report came from the
// driver and is untrusted: the renderers escape what a terminal would act on.
package report

import (
	"fmt"
	"sort"
)

// nodeVolumeHealthNote says why status shows no node-side volume health.
const nodeVolumeHealthNote = "not shown: the node checks a volume at its staging or publish path, which no CSI call lists " +
	`(kubelet asks for each volume it mounted); for one: poolcsi call NodeGetVolumeStats '{"volume_id": "…", "volume_path": "…"}'`

// Report is everything status found, the same facts for the text and
// the JSON output.
type Report struct {
	Endpoint   string     `json:"endpoint"`
	Plugin     Plugin     `json:"plugin"`
	Node       Node       `json:"node"`
	Controller Controller `json:"controller"`
	// Errors are the calls that failed, each "Method: Code: message".
	Errors   []string `json:"errors,omitempty"`
	Problems []string `json:"problems"`
	Summary  Summary  `json:"summary"`
}

// Plugin is what the Identity service answered.
type Plugin struct {
	Name         string   `json:"name"`
	Version      string   `json:"version"`
	Services     []string `json:"services"`
	Capabilities []string `json:"capabilities"`
	Ready        bool     `json:"ready"`
	ProbeError   string   `json:"probe_error,omitempty"`
}

// Node is what the Node service answered; NotServed says why nothing.
type Node struct {
	NotServed         string            `json:"not_served,omitempty"`
	NodeID            string            `json:"node_id,omitempty"`
	MaxVolumes        int64             `json:"max_volumes_per_node"`
	Topology          map[string]string `json:"topology,omitempty"`
	Capabilities      []string          `json:"capabilities,omitempty"`
	StorageHealth     []HealthEntry     `json:"storage_health"`
	StorageHealthNote string            `json:"storage_health_note,omitempty"`
	VolumeHealthNote  string            `json:"volume_health_note,omitempty"`
}

// Controller is what the Controller service answered; NotServed says
// why nothing.
type Controller struct {
	NotServed    string         `json:"not_served,omitempty"`
	Capabilities []string       `json:"capabilities,omitempty"`
	Pools        []PoolCapacity `json:"pools,omitempty"`
	PoolsNote    string         `json:"pools_note,omitempty"`
	Volumes      []Volume       `json:"volumes,omitempty"`
	VolumesNote  string         `json:"volumes_note,omitempty"`
}

// PoolCapacity is GetCapacity's answer for one pool. Pool is empty for the
// answer to a request without parameters, from a driver with one pool.
type PoolCapacity struct {
	Pool               string `json:"pool"`
	AvailableBytes     int64  `json:"available_bytes"`
	MaximumVolumeBytes *int64 `json:"maximum_volume_bytes,omitempty"`
	MinimumVolumeBytes *int64 `json:"minimum_volume_bytes,omitempty"`
	Error              string `json:"error,omitempty"`
}

// Volume is one volume as ListVolumes and ControllerListVolumeHealth
// described it.
type Volume struct {
	ID            string              `json:"volume_id"`
	CapacityBytes int64               `json:"capacity_bytes"`
	Context       map[string]string   `json:"volume_context,omitempty"`
	Topology      []map[string]string `json:"accessible_topology,omitempty"`
	Published     []string            `json:"published_node_ids,omitempty"`
	Abnormal      bool                `json:"abnormal"`
	// Condition is the message of the volume_condition ListVolumes carries
	// (CSI ≤ v1.12, which kubelet and the health monitor read).
	Condition string `json:"condition,omitempty"`
	// Health is what ControllerListVolumeHealth (CSI v1.13) said of it.
	Health []HealthEntry `json:"health,omitempty"`
	// Unlisted: ControllerListVolumeHealth named it, ListVolumes did not.
	Unlisted bool `json:"unlisted,omitempty"`
}

// HealthEntry is one health status of a volume or of the node's storage.
type HealthEntry struct {
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message,omitempty"`
}

// Summary is the counts of the last line.
type Summary struct {
	Volumes          int   `json:"volumes"`
	Abnormal         int   `json:"abnormal_volumes"`
	ProvisionedBytes int64 `json:"provisioned_bytes"`
	Pools            int   `json:"pools"`
	Problems         int   `json:"problems"`
}

// Finish sorts the volumes, healthy first and abnormal last, and derives the
// problems and the summary from what was gathered.
func (r *Report) Finish() {
	c := &r.Controller
	sort.SliceStable(c.Volumes, func(i, j int) bool {
		a, b := c.Volumes[i], c.Volumes[j]
		if a.Abnormal != b.Abnormal {
			return !a.Abnormal
		}
		return a.ID < b.ID
	})
	var p []string
	p = append(p, r.Errors...)
	switch {
	case r.Plugin.ProbeError != "":
		p = append(p, "Probe: "+r.Plugin.ProbeError)
	case !r.Plugin.Ready:
		p = append(p, "Probe: the plugin says it is not ready")
	}
	for _, h := range r.Node.StorageHealth {
		p = append(p, "storage "+h.String())
	}
	s := Summary{}
	for _, pc := range c.Pools {
		if pc.Error != "" {
			p = append(p, fmt.Sprintf("pool %s: GetCapacity: %s", pc.Pool, pc.Error))
			continue
		}
		s.Pools++
	}
	for _, v := range c.Volumes {
		s.Volumes++
		s.ProvisionedBytes += v.CapacityBytes
		if !v.Abnormal {
			continue
		}
		s.Abnormal++
		switch {
		case len(v.Health) > 0:
			for _, h := range v.Health {
				p = append(p, "volume "+v.ID+": "+h.String())
			}
		case v.Condition != "":
			p = append(p, "volume "+v.ID+": "+v.Condition)
		default:
			p = append(p, "volume "+v.ID+": abnormal")
		}
	}
	r.Problems = p
	if r.Problems == nil {
		r.Problems = []string{}
	}
	s.Problems = len(p)
	r.Summary = s
}

// String is "STATUS Reason: message".
func (h HealthEntry) String() string {
	s := h.Status + " " + h.Reason
	if h.Message != "" {
		s += ": " + h.Message
	}
	return s
}
