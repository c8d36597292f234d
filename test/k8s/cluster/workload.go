package cluster

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/poolcsi/poolcsi/hack/release/chart"
)

// ClaimSpec is a claim as the tests make them: its name, StorageClass and size, and
// what sets it apart (volume mode, access mode, a data source).
type ClaimSpec struct {
	Name, Class, Size string
	Block, RWX        bool
	DataSource        string // a VolumeSnapshot to restore
	Clone             string // a claim to clone
	ROX               bool   // ReadOnlyMany
}

// Claim creates the claim in ns.
func (e *Env) Claim(t testing.TB, ns string, c ClaimSpec) {
	t.Helper()
	if _, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), ClaimObject(ns, c), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// ClaimObject is the claim c describes, in ns.
func ClaimObject(ns string, c ClaimSpec) *corev1.PersistentVolumeClaim {
	mode := corev1.PersistentVolumeFilesystem
	if c.Block {
		mode = corev1.PersistentVolumeBlock
	}
	access := corev1.ReadWriteOnce
	if c.RWX {
		access = corev1.ReadWriteMany
	}
	if c.ROX {
		access = corev1.ReadOnlyMany
	}
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: c.Name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &c.Class, VolumeMode: &mode,
			AccessModes: []corev1.PersistentVolumeAccessMode{access},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(c.Size)}},
		}}
	if c.Clone != "" {
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: c.Clone}
	}
	if c.DataSource != "" {
		group := "snapshot.storage.k8s.io"
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: c.DataSource}
	}
	return pvc
}

// PodSpec is a busybox pod as the tests run them, sleeping, with its volumes.
type PodSpec struct {
	Name     string
	Claims   []string // mounted at /data, /data2...; block claims appear at /dev/xvda...
	Block    bool
	ReadOnly bool
	HostPath string // a hostPath volume at /data instead
	Node     string // the node it must run on (its kubernetes.io/hostname)
}

// Pod runs busybox sleeping, with the claims, and waits until it is Running.
func (e *Env) Pod(t testing.TB, ns string, p PodSpec) *corev1.Pod {
	t.Helper()
	if _, err := e.Cluster.Client.CoreV1().Pods(ns).Create(context.Background(), PodObject(ns, p), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return e.WaitRunning(t, ns, p.Name)
}

// PodObject is the pod p describes, in ns: busybox sleeping, with p's volumes.
func PodObject(ns string, p PodSpec) *corev1.Pod {
	grace := int64(1)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: ns},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "c", Image: BusyboxRef, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sleep", "100000"}}},
		}}
	if p.Node != "" {
		pod.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": p.Node}
	}
	c := &pod.Spec.Containers[0]
	if p.HostPath != "" {
		dirOrCreate := corev1.HostPathDirectoryOrCreate
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "h", VolumeSource: corev1.VolumeSource{
			HostPath: &corev1.HostPathVolumeSource{Path: p.HostPath, Type: &dirOrCreate}}})
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "h", MountPath: "/data"})
	}
	for i, cl := range p.Claims {
		vol := fmt.Sprintf("v%d", i)
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: vol, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: cl, ReadOnly: p.ReadOnly}}})
		if p.Block {
			c.VolumeDevices = append(c.VolumeDevices, corev1.VolumeDevice{Name: vol, DevicePath: fmt.Sprintf("/dev/xvd%c", 'a'+i)})
			continue
		}
		path := "/data"
		if i > 0 {
			path = fmt.Sprintf("/data%d", i+1)
		}
		c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: vol, MountPath: path, ReadOnly: p.ReadOnly})
	}
	return pod
}

// WaitRunning waits until the pod is Running and Ready.
func (e *Env) WaitRunning(t testing.TB, ns, name string) *corev1.Pod {
	t.Helper()
	return e.WaitPodOn(t, ns, name, "", "")
}

// PVC reads a claim.
func (e *Env) PVC(t testing.TB, ns, name string) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

// Resize asks for a bigger claim.
func (e *Env) Resize(t testing.TB, ns, name, size string) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size)
	if _, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// WaitCapacity waits for the claim's status.capacity to reach size.
func (e *Env) WaitCapacity(t testing.TB, ns, name, size string, timeout time.Duration) {
	t.Helper()
	want := resource.MustParse(size)
	WaitFor(t, timeout, "claim "+ns+"/"+name+" status.capacity "+size, func() error {
		pvc := e.PVC(t, ns, name)
		got := pvc.Status.Capacity[corev1.ResourceStorage]
		if got.Cmp(want) < 0 {
			return fmt.Errorf("capacity %s, conditions %+v", got.String(), pvc.Status.Conditions)
		}
		return nil
	})
}

// DfBytes is the size in bytes of the filesystem at path in the pod.
func (e *Env) DfBytes(t testing.TB, ns, pod, path string) int64 {
	t.Helper()
	out := e.MustExec(t, ns, pod, "df -k "+path+" | tail -1")
	f := strings.Fields(out)
	if len(f) < 2 {
		t.Fatalf("df -k %s: %q", path, out)
	}
	kb, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		t.Fatalf("df -k %s: %q", path, out)
	}
	return kb << 10
}

