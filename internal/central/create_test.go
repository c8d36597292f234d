package central

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
)

func topo(nodes ...string) []*csi.Topology {
	var out []*csi.Topology
	for _, n := range nodes {
		out = append(out, &csi.Topology{Segments: map[string]string{testKey: n}})
	}
	return out
}

func TestCreateVolume(t *testing.T) {
	ctx := context.Background()
	id := pool.NewVolumeID("local", "pvc-1").String()
	for _, c := range []struct {
		name                 string
		requisite, preferred []string
		required             int64
		setup                func(e *srvEnv)
		want                 codes.Code
		node                 string   // where CreateVolume went
		calls                []string // every call, probes sorted
	}{
		{name: "WaitForFirstConsumer: the selected node", requisite: []string{"b"}, preferred: []string{"b"}, node: "b",
			calls: []string{"b:CreateVolume"}},
		{name: "WaitForFirstConsumer: the selected node down", requisite: []string{"b"}, setup: func(e *srvEnv) { e.nodes.down["b"] = true },
			want: codes.Unavailable},
		{name: "Immediate: preferred first", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "a", "b"}, node: "c",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "c:CreateVolume"}},
		{name: "Immediate: the preferred node is full", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "a", "b"}, required: 5 << 30,
			setup: func(e *srvEnv) { e.nodes.pools["c"][0].AvailableBytes = 1 << 30 }, node: "a",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "a:CreateVolume"}},
		// A node down may hold the volume an earlier attempt made: nothing is made.
		{name: "Immediate: a requisite node down", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.nodes.down["c"] = true }, want: codes.Unavailable,
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume"}},
		{name: "Immediate: a node down outside the requisite", requisite: []string{"a", "b"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.nodes.down["c"] = true }, node: "b",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "b:CreateVolume"}},
		{name: "Immediate: the preferred node's pool Unavailable", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.nodes.pools["c"][0].Condition = nodecall.PoolUnavailable }, node: "b",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "b:CreateVolume"}},
		{name: "Immediate: only requisite nodes", requisite: []string{"a", "b"}, preferred: []string{"c", "b", "a"}, node: "b",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "b:CreateVolume"}},
		{name: "Immediate: no room anywhere", requisite: []string{"a", "b"}, required: 100 << 30, want: codes.ResourceExhausted,
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume"}},
		// The duplicate guard: an earlier attempt made the volume on a (its call swept
		// since); the retry prefers c but goes to a.
		{name: "Immediate: the ID exists already", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.world.hold(e.world.vols, "a", id) }, node: "a",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "a:CreateVolume"}},
		{name: "Immediate: the ID learnt", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.hints.learnt[id] = "b" }, node: "b", calls: []string{"b:CreateVolume"}},
		// A new leader has learnt nothing, and the volume an earlier attempt is making on
		// a answers no probe yet: the call under way fixes the node.
		{name: "Immediate: a create under way on another node", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.world.pending[[2]string{"CreateVolume", id}] = "a" }, node: "a", calls: []string{"a:CreateVolume"}},
		{name: "Immediate: a create under way outside the topology", requisite: []string{"b", "c"}, preferred: []string{"c", "b"},
			setup: func(e *srvEnv) { e.world.pending[[2]string{"CreateVolume", id}] = "a" }, want: codes.ResourceExhausted, calls: []string{}},
		{name: "Immediate: another method's call does not fix the node", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.world.pending[[2]string{"DeleteVolume", id}] = "a" }, node: "c",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "c:CreateVolume"}},
		// The upgrade's mixed window (docs/design/central-controller.md §8): d has the
		// driver registered (csi-provisioner's requisite for an Immediate claim is every
		// node whose CSINode has it) but no PoolNode, so it still runs its per-node
		// provisioner, which may take this claim: the central one places nothing.
		{name: "Immediate: a requisite node not rolled", requisite: []string{"a", "b", "c", "d"}, preferred: []string{"c", "d", "a", "b"},
			want: codes.Unavailable, calls: []string{}},
		{name: "Immediate: a requisite node not rolled, the ID learnt", requisite: []string{"a", "b", "d"},
			setup: func(e *srvEnv) { e.hints.learnt[id] = "b" }, want: codes.Unavailable, calls: []string{}},
		// A rolled node (it has a PoolNode) runs no per-node provisioner, even when its
		// PoolNode lists no pool of this claim: not the mixed window.
		{name: "Immediate: a rolled node without the pool", requisite: []string{"a", "b", "c"}, preferred: []string{"c", "b", "a"},
			setup: func(e *srvEnv) { e.nodes.pools["c"] = nil }, node: "b",
			calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume", "b:CreateVolume"}},
		// The per-node provisioner of d took the claim (selected-node d): the requisite
		// is d alone, d has no PoolNode, and the call is UNAVAILABLE (nothing made).
		{name: "Immediate: taken by a node not rolled", requisite: []string{"d"}, want: codes.Unavailable, calls: []string{}},
		{name: "Immediate: a probe that cannot tell", requisite: []string{"a", "b"},
			setup: func(e *srvEnv) {
				e.world.fail = func(node, method string) error {
					if node == "a" && method == "ControllerGetVolume" {
						return statusErr(codes.Aborted)
					}
					return nil
				}
			}, want: codes.Aborted, calls: []string{"a:ControllerGetVolume", "b:ControllerGetVolume"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			if c.setup != nil {
				c.setup(e)
			}
			resp, err := e.ctrl().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(),
				Parameters:                map[string]string{"pool": "local", "csi.storage.k8s.io/pvc/name": "data"},
				CapacityRange:             &csi.CapacityRange{RequiredBytes: c.required},
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topo(c.requisite...), Preferred: topo(c.preferred...)}})
			if codeOf(err) != c.want {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if got := sortProbes(e.world.methods()); c.calls != nil && !slices.Equal(got, c.calls) {
				t.Errorf("calls %v, want %v", got, c.calls)
			}
			if err != nil {
				return
			}
			calls := e.world.made()
			last := calls[len(calls)-1]
			if last.node != c.node || last.method != "CreateVolume" || last.target != id || resp.GetVolume().GetVolumeId() != id {
				t.Errorf("created by %v, answer %v; want on %s, target %s", last, resp, c.node, id)
			}
			if e.hints.learnt[id] != c.node {
				t.Errorf("learnt %q", e.hints.learnt[id])
			}
		})
	}
}

