package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// kubeletEnv is the environment of cluster.StartEnv with the scenarios' own helpers.
type kubeletEnv struct{ *cluster.Env }

// startKubeletEnv brings up the control plane, a real node and the chart, rendered with
// image overrides only and applied as it is; it returns once both drivers are registered
// with kubelet.
func startKubeletEnv(t testing.TB) *kubeletEnv {
	t.Helper()
	return startKubeletEnvWith(t, nil, nil)
}

// startKubeletEnvWith is startKubeletEnv with more images to import and chart values set
// beside the image overrides (top-level keys).
func startKubeletEnvWith(t testing.TB, extra func(testing.TB) []cluster.Image, values map[string]any) *kubeletEnv {
	t.Helper()
	return startEnv(t, cluster.EnvOptions{Extra: extra, Values: values})
}

// startEnv is startKubeletEnv with options.
func startEnv(t testing.TB, opts cluster.EnvOptions) *kubeletEnv {
	t.Helper()
	return &kubeletEnv{cluster.StartEnv(t, opts)}
}

// storageClasses are what a user of the chart writes: one per filesystem for the local
// driver, dir and image layouts for the shared one.
func (e *kubeletEnv) storageClasses(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	wffc, immediate := storagev1.VolumeBindingWaitForFirstConsumer, storagev1.VolumeBindingImmediate
	expand, del := true, corev1.PersistentVolumeReclaimDelete
	for _, sc := range []storagev1.StorageClass{
		{ObjectMeta: metav1.ObjectMeta{Name: "local-xfs"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-btrfs"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "btrfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-ext4"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &wffc,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "ext4"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "local-immediate"}, Provisioner: cluster.LocalDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "local", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-dir"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "dir"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "share-bind"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"shareType": "bind", "shareSource": cluster.ShareSource, "layout": "dir"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-xfs"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "image", "csi.storage.k8s.io/fstype": "xfs"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "shared-ext4"}, Provisioner: cluster.SharedDriver, VolumeBindingMode: &immediate,
			Parameters: map[string]string{"pool": "shared", "layout": "image", "csi.storage.k8s.io/fstype": "ext4"}},
	} {
		sc.AllowVolumeExpansion, sc.ReclaimPolicy = &expand, &del
		if _, err := e.Cluster.Client.StorageV1().StorageClasses().Create(ctx, &sc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	vsc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
		"metadata": map[string]any{"name": "shared"}, "driver": cluster.SharedDriver, "deletionPolicy": "Delete"}}
	if err := e.Cluster.Applier().Apply(ctx, vsc, false); err != nil {
		t.Fatal(err)
	}
}

const writeBlob = "dd if=/dev/urandom of=/data/blob bs=1M count=4 2>/dev/null && sync && md5sum /data/blob | cut -d' ' -f1"

// blobPod creates the namespace name with the claims, starts pod "p" with them all (the
// first at /data) and writes writeBlob there: how the cases that check data survive
// something begin. It returns the namespace and the blob's md5 sum.
func (e *kubeletEnv) blobPod(t testing.TB, name string, claims ...cluster.ClaimSpec) (ns, written string) {
	t.Helper()
	ns = e.Namespace(t, name)
	var names []string
	for _, c := range claims {
		e.Claim(t, ns, c)
		names = append(names, c.Name)
	}
	e.Pod(t, ns, cluster.PodSpec{Name: "p", Claims: names})
	return ns, strings.TrimSpace(e.MustExec(t, ns, "p", writeBlob))
}

// TestKubelet drives poolcsi through a real kubelet, with the chart running as pods.
func TestKubelet(t *testing.T) {
	// The chart's default layout: the local pools' central controller, whose csi-snapshotter
	// takes the local snapshots (snapshots.enabled, on by default) with a snapshot-controller
	// that is not distributed; the local group snapshot case needs them.
	env := startKubeletEnvWith(t, nil, map[string]any{"snapshots": map[string]any{"enabled": true}})
	env.storageClasses(t)

	// Both driver names of the chart: data written in one pod is there, bit for bit, in
	// the next one.
	for _, tc := range []struct{ driver, class string }{{cluster.LocalDriver, "local-xfs"}, {cluster.SharedDriver, "shared-dir"}} {
		t.Run("data survives the pod/"+tc.driver, func(t *testing.T) {
			ns := env.Namespace(t, "data-"+tc.class)
			env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: tc.class, Size: "300Mi"})
			env.Pod(t, ns, cluster.PodSpec{Name: "writer", Claims: []string{"c"}})
			sum := strings.TrimSpace(env.MustExec(t, ns, "writer", writeBlob))
			env.DeletePod(t, ns, "writer")
			env.Pod(t, ns, cluster.PodSpec{Name: "reader", Claims: []string{"c"}})
			if got := strings.TrimSpace(env.MustExec(t, ns, "reader", "md5sum /data/blob | cut -d' ' -f1")); got != sum {
				t.Fatalf("data changed between pods: wrote %s, read %s", sum, got)
			}
		})
	}
	kubeletCases(t, env)
	kubeletFeatures(t, env)
}