// KubeletMetrics reads kubelet's /metrics through the API server's node proxy.
func (e *Env) KubeletMetrics(t testing.TB) string {
	t.Helper()
	b, err := e.Cluster.Client.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes/" + e.Node.Name + "/proxy/metrics").DoRaw(context.Background())
	if err != nil {
		t.Fatalf("kubelet /metrics: %v", err)
	}
	return string(b)
}

// VolumeMetric returns a kubelet_volume_stats_* sample for a claim, or false.
func VolumeMetric(metrics, name, ns, claim string) (float64, bool) {
	for _, line := range strings.Split(metrics, "\n") {
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		if !strings.Contains(line, `namespace="`+ns+`"`) || !strings.Contains(line, `persistentvolumeclaim="`+claim+`"`) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, false
		}
		return v, true
	}
	return 0, false
}

// VolumeHandle returns the CSI volume handle of a bound claim.
func (e *Env) VolumeHandle(t testing.TB, ns, claim string) string {
	t.Helper()
	var handle string
	WaitFor(t, 60*time.Second, "claim "+ns+"/"+claim+" bound", func() error {
		pvc := e.PVC(t, ns, claim)
		if pvc.Spec.VolumeName == "" {
			return fmt.Errorf("not bound")
		}
		pv, err := e.Cluster.Client.CoreV1().PersistentVolumes().Get(context.Background(), pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		handle = pv.Spec.CSI.VolumeHandle
		return nil
	})
	return handle
}

// WaitMetric waits until kubelet exports want for the claim.
func (e *Env) WaitMetric(t testing.TB, name, ns, claim string, timeout time.Duration, ok func(float64) bool) float64 {
	t.Helper()
	var v float64
	WaitFor(t, timeout, name+" of "+ns+"/"+claim, func() error {
		var found bool
		v, found = VolumeMetric(e.KubeletMetrics(t), name, ns, claim)
		if !found {
			return fmt.Errorf("not exported")
		}
		if !ok(v) {
			return fmt.Errorf("value %v", v)
		}
		return nil
	})
	return v
}

// WaitEvent waits for an event of that reason on the object (kind, name).
func (e *Env) WaitEvent(t testing.TB, ns, kind, name, reason string, timeout time.Duration) string {
	t.Helper()
	return e.WaitEventOf(t, ns, kind, name, "", reason, timeout)
}

// WaitEventOf is WaitEvent on the object of that UID ("": any of that name), where an
// object of the same name came before it (a StatefulSet's pod replaced) and had events.
func (e *Env) WaitEventOf(t testing.TB, ns, kind, name, uid, reason string, timeout time.Duration) string {
	t.Helper()
	var msg string
	sel := "involvedObject.kind=" + kind + ",involvedObject.name=" + name
	if uid != "" {
		sel += ",involvedObject.uid=" + uid
	}
	WaitFor(t, timeout, reason+" event on "+kind+" "+ns+"/"+name, func() error {
		evs, err := e.Cluster.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return err
		}
		for _, ev := range evs.Items {
			if ev.Reason == reason {
				msg = ev.Type + ": " + ev.Message
				return nil
			}
		}
		return fmt.Errorf("none among %d events", len(evs.Items))
	})
	return msg
}

// NodePodName is the node DaemonSet's pod that is not being deleted.
func (e *Env) NodePodName(t testing.TB) (string, error) {
	t.Helper()
	pods, err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=node"})
	if err != nil {
		return "", err
	}
	var names []string
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			names = append(names, p.Name)
		}
	}
	if len(names) != 1 {
		return "", fmt.Errorf("node pods %v", names)
	}
	return names[0], nil
}

// RestartNodePod deletes the node DaemonSet's pod and waits until its replacement serves.
func (e *Env) RestartNodePod(t testing.TB) {
	t.Helper()
	old, err := e.NodePodName(t)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Cluster.Client.CoreV1().Pods(chart.Namespace).Delete(context.Background(), old, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	WaitFor(t, 120*time.Second, "a new node pod", func() error {
		n, err := e.NodePodName(t)
		if err == nil && n == old {
			return fmt.Errorf("still %s", n)
		}
		return err
	})
	e.WaitChartReady(t)
}

// GetPod reads a pod.
func (e *Env) GetPod(t testing.TB, ns, name string) *corev1.Pod {
	t.Helper()
	p, err := e.Cluster.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// WaitPodOn waits until the pod is Running and Ready, is not the pod of UID notUID (the
// one it replaces), and, if node is set, runs there.
func (e *Env) WaitPodOn(t testing.TB, ns, name, notUID, node string) *corev1.Pod {
	t.Helper()
	var got *corev1.Pod
	WaitFor(t, 240*time.Second, fmt.Sprintf("pod %s/%s Running (on %q)", ns, name, node), func() error {
		var err error
		got, err = e.Cluster.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		switch {
		case string(got.UID) == notUID:
			return fmt.Errorf("still the pod it replaces (on %s, %s)", got.Spec.NodeName, PodSummary(got))
		case got.Status.Phase != corev1.PodRunning || !PodReady(got):
			return fmt.Errorf("on %q: %s%s", got.Spec.NodeName, PodSummary(got), e.Events(ns, name))
		case node != "" && got.Spec.NodeName != node:
			return fmt.Errorf("on %s", got.Spec.NodeName)
		}
		return nil
	})
	return got
}