// TestCreateFromSource: a clone or a restore is made on its source's node, and a
// claim whose topology excludes that node is RESOURCE_EXHAUSTED (csi-provisioner
// reschedules it).
// TestCreateRetryStays: a create still running at the deadline is retried on the same
// node even when that node's figures no longer fit (the first attempt reserved the
// space), so a same-ID volume is never made on a second node.
func TestCreateRetryStays(t *testing.T) {
	ctx := context.Background()
	e := newSrvEnv()
	e.world.fail = func(node, method string) error {
		if method == "CreateVolume" {
			return statusErr(codes.Aborted) // still running there
		}
		return nil
	}
	req := &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(), Parameters: map[string]string{"pool": "local"}, CapacityRange: &csi.CapacityRange{RequiredBytes: 5 << 30},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topo("a", "b", "c"), Preferred: topo("c", "b", "a")}}
	if _, err := e.ctrl().CreateVolume(ctx, req); codeOf(err) != codes.Aborted {
		t.Fatalf("first attempt: %v", err)
	}
	e.nodes.pools["c"][0].AvailableBytes = 1 << 30
	e.world.fail = nil
	if _, err := e.ctrl().CreateVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	var on []string
	for _, c := range e.world.made() {
		if c.method == "CreateVolume" {
			on = append(on, c.node)
		}
	}
	if !slices.Equal(on, []string{"c", "c"}) {
		t.Errorf("CreateVolume on %v, want c twice", on)
	}
}

