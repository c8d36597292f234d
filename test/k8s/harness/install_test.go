package harness

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// TestDefaultInstall is docs/install.md on a node prepared with nothing: the chart with its
// default values (only the images set: the harness has no registry and imports them into
// containerd), then the guide's first claim, its example StorageClass and Deployment
// applied as they are, until the pod runs with the volume mounted.
func TestDefaultInstall(t *testing.T) {
	start := time.Now()
	env := startEnv(t, cluster.EnvOptions{Defaults: true, Extra: func(t testing.TB) []cluster.Image {
		// The example's image, as the node would pull it.
		return []cluster.Image{cluster.BusyboxImage(t, "docker.io/library/busybox:1.37")}
	}})
	ctx := context.Background()
	// The guide's claim lives in the default namespace, which deleteAll leaves alone.
	t.Cleanup(func() {
		_ = env.Cluster.Client.AppsV1().Deployments("default").Delete(ctx, "poolcsi-demo", metav1.DeleteOptions{})
		_ = env.Cluster.Client.CoreV1().PersistentVolumeClaims("default").Delete(ctx, "poolcsi-demo", metav1.DeleteOptions{})
		_ = env.Cluster.Client.StorageV1().StorageClasses().Delete(ctx, "poolcsi-local-image", metav1.DeleteOptions{})
	})
	for _, f := range []string{"storageclass-local-image.yaml", "pvc-deployment.yaml"} {
		objs, err := cluster.ParseFile(filepath.Join(chart.RepoRoot(), "deploy", "examples", f))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if err := env.Cluster.Applier().Apply(ctx, o, false); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
		}
	}
	var pod string
	cluster.WaitFor(t, 120*time.Second, "the example Deployment's pod Running", func() error {
		pods, err := env.Cluster.Client.CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: "app=poolcsi-demo"})
		if err != nil {
			return err
		}
		if len(pods.Items) == 0 {
			return errors.New("no pod yet")
		}
		p := pods.Items[0]
		if p.Status.Phase != corev1.PodRunning || !cluster.PodReady(&p) {
			return fmt.Errorf("%s; events: %s", cluster.PodSummary(&p), env.Events("default", p.Name))
		}
		pod = p.Name
		return nil
	})
	pvc := env.PVC(t, "default", "poolcsi-demo")
	if pvc.Status.Phase != corev1.ClaimBound || pvc.Status.Capacity.Storage().String() != "1Gi" {
		t.Fatalf("claim: phase %s, capacity %s; want Bound, 1Gi", pvc.Status.Phase, pvc.Status.Capacity.Storage())
	}
	pv, err := env.Cluster.Client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != cluster.LocalDriver {
		t.Fatalf("PV %s is not the local driver's: %+v", pv.Name, pv.Spec.CSI)
	}
	// The container wrote its start into the volume, as its non-root user (fsGroup).
	if out := env.MustExec(t, "default", pod, "cat /data/boots && grep ' /data ' /proc/mounts"); !strings.Contains(out, " /data ") {
		t.Fatalf("/data is not a mount in the pod:\n%s", out)
	}
	// The volume is in the pool the chart made on the node's disk.
	if imgs, _ := filepath.Glob(filepath.Join(cluster.LocalPoolPath, "volumes", "*", "*.img")); len(imgs) != 1 {
		t.Fatalf("images in %s: %v, want the claim's one", cluster.LocalPoolPath, imgs)
	}
	// The guide's check: poolcsi status in the node pod exits 0.
	node, err := env.NodePodName(t)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := env.ExecIn(t, chart.Namespace, node, "poolcsi-local", "poolcsi", "status"); err != nil {
		t.Fatalf("poolcsi status in %s: %v\n%s", node, err, out)
	}
	// The default layout: the local pools' central controller took the claim, and the node
	// pod runs the local driver alone, no sidecar of its own.
	if dep, err := env.Cluster.Client.AppsV1().Deployments(chart.Namespace).Get(ctx, "poolcsi-local-controller", metav1.GetOptions{}); err != nil {
		t.Fatalf("the local controller: %v", err)
	} else if dep.Status.ReadyReplicas != 1 {
		t.Errorf("the local controller has %d replicas ready, want 1", dep.Status.ReadyReplicas)
	}
	np, err := env.Cluster.Client.CoreV1().Pods(chart.Namespace).Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range np.Spec.Containers {
		if strings.HasPrefix(c.Name, "csi-") {
			t.Errorf("the node pod runs %s: the central layout's node pod has no sidecar", c.Name)
		}
	}
	t.Logf("default install: the example pod Running %s after the test started", time.Since(start).Round(time.Second))

	// Deleting the claim deletes the volume (the driver is still there: before deleteAll).
	if err := env.Cluster.Client.AppsV1().Deployments("default").Delete(ctx, "poolcsi-demo", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := env.Cluster.Client.CoreV1().PersistentVolumeClaims("default").Delete(ctx, "poolcsi-demo", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster.WaitFor(t, 120*time.Second, "the PV deleted", func() error {
		_, err := env.Cluster.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("PV %s still there", pv.Name)
	})
}