// imagePath is the backing image of an image volume in a pool on this machine.
func imagePath(t testing.TB, poolPath, handle string) string {
	t.Helper()
	m := handleRE.FindStringSubmatch(handle)
	if m == nil {
		t.Fatalf("volume handle %q", handle)
	}
	hits, _ := filepath.Glob(filepath.Join(poolPath, "volumes", "*"+m[2]+"*", "disk.img"))
	if len(hits) != 1 {
		t.Fatalf("image of %s in %s: %v", handle, poolPath, hits)
	}
	return hits[0]
}

func sum(t testing.TB, env *kubeletEnv, ns, pod, path string) string {
	t.Helper()
	return strings.TrimSpace(env.MustExec(t, ns, pod, "md5sum "+path+" | cut -d' ' -f1"))
}

// kubeletCases are the rest of the kubelet issue's cases, on the environment of TestKubelet.
func kubeletCases(t *testing.T, env *kubeletEnv) {
	ctx := context.Background()

	t.Run("RWX dir volume in two pods", func(t *testing.T) {
		ns := env.Namespace(t, "rwx")
		env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "shared-dir", Size: "100Mi", RWX: true})
		env.Pod(t, ns, cluster.PodSpec{Name: "a", Claims: []string{"c"}})
		env.Pod(t, ns, cluster.PodSpec{Name: "b", Claims: []string{"c"}})
		env.MustExec(t, ns, "a", "echo from-a > /data/a")
		env.MustExec(t, ns, "b", "echo from-b > /data/b")
		if got := env.MustExec(t, ns, "b", "cat /data/a") + env.MustExec(t, ns, "a", "cat /data/b"); got != "from-a\nfrom-b\n" {
			t.Fatalf("the two pods do not see each other's writes: %q", got)
		}
	})

	t.Run("local claim of an Immediate class", func(t *testing.T) {
		// No pod yet: the local controller's provisioner (--immediate-topology) has the
		// claim made on a node with room, and the pod then goes where the volume is.
		ns := env.Namespace(t, "immediate")
		env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "local-immediate", Size: "300Mi"})
		cluster.WaitFor(t, 2*time.Minute, "claim "+ns+"/c of an Immediate local class bound without a pod", func() error {
			if pvc := env.PVC(t, ns, "c"); pvc.Status.Phase != corev1.ClaimBound {
				return fmt.Errorf("phase %s; events: %s", pvc.Status.Phase, env.Events(ns, "c"))
			}
			return nil
		})
		env.Pod(t, ns, cluster.PodSpec{Name: "p", Claims: []string{"c"}})
		if got := env.MustExec(t, ns, "p", "echo ok > /data/x && cat /data/x"); got != "ok\n" {
			t.Fatalf("read back %q", got)
		}
	})

	t.Run("read-only pod mount", func(t *testing.T) {
		ns := env.Namespace(t, "readonly")
		env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "local-xfs", Size: "300Mi"})
		env.Pod(t, ns, cluster.PodSpec{Name: "w", Claims: []string{"c"}})
		want := strings.TrimSpace(env.MustExec(t, ns, "w", writeBlob))
		env.DeletePod(t, ns, "w")
		env.Pod(t, ns, cluster.PodSpec{Name: "r", Claims: []string{"c"}, ReadOnly: true})
		if got := sum(t, env, ns, "r", "/data/blob"); got != want {
			t.Fatalf("read-only pod reads %s, wrote %s", got, want)
		}
		if out, err := env.Exec(t, ns, "r", "touch /data/x"); err == nil || !strings.Contains(err.Error()+out, "Read-only file system") {
			t.Fatalf("a write in a read-only pod mount: err %v, output %q", err, out)
		}
	})

	t.Run("block claim through volumeDevices", func(t *testing.T) {
		ns := env.Namespace(t, "block")
		env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "local-xfs", Size: "64Mi", Block: true})
		env.Pod(t, ns, cluster.PodSpec{Name: "w", Claims: []string{"c"}, Block: true})
		size := strings.TrimSpace(env.MustExec(t, ns, "w", "blockdev --getsize64 /dev/xvda"))
		if size != strconv.Itoa(64<<20) {
			t.Fatalf("block device of a 64Mi claim is %s bytes", size)
		}
		want := strings.TrimSpace(env.MustExec(t, ns, "w", "dd if=/dev/urandom of=/tmp/b bs=1M count=8 2>/dev/null && dd if=/tmp/b of=/dev/xvda bs=1M conv=fsync 2>/dev/null && md5sum /tmp/b | cut -d' ' -f1"))
		env.DeletePod(t, ns, "w")
		env.Pod(t, ns, cluster.PodSpec{Name: "r", Claims: []string{"c"}, Block: true})
		if got := strings.TrimSpace(env.MustExec(t, ns, "r", "dd if=/dev/xvda bs=1M count=8 2>/dev/null | md5sum | cut -d' ' -f1")); got != want {
			t.Fatalf("block data: wrote %s, read %s", want, got)
		}
	})

	t.Run("kubelet_volume_stats", func(t *testing.T) {
		ns := env.Namespace(t, "stats")
		env.Claim(t, ns, cluster.ClaimSpec{Name: "img", Class: "local-xfs", Size: "300Mi"})
		env.Claim(t, ns, cluster.ClaimSpec{Name: "dir", Class: "shared-dir", Size: "100Mi"})
		env.Claim(t, ns, cluster.ClaimSpec{Name: "blk", Class: "local-xfs", Size: "64Mi", Block: true})
		env.Pod(t, ns, cluster.PodSpec{Name: "fs", Claims: []string{"img", "dir"}})
		env.Pod(t, ns, cluster.PodSpec{Name: "bd", Claims: []string{"blk"}, Block: true})
		env.MustExec(t, ns, "fs", "dd if=/dev/zero of=/data/f bs=1M count=20 && dd if=/dev/zero of=/data2/f bs=1M count=10 && sync")
		for _, c := range []struct{ claim, path string }{{"img", "/data"}, {"dir", "/data2"}} {
			df := env.DfBytes(t, ns, "fs", c.path)
			got := env.WaitMetric(t, "kubelet_volume_stats_capacity_bytes", ns, c.claim, 90*time.Second, func(v float64) bool { return v > 0 })
			// df in the pod shows a btrfs dir volume's whole pool: statfs knows no qgroups.
			if c.claim == "img" && int64(got) != df {
				t.Errorf("%s: kubelet_volume_stats_capacity_bytes %v, df in the pod %d", c.claim, got, df)
			}
			used := env.WaitMetric(t, "kubelet_volume_stats_used_bytes", ns, c.claim, 60*time.Second, func(v float64) bool { return v >= 10<<20 })
			t.Logf("%s: capacity %v bytes (df %d), used %v", c.claim, got, df, used)
		}
		// A dir volume's numbers are its quota's, not the pool filesystem's.
		if got, _ := cluster.VolumeMetric(env.KubeletMetrics(t), "kubelet_volume_stats_capacity_bytes", ns, "dir"); got != 100<<20 {
			t.Errorf("dir: kubelet_volume_stats_capacity_bytes %v, want the claim's 100Mi", got)
		}
		got := env.WaitMetric(t, "kubelet_volume_stats_capacity_bytes", ns, "blk", 90*time.Second, func(v float64) bool { return v > 0 })
		if got != 64<<20 {
			t.Errorf("blk: kubelet_volume_stats_capacity_bytes %v, want %d", got, 64<<20)
		}
	})

	for _, fs := range []string{"xfs", "btrfs"} {
		t.Run("online expansion/"+fs, func(t *testing.T) {
			ns, want := env.blobPod(t, "grow-"+fs, cluster.ClaimSpec{Name: "c", Class: "local-" + fs, Size: "300Mi"})
			before := env.DfBytes(t, ns, "p", "/data")
			env.Resize(t, ns, "c", "600Mi")
			env.WaitCapacity(t, ns, "c", "600Mi", 150*time.Second)
			cluster.WaitFor(t, 60*time.Second, "the pod's filesystem grown", func() error {
				if after := env.DfBytes(t, ns, "p", "/data"); after < before+250<<20 {
					return fmt.Errorf("df %d bytes, was %d", after, before)
				}
				return nil
			})
			if got := sum(t, env, ns, "p", "/data/blob"); got != want {
				t.Fatalf("data after growth: %s, wrote %s", got, want)
			}
		})
	}

	// Offline: the claim grows while no pod uses it, and the filesystem grows at the next
	// stage, before it is mounted (e2fsck + resize2fs). The shared driver's controller grows
	// the image at once; the local driver (--expand-on-node) grows its image only in
	// NodeExpandVolume, which kubelet calls with the filesystem mounted, so a local ext4
	// claim always grows online, which needs CAP_SYS_RESOURCE (production nodes have it,
	// this machine does not: docs/testing.md).
	t.Run("offline expansion/ext4", func(t *testing.T) {
		ns, want := env.blobPod(t, "grow-ext4", cluster.ClaimSpec{Name: "c", Class: "shared-ext4", Size: "200Mi"})
		before := env.DfBytes(t, ns, "p", "/data")
		env.DeletePod(t, ns, "p")
		env.Resize(t, ns, "c", "400Mi")
		// The resizer grows the volume and leaves the filesystem to the next mount.
		cluster.WaitFor(t, 120*time.Second, "the claim waiting for a pod to finish its growth", func() error {
			pvc := env.PVC(t, ns, "c")
			for _, c := range pvc.Status.Conditions {
				if c.Type == corev1.PersistentVolumeClaimFileSystemResizePending {
					return nil
				}
			}
			return fmt.Errorf("conditions %+v, capacity %v", pvc.Status.Conditions, pvc.Status.Capacity)
		})
		env.Pod(t, ns, cluster.PodSpec{Name: "q", Claims: []string{"c"}})
		env.WaitCapacity(t, ns, "c", "400Mi", 120*time.Second)
		if after := env.DfBytes(t, ns, "q", "/data"); after < before+150<<20 {
			t.Fatalf("df in the new pod %d bytes, before %d", after, before)
		}
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("data after growth: %s, wrote %s", got, want)
		}
	})

	t.Run("driver pod restarted under a running pod", func(t *testing.T) {
		ns, want := env.blobPod(t, "driver-restart", cluster.ClaimSpec{Name: "c", Class: "local-xfs", Size: "300Mi"},
			cluster.ClaimSpec{Name: "d", Class: "shared-dir", Size: "100Mi"})
		env.RestartNodePod(t)
		if got := sum(t, env, ns, "p", "/data/blob"); got != want {
			t.Fatalf("after the driver restart the pod reads %s, wrote %s", got, want)
		}
		env.MustExec(t, ns, "p", "echo after > /data/after && echo after > /data2/after && sync")
		env.DeletePod(t, ns, "p")
		env.Pod(t, ns, cluster.PodSpec{Name: "q", Claims: []string{"c", "d"}})
		if got := env.MustExec(t, ns, "q", "cat /data/after /data2/after"); got != "after\nafter\n" {
			t.Fatalf("writes after the restart: %q", got)
		}
	})

	t.Run("kubelet restarted under a running pod", func(t *testing.T) {
		ns, want := env.blobPod(t, "kubelet-restart", cluster.ClaimSpec{Name: "c", Class: "local-xfs", Size: "300Mi"})
		env.Node.RestartKubelet(t)
		time.Sleep(5 * time.Second)
		env.WaitRunning(t, ns, "p")
		if got := sum(t, env, ns, "p", "/data/blob"); got != want {
			t.Fatalf("after the kubelet restart the pod reads %s, wrote %s", got, want)
		}
		env.DeletePod(t, ns, "p")
		env.Pod(t, ns, cluster.PodSpec{Name: "q", Claims: []string{"c"}})
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("next pod reads %s, wrote %s", got, want)
		}
	})

	t.Run("snapshot restored into a new claim", func(t *testing.T) {
		ns, want := env.blobPod(t, "snapshot", cluster.ClaimSpec{Name: "src", Class: "shared-xfs", Size: "300Mi"})
		snap := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
			"metadata": map[string]any{"name": "snap", "namespace": ns},
			"spec":     map[string]any{"volumeSnapshotClassName": "shared", "source": map[string]any{"persistentVolumeClaimName": "src"}}}}
		if err := env.Cluster.Applier().Apply(ctx, snap, false); err != nil {
			t.Fatal(err)
		}
		env.Claim(t, ns, cluster.ClaimSpec{Name: "restored", Class: "shared-xfs", Size: "300Mi", DataSource: "snap"})
		env.Pod(t, ns, cluster.PodSpec{Name: "q", Claims: []string{"restored"}})
		if got := sum(t, env, ns, "q", "/data/blob"); got != want {
			t.Fatalf("restored claim reads %s, source had %s", got, want)
		}
	})

	t.Run("volume health reaches kubelet and the claim", func(t *testing.T) {
		ns := env.Namespace(t, "health")
		env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "shared-xfs", Size: "300Mi"})
		env.Pod(t, ns, cluster.PodSpec{Name: "p", Claims: []string{"c"}})
		handle := env.VolumeHandle(t, ns, "c")
		env.WaitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })

		// Filled past the 90 % threshold: abnormal for kubelet, a Warning on the pod.
		out := env.MustExec(t, ns, "p", "set -e; s=$(df -k /data | tail -1); total=$(echo $s | cut -d' ' -f2); used=$(echo $s | cut -d' ' -f3); "+
			"n=$(( (total*93/100 - used) / 1024 )); dd if=/dev/zero of=/data/fill bs=1M count=$n 2>&1 | tail -1; sync; df -k /data | tail -1")
		t.Logf("filled: %s", strings.TrimSpace(out))
		env.WaitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 1 })
		t.Logf("pod event: %s", env.WaitEvent(t, ns, "Pod", "p", "VolumeConditionAbnormal", 60*time.Second))
		env.MustExec(t, ns, "p", "rm /data/fill && sync")
		env.WaitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })

		// The backing image cut short on the pool: the controller sees it and puts an event
		// on the claim; the node too. Grown back: normal again.
		img := imagePath(t, cluster.SharedPoolPath, handle)
		st, err := os.Stat(img)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(img, st.Size()-(1<<20)); err != nil {
			t.Fatal(err)
		}
		t.Logf("claim event: %s", env.WaitEvent(t, ns, "PersistentVolumeClaim", "c", "VolumeConditionAbnormal", 150*time.Second))
		env.WaitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 1 })
		if err := os.Truncate(img, st.Size()); err != nil {
			t.Fatal(err)
		}
		env.WaitMetric(t, "kubelet_volume_stats_health_status_abnormal", ns, "c", 90*time.Second, func(v float64) bool { return v == 0 })
	})

	t.Run("StorageClass naming a share", func(t *testing.T) {
		// No pool is configured for the share source: the controller mounts it, lays out a pool
		// there at the first CreateVolume, and the node plugin mounts it on demand at
		// NodeStageVolume, under the chart's shares.hostDir.
		if err := os.MkdirAll(cluster.ShareSource, 0o755); err != nil {
			t.Fatal(err)
		}
		ns := env.Namespace(t, "share")
		env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "share-bind", Size: "100Mi", RWX: true})
		env.Pod(t, ns, cluster.PodSpec{Name: "w", Claims: []string{"c"}})
		want := strings.TrimSpace(env.MustExec(t, ns, "w", writeBlob))
		if _, err := os.Stat(filepath.Join(cluster.ShareSource, "pool.json")); err != nil {
			t.Fatalf("the driver laid out no pool on the share: %v", err)
		}
		if len(cluster.MountsUnder(cluster.SharesDir)) < 2 { // the shares directory itself, and the share below it
			t.Errorf("the node plugin's mount of the share is not under %s on the host", cluster.SharesDir)
		}
		env.DeletePod(t, ns, "w")
		env.Pod(t, ns, cluster.PodSpec{Name: "r", Claims: []string{"c"}})
		if got := sum(t, env, ns, "r", "/data/blob"); got != want {
			t.Fatalf("data on the share: wrote %s, read %s", want, got)
		}
	})

	t.Run("every claim deleted leaves nothing behind", func(t *testing.T) {
		env.DeleteAll(t)
		for _, m := range cluster.MountsUnder(cluster.KubeletDir) {
			if strings.Contains(m, "kubernetes.io~csi") || strings.Contains(m, "/plugins/kubernetes.io/csi/") {
				t.Errorf("a CSI mount is left: %s", m)
			}
		}
		for _, line := range cluster.OurLoops(cluster.KubeletDir, cluster.LocalPoolPath, cluster.SharedPoolPath) {
			t.Errorf("a loop device is left: %s", line)
		}
		for _, p := range []string{cluster.LocalPoolPath, cluster.SharedPoolPath, cluster.ShareSource} {
			entries, _ := os.ReadDir(filepath.Join(p, "volumes"))
			for _, e := range entries {
				t.Errorf("pool %s still holds volume %s", p, e.Name())
			}
		}
	})
}