func TestCreateFromSource(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name      string
		snapshot  bool
		hinted    bool
		requisite []string
		down      []string
		want      codes.Code
		wrongHint string   // the source hinted on this node instead
		calls     []string // every call, probes sorted (nil: not checked)
	}{
		// A hint where the claim may go is taken at its word: one call.
		{name: "clone next to its source", requisite: []string{"b"}, hinted: true, calls: []string{"b:CreateVolume"}},
		{name: "clone, hint wrong", requisite: []string{"a", "b"}, wrongHint: "a",
			calls: []string{"a:CreateVolume", "a:ControllerGetVolume", "b:ControllerGetVolume", "c:ControllerGetVolume", "b:CreateVolume"}},
		{name: "restore, hint wrong", snapshot: true, requisite: []string{"b", "c"}, wrongHint: "c",
			calls: []string{"c:CreateVolume", "a:ListSnapshots", "b:ListSnapshots", "c:ListSnapshots", "b:CreateVolume"}},
		{name: "clone, source found by asking", requisite: []string{"b"}},
		{name: "clone elsewhere", requisite: []string{"a"}, hinted: true, want: codes.ResourceExhausted},
		{name: "clone, Immediate, source in the requisite", requisite: []string{"a", "b", "c"}},
		{name: "clone, source's node down", requisite: []string{"b"}, hinted: true, down: []string{"b"}, want: codes.Unavailable},
		{name: "restore next to its source", snapshot: true, requisite: []string{"b"}, hinted: true},
		{name: "restore, found by asking", snapshot: true, requisite: []string{"b"}},
		{name: "restore elsewhere", snapshot: true, requisite: []string{"c"}, want: codes.ResourceExhausted},
		{name: "restore of nothing", snapshot: true, requisite: []string{"b"}, down: nil, want: codes.NotFound},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			vid := e.vol("b", "src")
			sid := pool.NewSnapshotID("local", "snap").String()
			if c.want != codes.NotFound {
				e.snap("b", "snap", vid)
			}
			if c.hinted {
				e.hints.vol[vid], e.hints.snap[sid] = "b", "b"
			}
			if c.wrongHint != "" {
				e.hints.vol[vid], e.hints.snap[sid] = c.wrongHint, c.wrongHint
			}
			for _, n := range c.down {
				e.nodes.down[n] = true
			}
			src := &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: vid}}}
			if c.snapshot {
				src = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: sid}}}
			}
			_, err := e.ctrl().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(), VolumeContentSource: src,
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topo(c.requisite...)}})
			if codeOf(err) != c.want {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if c.want == codes.ResourceExhausted && !strings.Contains(err.Error(), "the source is on node b; a local clone is made next to its source") {
				t.Errorf("message: %v", err)
			}
			if c.calls != nil {
				if got := sortProbes(e.world.methods()); !slices.Equal(got, c.calls) {
					t.Errorf("calls %v, want %v", got, c.calls)
				}
			}
			var created []string
			for _, call := range e.world.made() {
				if call.method == "CreateVolume" {
					created = append(created, call.node)
				}
			}
			want := []string{"b"}
			if c.wrongHint != "" {
				want = []string{c.wrongHint, "b"} // answered NOT_FOUND there: no source
			}
			if c.want == codes.OK && !slices.Equal(created, want) || c.want != codes.OK && len(created) > 0 {
				t.Errorf("CreateVolume on %v", created)
			}
		})
	}
}

