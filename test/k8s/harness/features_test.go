package harness

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
)

var (
	vgsGVR = schema.GroupVersionResource{Group: "groupsnapshot.storage.k8s.io", Version: "v1", Resource: "volumegroupsnapshots"}
)

// kubeletFeatures are issue 25's features through kubelet and the released sidecars:
// VolumeAttributesClass (csi-resizer's modify controller, the node's cgroup limits),
// group snapshots (snapshot-controller and csi-snapshotter v8.7) and CSI ephemeral
// inline volumes (kubelet alone).
func kubeletFeatures(t *testing.T, env *kubeletEnv) {
	t.Run("VolumeAttributesClass limits a running pod's I/O and a change reaches it", func(t *testing.T) {
		ns := env.Namespace(t, "vac")
		env.volumeAttributesClass(t, "vac-slow", cluster.SharedDriver, map[string]string{"writeBytesPerSecond": "4Mi", "readIOPS": "300"})
		env.volumeAttributesClass(t, "vac-fast", cluster.SharedDriver, map[string]string{"writeBytesPerSecond": "16Mi", "readIOPS": "0"})
		pvc := cluster.ClaimObject(ns, cluster.ClaimSpec{Name: "c", Class: "shared-xfs", Size: "300Mi"})
		slow := "vac-slow"
		pvc.Spec.VolumeAttributesClassName = &slow
		if _, err := env.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), pvc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		p := env.Pod(t, ns, cluster.PodSpec{Name: "p", Claims: []string{"c"}})
		env.waitThrottle(t, p, "blkio.throttle.write_bps_device", 4<<20)
		env.waitThrottle(t, p, "blkio.throttle.read_iops_device", 300)

		env.patchClaim(t, ns, "c", `{"spec":{"volumeAttributesClassName":"vac-fast"}}`)
		cluster.WaitFor(t, 2*time.Minute, "claim "+ns+"/c modified to vac-fast", func() error {
			got := env.PVC(t, ns, "c")
			if cur := got.Status.CurrentVolumeAttributesClassName; cur == nil || *cur != "vac-fast" {
				return fmt.Errorf("current class %v, modify status %+v; events: %s", cur, got.Status.ModifyVolumeStatus, env.Events(ns, "c"))
			}
			return nil
		})
		// The same pod, not restarted: the node applies the new record on its next pass.
		env.waitThrottle(t, p, "blkio.throttle.write_bps_device", 16<<20)
		env.waitThrottle(t, p, "blkio.throttle.read_iops_device", 0)
		if got := env.PVC(t, ns, "c"); got.Status.ModifyVolumeStatus != nil {
			t.Fatalf("modify status left on the claim: %+v", got.Status.ModifyVolumeStatus)
		}

		// A node plugin restarted (an upgrade) finds the running pod again from its mounts:
		// a class changed after the restart still reaches it.
		env.RestartNodePod(t)
		env.patchClaim(t, ns, "c", `{"spec":{"volumeAttributesClassName":"vac-slow"}}`)
		env.waitThrottle(t, p, "blkio.throttle.write_bps_device", 4<<20)
		env.waitThrottle(t, p, "blkio.throttle.read_iops_device", 300)

		// An unknown parameter: the modification is Infeasible, the volume keeps its class.
		env.volumeAttributesClass(t, "vac-bogus", cluster.SharedDriver, map[string]string{"writeBPS": "1Mi"})
		env.patchClaim(t, ns, "c", `{"spec":{"volumeAttributesClassName":"vac-bogus"}}`)
		cluster.WaitFor(t, 2*time.Minute, "claim "+ns+"/c modification Infeasible", func() error {
			got := env.PVC(t, ns, "c")
			if s := got.Status.ModifyVolumeStatus; s == nil || s.Status != corev1.PersistentVolumeClaimModifyVolumeInfeasible {
				return fmt.Errorf("modify status %+v", s)
			}
			return nil
		})
		if cur := env.PVC(t, ns, "c").Status.CurrentVolumeAttributesClassName; cur == nil || *cur != "vac-slow" {
			t.Fatalf("after an Infeasible class the claim's current class is %v, want vac-slow", cur)
		}
		env.waitThrottle(t, p, "blkio.throttle.write_bps_device", 4<<20)
	})

	t.Run("VolumeAttributesClass preallocates the image", func(t *testing.T) {
		ns := env.Namespace(t, "vac-prealloc")
		env.volumeAttributesClass(t, "vac-guaranteed", cluster.SharedDriver, map[string]string{"preallocate": "true"})
		env.Claim(t, ns, cluster.ClaimSpec{Name: "c", Class: "shared-ext4", Size: "256Mi"})
		handle := env.VolumeHandle(t, ns, "c")
		img := imagePath(t, cluster.SharedPoolPath, handle)
		if a := allocated(t, img); a >= 256<<20 {
			t.Fatalf("a new image has %d bytes allocated: not sparse", a)
		}
		env.patchClaim(t, ns, "c", `{"spec":{"volumeAttributesClassName":"vac-guaranteed"}}`)
		cluster.WaitFor(t, 2*time.Minute, "claim "+ns+"/c preallocated", func() error {
			if a := allocated(t, img); a < 256<<20 {
				return fmt.Errorf("%d of %d bytes allocated; events: %s", a, 256<<20, env.Events(ns, "c"))
			}
			return nil
		})
	})

	// Shared: the controller asks the writer's node to freeze (freeze inboxes); local: the
	// local controller's csi-snapshotter takes it (the chart's default layout), with a class
	// of no node, and the node's agent freezes in place.
	for _, g := range []groupCase{
		{driver: cluster.SharedDriver, class: "shared-group", data: "shared-xfs", wal: "shared-ext4"},
		{driver: cluster.LocalDriver, class: "local-group", data: "local-xfs", wal: "local-ext4"},
	} {
		t.Run("group snapshot restores data and WAL to one point in time/"+g.driver, func(t *testing.T) {
			groupSnapshotOneInstant(t, env, g)
		})
	}

	t.Run("ephemeral inline volume lives and dies with its pod", func(t *testing.T) {
		ctx := context.Background()
		ns := env.Namespace(t, "inline")
		before := poolVolumes(t, cluster.LocalPoolPath)
		pod := cluster.PodObject(ns, cluster.PodSpec{Name: "p"})
		pod.Spec.Volumes = []corev1.Volume{{Name: "scratch", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
			Driver: cluster.LocalDriver, VolumeAttributes: map[string]string{"size": "64Mi", "fsType": "ext4"}}}}}
		pod.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "scratch", MountPath: "/data"}}
		if _, err := env.Cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		env.WaitRunning(t, ns, "p")
		if size := env.DfBytes(t, ns, "p", "/data"); size <= 0 || size > 64<<20 {
			t.Fatalf("an inline volume of 64Mi shows %d bytes", size)
		}
		env.MustExec(t, ns, "p", writeBlob)
		if got := poolVolumes(t, cluster.LocalPoolPath); len(got) != len(before)+1 {
			t.Fatalf("pool volumes with the pod running: %v, before: %v", got, before)
		}
		env.DeletePod(t, ns, "p")
		cluster.WaitFor(t, 60*time.Second, "the inline volume removed from the pool", func() error {
			if got := poolVolumes(t, cluster.LocalPoolPath); len(got) != len(before) {
				return fmt.Errorf("pool volumes %v, before %v", got, before)
			}
			return nil
		})
	})
}

