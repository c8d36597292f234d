package report

import (
	"strings"
	"testing"
)

// nodeKey is poolcsi's node topology key, which the text shows as the node's name.
const nodeKey = "topology.poolcsi.io/node"

// fixture is a report as gathered from an all-in-one poolcsi with two
// pools, for the rendering's table tests to change.
func fixture() *Report {
	max := int64(20 << 30)
	return &Report{
		Endpoint: "unix:///csi/csi.sock",
		Plugin: Plugin{Name: "local.poolcsi.io", Version: "v1.2.3", Services: []string{"Identity", "Node", "Controller"},
			Capabilities: []string{"CONTROLLER_SERVICE"}, Ready: true},
		Node: Node{NodeID: "node-a", Topology: map[string]string{nodeKey: "node-a"},
			Capabilities: []string{"STAGE_UNSTAGE_VOLUME"}, StorageHealth: []HealthEntry{}, VolumeHealthNote: nodeVolumeHealthNote},
		Controller: Controller{Capabilities: []string{"LIST_VOLUMES"},
			Pools: []PoolCapacity{{Pool: "fast", AvailableBytes: 20 << 30, MaximumVolumeBytes: &max}, {Pool: "slow", AvailableBytes: 3<<40 + 512<<30}},
			Volumes: []Volume{
				{ID: "fast.b", CapacityBytes: 10<<30 + 100<<20, Context: map[string]string{"pool": "fast", "layout": "image"},
					Topology: []map[string]string{{nodeKey: "node-a"}}},
				{ID: "slow.a", CapacityBytes: 1 << 30, Context: map[string]string{"pool": "slow", "layout": "dir", "quota": "none", "sizeEnforced": "false"},
					Published: []string{"node-b", "node-c"}},
			}},
	}
}

