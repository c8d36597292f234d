package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// poolRecord is what a pool holds for one volume. The layout
// (<pool>/volumes/<32 hex>/{volume.json,disk.img}) is read directly: this module cannot
// import the root module's internal/pool.
type poolRecord struct {
	Recorded  int64  // volume.json capacityBytes
	ImageSize int64  // size of disk.img
	Image     string // path of disk.img
}

func readPoolRecord(t *testing.T, poolDir, handle string) poolRecord {
	t.Helper()
	m := handleRE.FindStringSubmatch(handle)
	if m == nil {
		t.Fatalf("volume handle %q is not <pool>.<32 hex>", handle)
	}
	dir := filepath.Join(poolDir, "volumes", m[2])
	b, err := os.ReadFile(filepath.Join(dir, "volume.json"))
	if err != nil {
		t.Fatalf("volume %s in the pool: %v", handle, err)
	}
	var v struct {
		CapacityBytes int64 `json:"capacityBytes"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("%s/volume.json: %v", dir, err)
	}
	rec := poolRecord{Recorded: v.CapacityBytes, Image: filepath.Join(dir, "disk.img")}
	fi, err := os.Stat(rec.Image)
	if err != nil {
		t.Fatalf("volume %s image: %v", handle, err)
	}
	rec.ImageSize = fi.Size()
	return rec
}

// listCapacity is the capacity ListVolumes reports for the volume.
func listCapacity(t *testing.T, d *driver, handle string) int64 {
	t.Helper()
	v := listVolume(t, d, handle)
	if v == nil {
		t.Fatalf("ListVolumes does not know %s", handle)
	}
	return v.GetCapacityBytes()
}

// requestExpansion raises the claim's request as a user would (kubectl patch).
func requestExpansion(t *testing.T, c *cluster.Cluster, claim string, size resource.Quantity) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size.String())
	if _, err := c.Client.CoreV1().PersistentVolumeClaims("default").Patch(context.Background(), claim,
		types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatalf("expanding claim %s to %s: %v", claim, size.String(), err)
	}
}

// waitNodeExpansionPending waits until the resizer has done its part: the PV's capacity is
// at least want and the claim waits for the node (FileSystemResizePending, resize status
// NodeResizePending). It returns the PV's new capacity.
func waitNodeExpansionPending(t *testing.T, c *cluster.Cluster, claim, pvName string, want resource.Quantity) resource.Quantity {
	t.Helper()
	ctx := context.Background()
	var got resource.Quantity
	cluster.WaitFor(t, 90*time.Second, "resizer to expand "+pvName+" and mark "+claim+" for node expansion", func() error {
		pv, err := c.Client.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		got = pv.Spec.Capacity[corev1.ResourceStorage]
		if got.Cmp(want) < 0 {
			return fmt.Errorf("PV capacity %s, want >= %s; %s", got.String(), want.String(), lastEvent(c, claim))
		}
		pvc, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, claim, metav1.GetOptions{})
		if err != nil {
			return err
		}
		pending := false
		for _, cond := range pvc.Status.Conditions {
			if cond.Type == corev1.PersistentVolumeClaimFileSystemResizePending && cond.Status == corev1.ConditionTrue {
				pending = true
			}
		}
		if !pending {
			return fmt.Errorf("claim conditions %+v, no FileSystemResizePending; %s", pvc.Status.Conditions, lastEvent(c, claim))
		}
		if s := pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage]; s != corev1.PersistentVolumeClaimNodeResizePending {
			return fmt.Errorf("claim resize status %q, want %q", s, corev1.PersistentVolumeClaimNodeResizePending)
		}
		return nil
	})
	return got
}

func lastEvent(c *cluster.Cluster, claim string) string {
	evs, err := c.Client.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + claim})
	if err != nil || len(evs.Items) == 0 {
		return "no events"
	}
	e := evs.Items[len(evs.Items)-1]
	return fmt.Sprintf("last event %s: %s", e.Reason, e.Message)
}

// logHas reports whether a process's log contains s.
func logHas(t *testing.T, p *cluster.Proc, s string) bool {
	t.Helper()
	b, err := os.ReadFile(p.Log)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(b), s)
}

// logLines returns the lines of a process's log that contain s.
func logLines(t *testing.T, p *cluster.Proc, s string) []string {
	t.Helper()
	b, err := os.ReadFile(p.Log)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return out
}

// loopsOf lists the loop devices backed by file (losetup -j), to prove the node calls
// left none behind.
func loopsOf(t *testing.T, file string) string {
	t.Helper()
	out, err := exec.Command("losetup", "-j", file).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup -j %s: %v %s", file, err, out)
	}
	return strings.TrimSpace(string(out))
}

// testSharedResize: csi-resizer in the controller Deployment calls ControllerExpandVolume
// on the shared driver, which grows the image in the pool; the node part (loop device,
// filesystem) is left to kubelet, so the claim waits in FileSystemResizePending.
func testSharedResize(t *testing.T, c *cluster.Cluster, shared *driver, resizer *cluster.Proc, poolDir string) {
	ctx := context.Background()
	pvc := newPVC("shared-resize", "poolcsi-shared-image", resource.MustParse("96Mi"), corev1.ReadWriteOnce)
	pv := provision(t, c, pvc)
	handle := pv.Spec.CSI.VolumeHandle
	t.Cleanup(func() { deleteClaim(t, c, pvc.Name, pv.Name) })
	before := pv.Spec.Capacity[corev1.ResourceStorage]
	rec := readPoolRecord(t, poolDir, handle)
	if rec.Recorded != before.Value() {
		t.Fatalf("pool records %d bytes for %s, the PV says %s", rec.Recorded, handle, before.String())
	}

	// Above the xfs minimum the class's 96Mi was rounded up to.
	want := before.DeepCopy()
	want.Add(resource.MustParse("100Mi"))
	requestExpansion(t, c, pvc.Name, want)
	got := waitNodeExpansionPending(t, c, pvc.Name, pv.Name, want)
	t.Logf("PV %s: %s -> %s, claim FileSystemResizePending / NodeResizePending", pv.Name, before.String(), got.String())

	if calls := logLines(t, shared.proc, "/csi.v1.Controller/ControllerExpandVolume"); len(calls) == 0 {
		t.Errorf("the PV grew but poolcsi's log shows no ControllerExpandVolume call")
	} else {
		t.Logf("poolcsi: %s", calls[0])
	}
	if n := listCapacity(t, shared, handle); n != got.Value() {
		t.Errorf("ListVolumes reports %d bytes for %s, the PV %s", n, handle, got.String())
	}
	rec = readPoolRecord(t, poolDir, handle)
	if rec.Recorded != got.Value() || rec.ImageSize < got.Value() {
		t.Errorf("pool: volume.json capacityBytes %d, image %d bytes; want both %d (the PV's new capacity)", rec.Recorded, rec.ImageSize, got.Value())
	}
	pvc2, err := c.Client.CoreV1().PersistentVolumeClaims("default").Get(ctx, pvc.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The claim's capacity is kubelet's to raise, after NodeExpandVolume.
	if cp := pvc2.Status.Capacity[corev1.ResourceStorage]; cp.Cmp(before) != 0 {
		t.Errorf("claim capacity %s before any node expansion, want the old %s", cp.String(), before.String())
	}
	t.Logf("pool: volume.json capacityBytes %d, image %d bytes; claim status capacity still %s, allocated %s",
		rec.Recorded, rec.ImageSize, before.String(), pvc2.Status.AllocatedResources.Storage().String())
	if logHas(t, resizer, "supports node resize only") {
		t.Errorf("csi-resizer (shared driver) took the node-expansion-only path; poolcsi.io advertises controller EXPAND_VOLUME")
	}
	checkNoForbidden(t, resizer)
}

// testLocalResize: the local driver runs with --expand-on-node and does not advertise
// controller EXPAND_VOLUME, so csi-resizer-local (one for the cluster, unable to reach
// another node's pool) must only mark the claim; the image grows at NodeExpandVolume on the
// volume's node, which this test then calls as kubelet would. The claim is a raw block
// volume because ext4 cannot grow online here (no CAP_SYS_RESOURCE); test/e2e
// TestExpandOnNode grows a mounted xfs filesystem the same way.
func testLocalResize(t *testing.T, c *cluster.Cluster, local *driver, resizer *cluster.Proc, poolDir string) {
	ctx := context.Background()
	caps, err := local.controller().ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, cp := range caps.GetCapabilities() {
		if cp.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_EXPAND_VOLUME {
			t.Fatal("the chart's local driver (--expand-on-node) advertises controller EXPAND_VOLUME: " +
				"its cluster-wide resizer would call a controller that cannot reach other nodes' pools")
		}
	}
	const pathLine = "The CSI driver supports node resize only"
	if !logHas(t, resizer, pathLine) {
		t.Errorf("csi-resizer-local did not log %q at start-up: it did not take its node-expansion-only path", pathLine)
	}

	size := resource.MustParse("96Mi")
	pvc := newPVC("local-resize", "poolcsi-local-image", size, corev1.ReadWriteOnce)
	block := corev1.PersistentVolumeBlock
	pvc.Spec.VolumeMode = &block
	pvc.Annotations = map[string]string{"volume.kubernetes.io/selected-node": "node-1"}
	pv := provision(t, c, pvc)
	handle := pv.Spec.CSI.VolumeHandle
	t.Cleanup(func() { deleteClaim(t, c, pvc.Name, pv.Name) })
	rec := readPoolRecord(t, poolDir, handle)
	if rec.Recorded != size.Value() {
		t.Fatalf("pool records %d bytes for %s, want %d", rec.Recorded, handle, size.Value())
	}

	want := resource.MustParse("160Mi")
	requestExpansion(t, c, pvc.Name, want)
	got := waitNodeExpansionPending(t, c, pvc.Name, pv.Name, want)
	if got.Cmp(want) != 0 {
		t.Errorf("PV capacity %s, want exactly the requested %s (the resizer's node-only path echoes the request)", got.String(), want.String())
	}
	t.Logf("PV %s: %s -> %s, claim FileSystemResizePending / NodeResizePending", pv.Name, size.String(), got.String())
	if calls := logLines(t, local.proc, "/csi.v1.Controller/ControllerExpandVolume"); len(calls) > 0 {
		t.Errorf("csi-resizer-local called ControllerExpandVolume on the --expand-on-node driver: %s", calls[0])
	}
	if after := readPoolRecord(t, poolDir, handle); after != rec {
		t.Errorf("the pool changed before any NodeExpandVolume: %+v, was %+v", after, rec)
	}
	if n := listCapacity(t, local, handle); n != size.Value() {
		t.Errorf("ListVolumes reports %d bytes for %s before NodeExpandVolume, want the old %d", n, handle, size.Value())
	}
	t.Logf("pool unchanged until the node expands: volume.json capacityBytes %d, image %d bytes", rec.Recorded, rec.ImageSize)

	// kubelet's part on node-1: stage the block volume, then NodeExpandVolume with the
	// claim's new size.
	node := csi.NewNodeClient(local.conn)
	vc := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	staging := filepath.Join(c.Dir, "staging", pv.Name)
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: handle, StagingTargetPath: staging}); err != nil {
			t.Errorf("NodeUnstageVolume %s: %v", handle, err)
		}
		if l := loopsOf(t, rec.Image); l != "" {
			t.Errorf("loop device left on %s after NodeUnstageVolume: %s", rec.Image, l)
		}
	})
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: handle, StagingTargetPath: staging,
		VolumeCapability: vc, VolumeContext: pv.Spec.CSI.VolumeAttributes}); err != nil {
		t.Fatalf("NodeStageVolume %s: %v", handle, err)
	}
	resp, err := node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: handle, VolumePath: staging, StagingTargetPath: staging,
		VolumeCapability: vc, CapacityRange: &csi.CapacityRange{RequiredBytes: got.Value()}})
	if err != nil {
		t.Fatalf("NodeExpandVolume %s to %s: %v", handle, got.String(), err)
	}
	if resp.GetCapacityBytes() < got.Value() {
		t.Errorf("NodeExpandVolume answered %d bytes, want >= %d", resp.GetCapacityBytes(), got.Value())
	}
	after := readPoolRecord(t, poolDir, handle)
	if after.Recorded != got.Value() || after.ImageSize < got.Value() {
		t.Errorf("after NodeExpandVolume the pool has volume.json capacityBytes %d, image %d bytes; want %d", after.Recorded, after.ImageSize, got.Value())
	}
	if n := listCapacity(t, local, handle); n != got.Value() {
		t.Errorf("ListVolumes reports %d bytes after NodeExpandVolume, want %d", n, got.Value())
	}
	dev := strings.SplitN(loopsOf(t, rec.Image), ":", 2)[0]
	if dev == "" {
		t.Fatalf("no loop device on %s while staged", rec.Image)
	}
	out, err := exec.Command("blockdev", "--getsize64", dev).Output()
	if err != nil {
		t.Fatalf("blockdev --getsize64 %s: %v", dev, err)
	}
	if devSize := strings.TrimSpace(string(out)); devSize != fmt.Sprint(got.Value()) {
		t.Errorf("loop device %s is %s bytes after NodeExpandVolume, want %d", dev, devSize, got.Value())
	}
	t.Logf("NodeExpandVolume on node-1: image %d bytes, volume.json %d, loop device %s %d bytes",
		after.ImageSize, after.Recorded, dev, got.Value())
	checkNoForbidden(t, resizer)
}

// checkNoForbidden fails the test if a sidecar's API requests were refused: the chart's
// RBAC must cover everything it lists, watches and patches, including the informers a
// missing rule would only leave silently empty.
func checkNoForbidden(t *testing.T, p *cluster.Proc) {
	t.Helper()
	if lines := logLines(t, p, "forbidden"); len(lines) > 0 {
		t.Errorf("%s was refused by the API server (chart RBAC):\n%s", p.Name, strings.Join(lines[:min(len(lines), 5)], "\n"))
	}
}
