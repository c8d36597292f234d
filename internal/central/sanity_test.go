package central_test

// The official CSI sanity suite through the central controller: its Controller service
// is central.Server over the fixture's Channel and NodeView, its Node service node a's
// own driver.

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"google.golang.org/grpc"

	"github.com/poolcsi/poolcsi/internal/central"
	"github.com/poolcsi/poolcsi/internal/central/centraltest"
	"github.com/poolcsi/poolcsi/internal/params"
	"github.com/poolcsi/poolcsi/internal/testutil"
)

// sanityModeEnv selects the sanity run of a child process: Ginkgo runs one suite per
// process.
const sanityModeEnv = "POOLCSI_CENTRAL_SANITY"

// learntHints is a Hints with no PVs or contents to index: it knows only what the
// server learnt from Done calls. The suite's IDs are never in a PV, so every first
// lookup asks every node, as it would for a volume whose PV is not yet made.
type learntHints struct {
	mu sync.Mutex
	m  map[string]string
	// groups are the nodes of groups across nodes, learnt at their create.
	groups map[string][]string
}

func (h *learntHints) get(id string) (string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n, ok := h.m[id]
	return n, ok
}
func (h *learntHints) VolumeNode(id string) (string, bool)   { return h.get(id) }
func (h *learntHints) SnapshotNode(id string) (string, bool) { return h.get(id) }
func (h *learntHints) GroupNode(id string) (string, bool)    { return h.get(id) }
func (h *learntHints) Synced() bool                          { return true }
func (h *learntHints) GroupNodes(id string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.groups[id]
}
func (h *learntHints) LearnGroup(id string, nodes []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.groups == nil {
		h.groups = map[string][]string{}
	}
	h.groups[id] = nodes
}
func (h *learntHints) Learn(id, node string) {
	h.mu.Lock()
	h.m[id] = node
	h.mu.Unlock()
}

// TestSanityThroughCentral runs the sanity suite, mount, block and dir volumes each in a
// child process, against the central server with nodes a and b live.
func TestSanityThroughCentral(t *testing.T) {
	if mode := os.Getenv(sanityModeEnv); mode != "" {
		runCentralSanity(t, mode)
		return
	}
	if testing.Short() {
		t.Skip("-short: the sanity suite through the central controller takes a few seconds")
	}
	for _, mode := range []string{"mount", "block", "dir"} {
		t.Run(mode, func(t *testing.T) {
			// The children wait on agents and informers as much as they compute: run
			// side by side they take little more than one.
			t.Parallel()
			args := []string{"-test.run=^TestSanityThroughCentral$", "-test.count=1"}
			if dir := os.Getenv("POOLCSI_COVER_DIR"); dir != "" {
				args = append(args, "-test.coverprofile="+filepath.Join(dir, "central-sanity-"+mode+".out"))
			}
			cmd := exec.Command(os.Args[0], args...)
			cmd.Env = append(os.Environ(), sanityModeEnv+"="+mode)
			out, err := cmd.CombinedOutput()
			if err != nil || testing.Verbose() {
				t.Logf("sanity through central (%s):\n%s", mode, out)
			}
			if err != nil {
				t.Fatalf("sanity through central (%s) failed: %v", mode, err)
			}
		})
	}
}

// serveCentral serves the central server on a unix socket and returns its endpoint.
func serveCentral(t *testing.T, s *central.Server) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "poolcsi-central")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "central.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	s.Register(g)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = g.Serve(l)
	}()
	t.Cleanup(func() {
		g.Stop()
		<-done
	})
	return "unix://" + sock
}

func runCentralSanity(t *testing.T, mode string) {
	// Both nodes hold pool "local"; a sanity CreateVolume has no topology, so the
	// server places it on the first live node of the sorted PoolNodes with room: a,
	// whose own driver is the suite's Node service. A volume put on b would fail the
	// suite's NodeStage on a.
	c := centraltest.New(t, "a", "b")
	// The controller's clock never moves here: a call's budget, pickup and stale
	// timers never fire, and the nodes stay live; every call ends with its answer.
	s := central.NewServer(central.Deps{Name: centraltest.DriverName, Version: "test", TopologyKey: topologyKey,
		Params: params.Config{Pools: []string{centraltest.Pool}},
		Calls:  c.Channel, Nodes: c.Nodes, Hints: &learntHints{m: map[string]string{}}, Clock: c.Clock,
		// The suite's creates name no topology.
		PlaceWithoutTopology: true})
	root := t.TempDir()
	cfg := sanity.NewTestConfig()
	cfg.ControllerAddress = serveCentral(t, s)
	cfg.Address = c.Node("a").Endpoint
	cfg.StagingPath = filepath.Join(root, "staging")
	cfg.TargetPath = filepath.Join(root, "target")
	cfg.TestVolumeSize = 64 << 20
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.IDGen = testutil.SanityIDs{Pool: centraltest.Pool}
	cfg.IdempotentCount = 2
	cfg.CheckPath = testutil.SanityCheckPath
	cfg.TestVolumeMutableParameters = testutil.SanityMutableParameters
	switch mode {
	case "block":
		cfg.TestVolumeAccessType = "block"
	case "dir":
		cfg.TestVolumeParameters = map[string]string{"layout": "dir"}
		cfg.TestVolumeMutableParameters = map[string]string{"preallocate": "false"}
	}
	sanity.Test(t, cfg)
}