// groupCase is one driver's group snapshot through kubelet: its VolumeGroupSnapshotClass
// and the storage classes of the data and WAL claims.
type groupCase struct {
	driver, class, data, wal string
	node                     string // the node every pod runs on ("": the scheduler's choice)
	chartClass               bool   // the chart made the class (else the case makes it)
	perNode                  bool   // the local driver's per-node layout (localController.central false)
}

// groupSnapshotOneInstant: a writer appends to a data log and then a WAL without pause; a
// VolumeGroupSnapshot of both claims, restored, ends the two at one point in time.
func groupSnapshotOneInstant(t *testing.T, env *kubeletEnv, g groupCase) {
	ctx := context.Background()
	ns := env.Namespace(t, "group-"+g.class)
	for _, c := range []cluster.ClaimSpec{{Name: "data", Class: g.data, Size: "300Mi"}, {Name: "wal", Class: g.wal, Size: "300Mi"}} {
		pvc := cluster.ClaimObject(ns, c)
		pvc.Labels = map[string]string{"app": "db"}
		if _, err := env.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// A writer that appends n to the data log, then n to the WAL: at any one point in
	// time the WAL's last n is the data's last n or one less.
	writer := cluster.PodObject(ns, cluster.PodSpec{Name: "db", Claims: []string{"data", "wal"}, Node: g.node})
	writer.Spec.Containers[0].Command = []string{"sh", "-c", "n=0; while :; do n=$((n+1)); echo $n >> /data/log; echo $n >> /data2/log; done"}
	if _, err := env.Cluster.Client.CoreV1().Pods(ns).Create(ctx, writer, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	env.WaitRunning(t, ns, "db")
	cluster.WaitFor(t, 30*time.Second, "the writer's first 1000 lines", func() error {
		out, err := env.Exec(t, ns, "db", "tail -n1 /data2/log")
		if n, _ := strconv.Atoi(strings.TrimSpace(out)); err != nil || n < 1000 {
			return fmt.Errorf("%q: %w", out, err)
		}
		return nil
	})
	meta := map[string]any{"name": g.class}
	if g.driver == cluster.LocalDriver && g.perNode && !g.chartClass {
		// csi-snapshotter v8.7 --node-deployment sees only the group classes labelled
		// with its node (docs/snapshots.md, "Group snapshots of local pools").
		meta["labels"] = map[string]any{"snapshot.storage.kubernetes.io/managed-by": env.Node.Name}
	}
	class := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshotClass",
		"metadata": meta, "driver": g.driver, "deletionPolicy": "Delete"}}
	vgs := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshot",
		"metadata": map[string]any{"name": "db-snap", "namespace": ns},
		"spec": map[string]any{"volumeGroupSnapshotClassName": g.class,
			"source": map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "db"}}}}}}
	objs := []*unstructured.Unstructured{class, vgs}
	if g.chartClass {
		objs = objs[1:]
	}
	for _, o := range objs {
		if err := env.Cluster.Applier().Apply(ctx, o, false); err != nil {
			t.Fatal(err)
		}
	}
	dyn := dynamic.NewForConfigOrDie(env.Cluster.Config)
	var uid string
	cluster.WaitFor(t, 3*time.Minute, "VolumeGroupSnapshot "+ns+"/db-snap ready", func() error {
		got, err := dyn.Resource(vgsGVR).Namespace(ns).Get(ctx, "db-snap", metav1.GetOptions{})
		if err != nil {
			return err
		}
		uid = string(got.GetUID())
		if ready, _, _ := unstructured.NestedBool(got.Object, "status", "readyToUse"); !ready {
			st, _, _ := unstructured.NestedMap(got.Object, "status")
			return fmt.Errorf("status %v; events: %s", st, env.Events(ns, "db-snap"))
		}
		return nil
	})
	// snapshot-controller names each member VolumeSnapshot after the group's UID and
	// the member's volume handle.
	for _, c := range []string{"data", "wal"} {
		member := fmt.Sprintf("snapshot-%x", sha256.Sum256([]byte(uid+env.VolumeHandle(t, ns, c))))
		env.Claim(t, ns, cluster.ClaimSpec{Name: c + "-restored", Class: map[string]string{"data": g.data, "wal": g.wal}[c], Size: "300Mi", DataSource: member})
	}
	// A local snapshot restores on its node: g.node keeps the pod there.
	env.Pod(t, ns, cluster.PodSpec{Name: "check", Claims: []string{"data-restored", "wal-restored"}, Node: g.node})
	last := func(path string) int {
		out := env.MustExec(t, ns, "check", "tail -c 64 "+path+" | tail -n1; tail -c1 "+path+" | od -An -c")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 2 || strings.TrimSpace(lines[1]) != `\n` {
			t.Fatalf("%s does not end with a whole line: %q", path, out)
		}
		n, err := strconv.Atoi(strings.TrimSpace(lines[0]))
		if err != nil {
			t.Fatalf("%s: last line %q", path, lines[0])
		}
		return n
	}
	d, w := last("/data/log"), last("/data2/log")
	t.Logf("restored: data ends at %d, WAL at %d", d, w)
	if w > d || d > w+1 {
		t.Fatalf("the restored pair is no single point in time: data ends at %d, WAL at %d (want WAL = data or data-1)", d, w)
	}
}