func TestGetCapacity(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name      string
		params    map[string]string
		topology  map[string]string
		setup     func(e *srvEnv)
		want, max int64
	}{
		{name: "live", params: map[string]string{"pool": "local"}, topology: map[string]string{testKey: "a"}, want: 10 << 30, max: 10 << 30},
		{name: "other pool", params: map[string]string{"pool": "fast"}, topology: map[string]string{testKey: "a"}, want: 1 << 30, max: 1 << 30},
		{name: "stale", params: map[string]string{"pool": "local"}, topology: map[string]string{testKey: "a"}, setup: func(e *srvEnv) { e.nodes.down["a"] = true }},
		{name: "unknown node", params: map[string]string{"pool": "local"}, topology: map[string]string{testKey: "z"}},
		{name: "pool Unavailable", params: map[string]string{"pool": "local"}, topology: map[string]string{testKey: "a"},
			setup: func(e *srvEnv) {
				e.nodes.pools["a"][0] = nodecall.PoolCapacity{Name: "local", Condition: nodecall.PoolUnavailable, AvailableBytes: 5}
			}},
		{name: "pool not on the node", params: map[string]string{"pool": "fast"}, topology: map[string]string{testKey: "a"},
			setup: func(e *srvEnv) { e.nodes.pools["a"] = e.nodes.pools["a"][:1] }},
		{name: "another topology key", params: map[string]string{"pool": "local"}, topology: map[string]string{"zone": "x"}},
		{name: "no topology: the sum of live nodes", params: map[string]string{"pool": "local"},
			setup: func(e *srvEnv) {
				e.nodes.down["c"] = true
				e.nodes.pools["b"][0].AvailableBytes = 20 << 30
				e.nodes.pools["b"][0].MaximumVolumeSize = 20 << 30
			},
			want: 30 << 30, max: 20 << 30},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			if c.setup != nil {
				c.setup(e)
			}
			req := &csi.GetCapacityRequest{Parameters: c.params}
			if c.topology != nil {
				req.AccessibleTopology = &csi.Topology{Segments: c.topology}
			}
			resp, err := e.ctrl().GetCapacity(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.GetAvailableCapacity() != c.want || resp.GetMaximumVolumeSize().GetValue() != c.max {
				t.Errorf("got %d (max %d), want %d (max %d)", resp.GetAvailableCapacity(), resp.GetMaximumVolumeSize().GetValue(), c.want, c.max)
			}
			if len(e.world.made()) > 0 {
				t.Errorf("GetCapacity made calls: %v", e.world.made())
			}
		})
	}
}

// TestAnswerHeldToTheAsk: a node may write only its own calls' answers, but what it
// writes becomes a PersistentVolume or a VolumeSnapshotContent. An answer naming
// another volume or snapshot, or another node's topology, is refused (INTERNAL), so no
// claim is pointed at data its node does not hold; an answer without topology gets its
// node's.
func TestAnswerHeldToTheAsk(t *testing.T) {
	ctx := context.Background()
	other := pool.NewVolumeID("local", "pvc-other").String()
	createReq := &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(), Parameters: map[string]string{"pool": "local"},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topo("b"), Preferred: topo("b")}}
	for _, c := range []struct {
		name   string
		tamper func(node string, resp proto.Message)
		want   codes.Code
	}{
		{"as asked, no topology: its node's", nil, codes.OK},
		{"as asked, its own topology", func(node string, resp proto.Message) {
			if r, ok := resp.(*csi.CreateVolumeResponse); ok {
				r.Volume.AccessibleTopology = topo(node)
			}
		}, codes.OK},
		{"another volume's ID", func(_ string, resp proto.Message) {
			if r, ok := resp.(*csi.CreateVolumeResponse); ok {
				r.Volume.VolumeId = other
			}
		}, codes.Internal},
		{"another node's topology", func(_ string, resp proto.Message) {
			if r, ok := resp.(*csi.CreateVolumeResponse); ok {
				r.Volume.AccessibleTopology = topo("a")
			}
		}, codes.Internal},
		{"its own and another node's topology", func(node string, resp proto.Message) {
			if r, ok := resp.(*csi.CreateVolumeResponse); ok {
				r.Volume.AccessibleTopology = topo(node, "a")
			}
		}, codes.Internal},
		{"no volume", func(_ string, resp proto.Message) {
			if r, ok := resp.(*csi.CreateVolumeResponse); ok {
				r.Volume = nil
			}
		}, codes.Internal},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			e.world.tamper = c.tamper
			resp, err := e.ctrl().CreateVolume(ctx, createReq)
			if codeOf(err) != c.want {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if err == nil {
				if got := resp.GetVolume().GetAccessibleTopology(); len(got) != 1 || got[0].GetSegments()[testKey] != "b" {
					t.Errorf("topology %v, want node b's", got)
				}
			}
		})
	}

	e := newSrvEnv()
	src := e.vol("b", "pvc-src")
	snapReq := &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: src}
	if _, err := e.ctrl().CreateSnapshot(ctx, snapReq); err != nil {
		t.Fatalf("snapshot as asked: %v", err)
	}
	for name, tamper := range map[string]func(*csi.Snapshot){
		"another snapshot's ID":    func(s *csi.Snapshot) { s.SnapshotId = pool.NewSnapshotID("local", "snap-other").String() },
		"another source volume":    func(s *csi.Snapshot) { s.SourceVolumeId = other },
		"a snapshot of other pool": func(s *csi.Snapshot) { s.SnapshotId = pool.NewSnapshotID("fast", "snap-1").String() },
	} {
		e.world.tamper = func(_ string, resp proto.Message) {
			if r, ok := resp.(*csi.CreateSnapshotResponse); ok && r.Snapshot != nil {
				tamper(r.Snapshot)
			}
		}
		if _, err := e.ctrl().CreateSnapshot(ctx, snapReq); codeOf(err) != codes.Internal {
			t.Errorf("snapshot answered with %s: %v, want INTERNAL", name, err)
		}
	}
}

