// Package pvcevents puts a volume's health where a Kubernetes user looks: a
// Warning event on the PersistentVolumeClaim bound to an abnormal volume, and a
// Normal one when it recovers. It does what csi-external-health-monitor's
// controller does, from inside poolcsi's controller (which computes the health
// already), so claims get events where that sidecar is not deployed.
package pvcevents

import (
	"context"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// Event reasons, the health monitor's own, so one kubectl query finds both.
const (
	ReasonAbnormal = "VolumeConditionAbnormal"
	ReasonNormal   = "VolumeConditionNormal"
)

// Condition is one volume's health as the driver computes it.
type Condition struct {
	Abnormal bool
	Message  string
}

// Reporter turns the driver's volume conditions into events on claims.
type Reporter struct {
	Client kubernetes.Interface
	// Driver is the CSI driver name: only its PVs are looked at.
	Driver string
	// Conditions returns the condition of every volume of the driver that
	// has one worth reporting, by volume ID (an absent volume is normal).
	Conditions func(ctx context.Context) (map[string]Condition, error)

	recorder record.EventRecorder
	mu       sync.Mutex
	abnormal map[string]bool // volume handle -> last reported abnormal
}

// Run reports every interval until ctx ends.
func (r *Reporter) Run(ctx context.Context, interval time.Duration) {
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: r.Client.CoreV1().Events("")})
	defer b.Shutdown()
	r.recorder = b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: r.Driver + "-health"})
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		if err := r.Report(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Reporting volume health on claims")
		}
	}, interval)
}

// Report records one round of events: Warning for every abnormal volume's
// claim (the recorder counts repeats into one event), Normal once when a
// volume recovers.
func (r *Reporter) Report(ctx context.Context) error {
	conds, err := r.Conditions(ctx)
	if err != nil {
		return err
	}
	pvs, err := r.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list PersistentVolumes: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.abnormal == nil {
		r.abnormal = map[string]bool{}
	}
	for i := range pvs.Items {
		pv := &pvs.Items[i]
		if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != r.Driver || pv.Spec.ClaimRef == nil {
			continue
		}
		handle := pv.Spec.CSI.VolumeHandle
		c := conds[handle]
		was := r.abnormal[handle]
		if !c.Abnormal && !was {
			continue
		}
		pvc, err := r.Client.CoreV1().PersistentVolumeClaims(pv.Spec.ClaimRef.Namespace).Get(ctx, pv.Spec.ClaimRef.Name, metav1.GetOptions{})
		if err != nil {
			klog.FromContext(ctx).V(2).Info("Claim of an unhealthy volume not found", "pv", pv.Name, "claim", pv.Spec.ClaimRef.Name, "err", err)
			continue
		}
		switch {
		case c.Abnormal:
			r.recorder.Event(pvc, corev1.EventTypeWarning, ReasonAbnormal, c.Message)
			r.abnormal[handle] = true
		case was:
			r.recorder.Event(pvc, corev1.EventTypeNormal, ReasonNormal, "The volume's condition is normal again")
			delete(r.abnormal, handle)
		}
	}
	return nil
}
