// Package health computes volume health from real checks: the controller side
// reads the pool (metadata, image files, the pool's free space), the node side
// the mount table, sysfs and statfs through the driver's host (Node). Every
// check looks at the system as it is now and keeps no state, so a volume whose
// cause is fixed is healthy on the next call. It knows nothing of gRPC; the
// driver maps Issues to CSI messages.
package health

import (
	"fmt"
	"strings"
)

// Status is how badly an issue affects a volume. The values follow the CSI
// VolumeHealthErrorType enum, so the driver maps them one to one.
type Status int

const (
	// Degraded: the volume works but something needs the operator's attention
	// before it breaks (nearly full, read-only, filesystem errors recorded).
	Degraded Status = iota + 1
	// Inaccessible: the volume cannot be used where it should be (mount gone,
	// loop device detached, metadata unreadable).
	Inaccessible
	// DataLoss: data is gone or will be on the next unstage (image missing,
	// truncated, deleted under an attached loop device).
	DataLoss
)

func (s Status) String() string {
	switch s {
	case Degraded:
		return "degraded"
	case Inaccessible:
		return "inaccessible"
	case DataLoss:
		return "data_loss"
	}
	return "unknown"
}

// Issue is one adverse condition of a volume. Reason is a short CamelCase code
// for machines (metrics, events); Message names the cause and what to do.
type Issue struct {
	Status  Status
	Reason  string
	Message string
}

// Reasons, stable across releases: metrics and alerts key on them.
const (
	ReasonMetadataUnreadable = "MetadataUnreadable"
	ReasonImageMissing       = "ImageMissing"
	ReasonImageUnreadable    = "ImageUnreadable"
	ReasonImageTruncated     = "ImageTruncated"
	// ReasonUnsafeEntry: a volume's image or data directory was replaced by a
	// symbolic link or something else the driver refuses to use.
	ReasonUnsafeEntry = "UnsafeEntry"
	// ReasonDataMissing: a dir volume's data directory is gone.
	ReasonDataMissing         = "DataMissing"
	ReasonPoolNearlyFull      = "PoolNearlyFull"
	ReasonPoolUnavailable     = "PoolUnavailable"
	ReasonStagingMountMissing = "StagingMountMissing"
	ReasonPublishMountMissing = "PublishMountMissing"
	ReasonWrongMount          = "WrongMount"
	ReasonLoopDeviceDetached  = "LoopDeviceDetached"
	ReasonBackingFileDeleted  = "BackingFileDeleted"
	ReasonFilesystemReadOnly  = "FilesystemReadOnly"
	ReasonFilesystemErrors    = "FilesystemErrors"
	ReasonFilesystemIOError   = "FilesystemIOError"
	ReasonVolumeNearlyFull    = "VolumeNearlyFull"
	ReasonInodesNearlyFull    = "VolumeInodesNearlyFull"
	// ReasonNodeFenced: the node could not renew its lease in the volume's
	// shared pool and fenced itself off (docs/fencing.md).
	ReasonNodeFenced = "NodeFenced"
	// ReasonFenceFailedClosed: the node fenced itself off the volume's pool
	// but did not find the loop device of a read-write stage its own
	// records hold, so it fenced every device it could not rule out
	// (docs/fencing.md): the node needs looking at.
	ReasonFenceFailedClosed = "NodeFenceFailedClosed"
)

// Options are the thresholds of the checks, as fractions (0.9 = 90%).
type Options struct {
	// PoolFullThreshold: a pool filesystem used at least this much makes every
	// volume that can still grow into it (a sparse image) degraded.
	PoolFullThreshold float64
	// VolumeFullThreshold: a volume filesystem used at least this much (bytes or
	// inodes) is degraded, with a message to expand the PVC.
	VolumeFullThreshold float64
}

// DefaultOptions are the thresholds used when none are configured.
var DefaultOptions = Options{PoolFullThreshold: 0.9, VolumeFullThreshold: 0.9}

// Validate refuses thresholds outside (0, 1].
func (o Options) Validate() error {
	for name, v := range map[string]float64{"pool full threshold": o.PoolFullThreshold, "volume full threshold": o.VolumeFullThreshold} {
		if !(v > 0 && v <= 1) {
			return fmt.Errorf("%s %v: want a fraction in (0, 1] (a percentage in (0, 100])", name, v)
		}
	}
	return nil
}

// Summary joins the messages of issues for a log line or a demo printout.
func Summary(issues []Issue) string {
	if len(issues) == 0 {
		return "healthy"
	}
	parts := make([]string, 0, len(issues))
	for _, i := range issues {
		parts = append(parts, fmt.Sprintf("%s/%s: %s", i.Status, i.Reason, i.Message))
	}
	return strings.Join(parts, "; ")
}

func percent(frac float64) string { return fmt.Sprintf("%.0f%%", frac*100) }

// bytesIEC renders a byte count for operators (the exact number follows in
// parentheses where precision matters).
func bytesIEC(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
