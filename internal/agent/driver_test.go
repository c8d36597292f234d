package agent

// Only this test imports internal/driver, to stand a real node behind the socket; the
// package itself never does (`go list -deps ./internal/agent` lists no internal/driver).

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// realNode serves a real driver over the fake kernel (no root) on a unix socket, node
// "b" with local pool "local", and returns a connection to it.
func realNode(t *testing.T) *grpc.ClientConn {
	t.Helper()
	root := t.TempDir()
	p, err := pool.Initialise(pool.Config{Name: "local", Path: filepath.Join(root, "pool")})
	if err != nil {
		t.Fatal(err)
	}
	h := fake.New()
	d, err := driver.New(driver.Options{Name: "poolcsi.test", Version: "test", NodeID: "b", Mode: driver.ModeAll, Pools: []*pool.Pool{p},
		Host: layout.Host{Mounts: h, Loops: h, Devices: h, FS: h, Cgroups: h}})
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "poolcsi-agent")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Serve(ctx, endpoint) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	// Serve listens on its own goroutine: the node is handed out once its socket
	// answers (a first call failed with "no such file or directory" under load).
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	if _, err := csi.NewIdentityClient(conn).GetPluginInfo(wctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("the driver's socket never answered: %v", err)
	}
	return conn
}

// The agent before a real driver: a create carried out, carried out again by a new agent
// after a crash between Running and Done (attempts 2, the same volume, one volume in the
// pool), a modify that kicks the I/O limits, a delete; and the PoolNode's capacity is the
// node's own.
func TestAgentOverARealDriver(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "b")
	e.deps.Conn = realNode(t)
	kicks := 0
	e.deps.Kick = func() { kicks++ }
	step := func(c *nodecall.Call) nodecall.CallStatus {
		t.Helper()
		if _, err := e.worker(t).Step(ctx, c.Spec.Target); err != nil {
			t.Fatal(err)
		}
		return e.get(t, c.Name).Status
	}
	answer := func(method string, st nodecall.CallStatus) proto.Message {
		t.Helper()
		if st.Phase != nodecall.Done || codes.Code(st.Code) != codes.OK {
			t.Fatalf("%s: %+v", method, st)
		}
		m, _ := nodecall.Lookup(method)
		resp, err := m.DecodeResponse(st.Response)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}

	create := &csi.CreateVolumeRequest{Name: "pvc-1", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
		Parameters:                map[string]string{"pool": "local"},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{topologyKey: "b"}}}}}
	c := e.call(t, "b", "CreateVolume", "pvc-1", create, start)
	st := step(c)
	id := answer("CreateVolume", st).(*csi.CreateVolumeResponse).GetVolume().GetVolumeId()
	if id == "" || st.Attempts != 1 {
		t.Fatalf("created %q, %+v", id, st)
	}

	// The agent died after the node made the volume, before the answer was written.
	crashed := e.get(t, c.Name)
	crashed.Status = nodecall.CallStatus{Nonce: c.Spec.Nonce, Phase: nodecall.Running, Attempts: 1}
	if _, err := e.store.UpdateStatus(ctx, crashed); err != nil {
		t.Fatal(err)
	}
	st = step(c)
	if again := answer("CreateVolume", st).(*csi.CreateVolumeResponse).GetVolume().GetVolumeId(); again != id || st.Attempts != 2 {
		t.Errorf("after the crash: volume %q attempts %d, want %q attempts 2", again, st.Attempts, id)
	}
	list, err := csi.NewControllerClient(e.deps.Conn).ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 {
		t.Errorf("volumes in the pool: %v %v", list.GetEntries(), err)
	}

	_, p := New(e.deps)
	if err := p.Beat(ctx, true); err != nil {
		t.Fatal(err)
	}
	if n, err := e.store.GetNode(ctx, "b"); err != nil || len(n.Status.Pools) != 1 || n.Status.Pools[0].Condition != nodecall.PoolOk || n.Status.Pools[0].AvailableBytes <= 0 {
		t.Errorf("PoolNode: %+v %v", n, err)
	}

	mod := e.call(t, "b", "ControllerModifyVolume", id, &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: map[string]string{"readIOPS": "100"}}, start)
	answer("ControllerModifyVolume", step(mod))
	if kicks != 1 {
		t.Errorf("kicks %d, want 1", kicks)
	}
	del := e.call(t, "b", "DeleteVolume", id, &csi.DeleteVolumeRequest{VolumeId: id}, start)
	answer("DeleteVolume", step(del))
	// The node's own answer, with its code: the volume is gone.
	get := e.call(t, "b", "ControllerGetVolume", id, &csi.ControllerGetVolumeRequest{VolumeId: id}, start)
	if st := step(get); codes.Code(st.Code) != codes.NotFound {
		t.Errorf("ControllerGetVolume after the delete: %+v", st)
	}
}