func TestWriteText(t *testing.T) {
	tests := []struct {
		name    string
		change  func(r *Report)
		want    []string // in this order
		notWant []string
	}{
		{"healthy, human units", func(*Report) {}, []string{
			"Plugin local.poolcsi.io v1.2.3 at unix:///csi/csi.sock",
			"max volumes:     no limit",
			"  fast  20 GiB     20 GiB              -\n",
			"  slow  3.5 TiB    -                   -\n",
			"  fast.b  fast  image   10.1 GiB  node-a           -              -                              ok\n",
			"  slow.a  slow  dir     1 GiB     any node         node-b,node-c  quota=none sizeEnforced=false  ok\n",
			"2 volumes (11.1 GiB), 0 abnormal; available: fast 20 GiB, slow 3.5 TiB; no problems\n",
		}, []string{"Problems", "!"}},
		{"an abnormal volume, listed last", func(r *Report) {
			r.Controller.Volumes = append([]Volume{{ID: "fast.a", CapacityBytes: 1 << 20, Abnormal: true,
				Health: []HealthEntry{{"DATA_LOSS", "ImageMissing", "gone"}, {"DEGRADED", "PoolNearlyFull", "95%"}}}}, r.Controller.Volumes...)
		}, []string{
			"  fast.b ", "  slow.a ", "! fast.a  -     -       1 MiB     any node         -              -                              ABNORMAL: ImageMissing, PoolNearlyFull\n",
			"Problems (2)\n  ! volume fast.a: DATA_LOSS ImageMissing: gone\n  ! volume fast.a: DEGRADED PoolNearlyFull: 95%\n",
			"3 volumes (11.1 GiB), 1 abnormal; available: fast 20 GiB, slow 3.5 TiB; 2 problems\n",
		}, nil},
		{"abnormal by the v1.12 condition alone", func(r *Report) {
			r.Controller.Volumes[1].Abnormal, r.Controller.Volumes[1].Condition = true, "ImageTruncated: cut"
		}, []string{"! slow.a", "ABNORMAL\n", "  ! volume slow.a: ImageTruncated: cut\n", "1 abnormal"}, nil},
		{"a node plugin's socket", func(r *Report) {
			r.Plugin.Services = r.Plugin.Services[:2]
			r.Controller = Controller{NotServed: "this socket serves no Controller service (no CONTROLLER_SERVICE capability)"}
		}, []string{"Node\n  node ID:", "Controller\n  this socket serves no Controller service (no CONTROLLER_SERVICE capability)\n",
			"\nno volumes or capacity on this socket (no Controller service); no problems\n"}, []string{"Volumes", "Pools"}},
		{"a controller's socket", func(r *Report) {
			r.Node = Node{NotServed: "this socket serves no Node service (NodeGetInfo: Unimplemented)"}
		}, []string{"Node\n  this socket serves no Node service (NodeGetInfo: Unimplemented)\n\nController\n"}, []string{"node ID", "storage health"}},
		{"not ready, storage unreachable, a pool that fails, a call that failed", func(r *Report) {
			r.Plugin.Ready = false
			r.Node.StorageHealth = []HealthEntry{{"STORAGE_UNREACHABLE", "PoolUnavailable", "pool slow: not mounted"}}
			r.Controller.Pools[1] = PoolCapacity{Pool: "slow", Error: "Unavailable: not mounted"}
			r.Errors = []string{"ControllerListVolumeHealth: Internal: boom"}
		}, []string{
			"probe:         ! not ready", "storage health:  ! STORAGE_UNREACHABLE PoolUnavailable", "! slow  ?",
			"Problems (4)\n  ! ControllerListVolumeHealth: Internal: boom\n  ! Probe: the plugin says it is not ready\n" +
				"  ! storage STORAGE_UNREACHABLE PoolUnavailable: pool slow: not mounted\n  ! pool slow: GetCapacity: Unavailable: not mounted\n",
			"available: fast 20 GiB; 4 problems\n",
		}, nil},
		{"the only pool, unnamed; no capacity capability", func(r *Report) {
			r.Controller.Pools = []PoolCapacity{{AvailableBytes: 1536}}
		}, []string{"(the only pool)  1.5 KiB", "available: 1.5 KiB; no problems"}, nil},
		{"capacity unknown", func(r *Report) {
			r.Controller.Pools, r.Controller.PoolsNote = nil, "not known: the controller offers no GET_CAPACITY"
		}, []string{"Pools (GetCapacity)\n  not known: the controller offers no GET_CAPACITY\n", "; capacity unknown; no problems"}, []string{"POOL  AVAILABLE"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := fixture()
			tt.change(r)
			r.Finish()
			var b strings.Builder
			if err := WriteText(&b, r); err != nil {
				t.Fatal(err)
			}
			out := b.String()
			checkOutput(t, out, tt.want, tt.notWant)
		})
	}
}

func TestHumanBytes(t *testing.T) {
	tests := []struct {
		n    int64
		want string
	}{
		{0, "0 B"},
		{1023, "1023 B"},
		{1024, "1 KiB"},
		{1536, "1.5 KiB"},
		{300 << 20, "300 MiB"},
		{10 << 30, "10 GiB"},
		{10<<30 + 100<<20, "10.1 GiB"},
		{3 << 40, "3 TiB"},
		{-2048, "-2 KiB"},
	}
	for _, tt := range tests {
		if got := HumanBytes(tt.n); got != tt.want {
			t.Errorf("HumanBytes(%d) = %q, want %q", tt.n, got, tt.want)
		}
	}
}

// checkOutput fails unless out holds each of want, in that order, and none of
// notWant.
func checkOutput(t *testing.T, out string, want, notWant []string) {
	t.Helper()
	rest := out
	for _, w := range want {
		i := strings.Index(rest, w)
		if i < 0 {
			t.Fatalf("output lacks %q after what came before:\n%s", w, out)
		}
		rest = rest[i+len(w):]
	}
	for _, nw := range notWant {
		if strings.Contains(out, nw) {
			t.Errorf("output has %q:\n%s", nw, out)
		}
	}
}