// The upgrade's mixed window ends, node by node, when a node of an Immediate claim's
// topology that has no PoolNode no longer runs the per-node provisioner (its pod
// replaced by the DaemonSet's roll), not when it gets a PoolNode: a node whose new pod
// runs but whose agent never starts held every Immediate claim back for ever. Before
// PodRollout, "the new pod's agent never started", "an evicted old pod" and "no pod at
// all" failed (UNAVAILABLE).
func TestCreateVolumeMixedWindow(t *testing.T) {
	ctx := context.Background()
	id := pool.NewVolumeID("local", "pvc-1").String()
	pod := func(name, node string, mod func(*corev1.Pod), containers ...corev1.Container) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "poolcsi", Name: name},
			Spec: corev1.PodSpec{NodeName: node, Containers: containers}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
		if mod != nil {
			mod(p)
		}
		return p
	}
	agent := corev1.Container{Name: "poolcsi-local", Args: []string{"serve", "--local-agent"}}
	old := corev1.Container{Name: "csi-provisioner-local", Args: []string{"--node-deployment", "--node-deployment-immediate-binding=true"}}
	renamed := corev1.Container{Name: "provisioner", Args: []string{"--node-deployment", "--node-deployment-immediate-binding=true"}}
	for _, c := range []struct {
		name    string
		pods    []runtime.Object
		nilRoll bool  // no Rollout: every node without a PoolNode counts as not rolled
		fail    error // the pod list fails
		want    codes.Code
		node    string // where CreateVolume went
		message string // in the error
	}{
		{name: "d still runs the per-node provisioner", pods: []runtime.Object{pod("node-d", "d", nil, agent, old)},
			want: codes.Unavailable, message: "node d of this claim's topology still runs the per-node provisioner (pod poolcsi/node-d)"},
		{name: "a renamed per-node provisioner", pods: []runtime.Object{pod("node-d", "d", nil, agent, renamed)},
			want: codes.Unavailable, message: "pod poolcsi/node-d"},
		{name: "its pod terminating", pods: []runtime.Object{pod("node-d", "d", func(p *corev1.Pod) {
			now := metav1.Now()
			p.DeletionTimestamp = &now
		}, agent, old)}, want: codes.Unavailable, message: "pod poolcsi/node-d"},
		{name: "the new pod's agent never started", pods: []runtime.Object{pod("node-d", "d", nil, agent)}, node: "c"},
		{name: "an evicted old pod", pods: []runtime.Object{pod("node-d", "d", func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }, agent, old)}, node: "c"},
		{name: "no pod at all", node: "c"},
		{name: "another node's old pod", pods: []runtime.Object{pod("node-e", "e", nil, agent, old)}, node: "c"},
		{name: "another namespace's pod", pods: []runtime.Object{func() *corev1.Pod {
			p := pod("node-d", "d", nil, agent, old)
			p.Namespace = "other"
			return p
		}()}, node: "c"},
		{name: "the pods unknown", fail: errors.New("forbidden"), want: codes.Unavailable, message: "forbidden"},
		{name: "no Rollout", nilRoll: true, want: codes.Unavailable, message: "nodes d of this claim's topology have no PoolNode"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			client := fake.NewClientset(c.pods...)
			if c.fail != nil {
				client.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, c.fail })
			}
			if !c.nilRoll {
				e.s.d.Rollout = PodRollout{Client: client, Namespace: "poolcsi"}
			}
			resp, err := e.ctrl().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(),
				Parameters:                map[string]string{"pool": "local"},
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topo("a", "b", "c", "d"), Preferred: topo("d", "c", "a", "b")}})
			if codeOf(err) != c.want || !strings.Contains(fmt.Sprint(err), c.message) {
				t.Fatalf("got %v, want %v with %q", err, c.want, c.message)
			}
			if err != nil {
				if made := e.world.made(); len(made) != 0 {
					t.Errorf("calls made: %v", made)
				}
				return
			}
			calls := e.world.made()
			if last := calls[len(calls)-1]; last.node != c.node || last.method != "CreateVolume" || resp.GetVolume().GetVolumeId() != id {
				t.Errorf("created by %v; want on %s", last, c.node)
			}
		})
	}
}