// volumeAttributesClass creates a VolumeAttributesClass.
func (e *kubeletEnv) volumeAttributesClass(t testing.TB, name, driver string, params map[string]string) {
	t.Helper()
	vac := &storagev1.VolumeAttributesClass{ObjectMeta: metav1.ObjectMeta{Name: name}, DriverName: driver, Parameters: params}
	if _, err := e.Cluster.Client.StorageV1().VolumeAttributesClasses().Create(context.Background(), vac, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// patchClaim merge-patches a claim.
func (e *kubeletEnv) patchClaim(t testing.TB, ns, name, patch string) {
	t.Helper()
	if _, err := e.Cluster.Client.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitThrottle waits until the pod's blkio cgroup (v1, as on this machine) holds want for a
// loop device in the throttle file (0: no line for a loop device, the limit removed).
func (e *kubeletEnv) waitThrottle(t testing.TB, pod *corev1.Pod, file string, want int64) {
	t.Helper()
	cluster.WaitFor(t, 90*time.Second, fmt.Sprintf("%s of pod %s/%s = %d", file, pod.Namespace, pod.Name, want), func() error {
		dir, err := podCgroup("/sys/fs/cgroup/blkio", string(pod.UID))
		if err != nil {
			return err
		}
		// v1 throttling is not hierarchical: the pod's containers, in the cgroups
		// below, must hold the limit too, or it holds nothing.
		dirs := []string{dir}
		ents, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if e.IsDir() {
				dirs = append(dirs, filepath.Join(dir, e.Name()))
			}
		}
		for _, d := range dirs {
			b, err := os.ReadFile(filepath.Join(d, file))
			if err != nil {
				return err
			}
			var got int64
			for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
				// "MAJ:MIN value"; loop devices are major 7.
				if f := strings.Fields(line); len(f) == 2 && strings.HasPrefix(f[0], "7:") {
					got, _ = strconv.ParseInt(f[1], 10, 64)
				}
			}
			if got != want {
				return fmt.Errorf("%s holds %q", filepath.Join(d, file), b)
			}
		}
		return nil
	})
}

// podCgroup finds the cgroup directory kubelet made for a pod under root, whichever node
// prefix and QoS class it is under.
func podCgroup(root, uid string) (string, error) {
	var found string
	want := "pod" + uid
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return filepath.SkipDir
		case !d.IsDir():
			return nil // a SkipDir here would skip the rest of its directory
		}
		if strings.Count(strings.TrimPrefix(p, root), "/") > 5 {
			return filepath.SkipDir
		}
		if d.Name() == want {
			found = p
			return filepath.SkipAll
		}
		return nil
	})
	if found == "" {
		return "", fmt.Errorf("no cgroup %s under %s", want, root)
	}
	return found, nil
}

// allocated is how many bytes of a file are allocated on its filesystem.
func allocated(t testing.TB, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// poolVolumes lists the volume directories of a pool on this machine.
func poolVolumes(t testing.TB, pool string) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(pool, "volumes"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}
