package pvcevents

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestEventsOnTheClaim(t *testing.T) {
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-1"}, Spec: corev1.PersistentVolumeSpec{
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: "poolcsi.test", VolumeHandle: "shared.abc"}},
		ClaimRef:               &corev1.ObjectReference{Namespace: "ns", Name: "data"},
	}}
	other := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-2"}, Spec: corev1.PersistentVolumeSpec{
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: "other.driver", VolumeHandle: "shared.abc"}},
		ClaimRef:               &corev1.ObjectReference{Namespace: "ns", Name: "foreign"},
	}}
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "data", UID: "uid-1"}}
	foreign := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "foreign", UID: "uid-2"}}
	client := fake.NewClientset(pv, other, pvc, foreign)
	var abnormal atomic.Bool
	abnormal.Store(true)
	r := &Reporter{Client: client, Driver: "poolcsi.test", Conditions: func(context.Context) (map[string]Condition, error) {
		if abnormal.Load() {
			return map[string]Condition{"shared.abc": {Abnormal: true, Message: "ImageTruncated: the image is cut off"}}, nil
		}
		return nil, nil
	}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go r.Run(ctx, 50*time.Millisecond)
	waitEvent := func(reason string) corev1.Event {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			evs, err := client.CoreV1().Events("ns").List(ctx, metav1.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range evs.Items {
				if e.Reason == reason {
					return e
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Fatalf("no %s event", reason)
		return corev1.Event{}
	}
	e := waitEvent(ReasonAbnormal)
	if e.Type != corev1.EventTypeWarning || e.InvolvedObject.Kind != "PersistentVolumeClaim" || e.InvolvedObject.Name != "data" || e.Message != "ImageTruncated: the image is cut off" {
		t.Fatalf("event: %+v", e)
	}
	abnormal.Store(false)
	if e := waitEvent(ReasonNormal); e.Type != corev1.EventTypeNormal || e.InvolvedObject.Name != "data" {
		t.Fatalf("recovery event: %+v", e)
	}
	evs, _ := client.CoreV1().Events("ns").List(ctx, metav1.ListOptions{})
	for _, e := range evs.Items {
		if e.InvolvedObject.Name == "foreign" {
			t.Fatalf("event on another driver's claim: %+v", e)
		}
	}
}