// A CreateVolume that names no node: csi-provisioner sends one only for an Immediate
// claim with no selected node while node.localImmediateBinding is false
// (--immediate-topology=false), whose claims stay Pending, as the per-node layout left
// them, for the user's own controller to place. The central controller placed them on
// any node with room: the "as --local-central runs" cases failed (OK, a call made).
func TestCreateVolumeWithoutTopology(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name     string
		anywhere bool
		topology *csi.TopologyRequirement
		source   bool // a clone of a volume on b
		want     codes.Code
		node     string
	}{
		{name: "as --local-central runs", want: codes.FailedPrecondition},
		{name: "as --local-central runs, an empty requirement", topology: &csi.TopologyRequirement{}, want: codes.FailedPrecondition},
		{name: "as --local-central runs, segments without the node key",
			topology: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"zone": "z"}}}}, want: codes.FailedPrecondition},
		{name: "as --local-central runs, a clone", source: true, want: codes.FailedPrecondition},
		{name: "as --local-central runs, a selected node", topology: &csi.TopologyRequirement{Requisite: topo("b"), Preferred: topo("b")}, node: "b"},
		{name: "anywhere allowed", anywhere: true, node: "a"},
		{name: "anywhere allowed, a clone", anywhere: true, source: true, node: "b"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newSrvEnv()
			e.s.d.PlaceWithoutTopology = c.anywhere
			req := &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: mountCap(),
				Parameters: map[string]string{"pool": "local"}, AccessibilityRequirements: c.topology}
			if c.source {
				src := e.vol("b", "pvc-src")
				e.hints.vol[src] = "b"
				req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src}}}
			}
			_, err := e.ctrl().CreateVolume(ctx, req)
			if codeOf(err) != c.want {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			made := e.world.made()
			if err != nil {
				if len(made) != 0 {
					t.Errorf("calls made: %v", made)
				}
				if !strings.Contains(err.Error(), "node.localImmediateBinding") {
					t.Errorf("message %q does not name the value", err)
				}
				return
			}
			if last := made[len(made)-1]; last.node != c.node || last.method != "CreateVolume" {
				t.Errorf("created by %v; want on %s", last, c.node)
			}
		})
	}
}
