package driver

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// testDriver is a Driver over a fake kernel and real pools in a temporary
// directory: every handler runs without root.
type testDriver struct {
	*Driver
	host *fake.Host
	root string
	pool *pool.Pool
}

type testOpts struct {
	shared    bool
	maxVols   int64
	modify    func(*Options)
	extraPool bool
	// ephemeral is the pool's ephemeral setting (nil: the default).
	ephemeral *bool
	// overcommit is the pool's overcommit (0: the default, 1).
	overcommit float64
}

func newTestDriver(t testing.TB, o testOpts) *testDriver {
	t.Helper()
	root := t.TempDir()
	cfg := pool.Config{Name: "local", Path: filepath.Join(root, "pool"), Shared: o.shared, Ephemeral: o.ephemeral, Overcommit: o.overcommit}
	p, err := pool.Initialise(cfg)
	if err != nil {
		t.Fatal(err)
	}
	pools := []*pool.Pool{p}
	if o.extraPool {
		q, err := pool.Open(pool.Config{Name: "other", Path: filepath.Join(root, "other")})
		if err != nil {
			t.Fatal(err)
		}
		pools = append(pools, q)
	}
	h := fake.New()
	opts := Options{
		Name: "poolcsi.test", Version: "test", NodeID: "node-1", Mode: ModeAll, Pools: pools,
		MaxVolumesPerNode: o.maxVols,
		Host:              layout.Host{Mounts: h, Loops: h, Devices: h, FS: h, Cgroups: h},
	}
	if o.modify != nil {
		o.modify(&opts)
	}
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	d.registerNode(context.Background())
	return &testDriver{Driver: d, host: h, root: root, pool: p}
}

// serve starts the driver on a unix socket and returns a connection to it.
func (td *testDriver) serve(t testing.TB) (endpoint string, conn *grpc.ClientConn) {
	t.Helper()
	dir, err := os.MkdirTemp("", "poolcsi-sock")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "csi.sock")
	endpoint = "unix://" + sock
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- td.Serve(ctx, endpoint) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	conn, err = grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	// Until the server answers, its start-up passes may hold the pools
	// (start.go): a test that calls the handlers directly waits for it too.
	pctx, pcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer pcancel()
	if _, err := csi.NewIdentityClient(conn).Probe(pctx, &csi.ProbeRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("the served driver never answered Probe: %v", err)
	}
	return endpoint, conn
}

// Capabilities used by the table tests.
func mountCap(mode csi.VolumeCapability_AccessMode_Mode, fs string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

const rwo = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
