package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/report"
)

// statusDriver serves a real driver in mode on a throw-away local pool "local",
// with a 1 GiB image volume per name in volumes (made through the pool, no
// mkfs, no loop device: the driver lists it all the same); a name that starts
// with "broken" gets an image cut to half, which the driver reports as
// ImageTruncated. It returns the endpoint.
func statusDriver(t *testing.T, mode driver.Mode, volumes ...string) string {
	t.Helper()
	dir := t.TempDir()
	p, err := pool.Open(pool.Config{Name: "local", Path: filepath.Join(dir, "pool")})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range volumes {
		v, err := p.Reserve(context.Background(), pool.Spec{Name: name, Layout: pool.LayoutImage, AccessType: pool.AccessFilesystem,
			FSType: "ext4", CapacityBytes: 1 << 30, Topology: map[string]string{driver.TopologyKey: "node-a"}})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Images().Prepare(v); err != nil {
			t.Fatal(err)
		}
		if err := p.MarkReady(v); err != nil {
			t.Fatal(err)
		}
		id, err := pool.ParseVolumeID(v.ID)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(name, "broken") {
			if err := os.Truncate(p.ImagePath(id), 1<<29); err != nil {
				t.Fatal(err)
			}
		}
	}
	d, err := driver.New(driver.Options{Name: "status.test", Version: "v-test", NodeID: "node-a", Mode: mode, Pools: []*pool.Pool{p}, PathPrefix: dir})
	if err != nil {
		t.Fatal(err)
	}
	return serveInTest(t, d, dir)
}

func TestStatusAgainstTheDriver(t *testing.T) {
	tests := []struct {
		name    string
		mode    driver.Mode
		volumes []string
		args    []string
		code    int
		want    []string // in stdout, in this order
		notWant []string
	}{
		{"all in one, healthy", driver.ModeAll, []string{"web", "db"}, nil, 0, []string{
			"Plugin status.test v-test at unix://", "probe:         ready", "services:      Identity, Node, Controller",
			"node ID:         node-a", "topology:        topology.poolcsi.io/node=node-a", "storage health:  healthy",
			"volume health:   not shown", "POOL", "local ", "1 MiB", "Volumes (ListVolumes): 2",
			"  local.", "local  image   1 GiB  node-a", "2 volumes (2 GiB), 0 abnormal; available: local ", "; no problems",
		}, []string{"Problems", "!"}},
		{"all in one, one volume truncated", driver.ModeAll, []string{"broken-db", "web", "a"}, nil, 2, []string{
			"Volumes (ListVolumes): 3", "  local.", "  local.", "! local.", "ABNORMAL: ImageTruncated",
			"Problems (1)", "  ! volume local.", "DATA_LOSS ImageTruncated: image file",
			"3 volumes (3 GiB), 1 abnormal; available: local ", "; 1 problem\n",
		}, nil},
		{"a controller's socket", driver.ModeController, []string{"web"}, nil, 0, []string{
			"services:      Identity, Controller", "this socket serves no Node service (NodeGetInfo: Unimplemented)",
			"Volumes (ListVolumes): 1", "1 volume (1 GiB), 0 abnormal",
		}, []string{"node ID"}},
		{"a controller's socket, no volumes: the only pool", driver.ModeController, nil, nil, 0, []string{
			"(the only pool)", "Volumes (ListVolumes): 0", "0 volumes (0 B), 0 abnormal; available: ",
		}, nil},
		{"a node plugin's socket", driver.ModeNode, []string{"web"}, nil, 0, []string{
			"services:      Identity, Node", "node ID:         node-a",
			"this socket serves no Controller service (no CONTROLLER_SERVICE capability)",
			"no volumes or capacity on this socket (no Controller service); no problems",
		}, []string{"Volumes", "Pools"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			endpoint := statusDriver(t, tt.mode, tt.volumes...)
			code, out, errOut := runCLI(append([]string{"status", "--endpoint", endpoint}, tt.args...)...)
			if code != tt.code {
				t.Fatalf("exit %d, want %d; stdout:\n%s\nstderr:\n%s", code, tt.code, out, errOut)
			}
			checkOutput(t, out, tt.want, tt.notWant)
		})
	}
}

func TestStatusJSON(t *testing.T) {
	endpoint := statusDriver(t, driver.ModeAll, "web", "broken")
	code, out, errOut := runCLI("status", "--endpoint", endpoint, "-o", "json")
	if code != 2 {
		t.Fatalf("exit %d, want 2 (one volume abnormal): %s", code, errOut)
	}
	var r report.Report
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, out)
	}
	vols := r.Controller.Volumes
	if r.Plugin.Name != "status.test" || !r.Plugin.Ready || r.Node.NodeID != "node-a" || len(vols) != 2 {
		t.Fatalf("report: %+v", r)
	}
	if vols[0].Abnormal || !vols[1].Abnormal || vols[1].Health[0].Reason != "ImageTruncated" || vols[1].Condition == "" || vols[1].CapacityBytes != 1<<30 {
		t.Fatalf("volumes (the abnormal one last, with its v1.13 health and its legacy condition): %+v", vols)
	}
	if r.Summary != (report.Summary{Volumes: 2, Abnormal: 1, ProvisionedBytes: 2 << 30, Pools: 1, Problems: 1}) || len(r.Problems) != 1 {
		t.Fatalf("summary %+v, problems %q", r.Summary, r.Problems)
	}
	if len(r.Controller.Pools) != 1 || r.Controller.Pools[0].Pool != "local" || r.Controller.Pools[0].AvailableBytes <= 0 {
		t.Fatalf("pools: %+v", r.Controller.Pools)
	}
}

// Every page of ListVolumes and ControllerListVolumeHealth is read.
func TestStatusPages(t *testing.T) {
	old := statusPageSize
	statusPageSize = 1
	t.Cleanup(func() { statusPageSize = old })
	endpoint := statusDriver(t, driver.ModeController, "a", "broken-b", "c", "broken-d")
	code, out, errOut := runCLI("status", "--endpoint", endpoint, "-o", "json")
	if code != 2 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var r report.Report
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	if r.Summary.Volumes != 4 || r.Summary.Abnormal != 2 {
		t.Fatalf("summary %+v:\n%s", r.Summary, out)
	}
}

func TestStatusUnreachable(t *testing.T) {
	sock := "unix://" + filepath.Join(t.TempDir(), "none.sock")
	code, out, errOut := runCLI("status", "--endpoint", sock, "--timeout", "2s")
	if code != 1 || out != "" || !strings.Contains(errOut, "cannot reach the driver at "+sock) {
		t.Fatalf("exit %d, want 1 with nothing on stdout; stdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
}

// The timeout is each call's: a driver that does not answer makes status
// fail after it, not hang.
func TestStatusTimeout(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "mute.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }() // accepts nothing, answers nothing
	start := time.Now()
	code, _, errOut := runCLI("status", "--endpoint", "unix://"+sock, "--timeout", "300ms")
	if code != 1 || !strings.Contains(errOut, "DeadlineExceeded") || time.Since(start) > 10*time.Second {
		t.Fatalf("exit %d after %s: %s", code, time.Since(start), errOut)
	}
}

// A pool whose directory is gone: every service says so, and status lists it
// among the problems, with the pool poolcsi names when asked without one.
func TestStatusBrokenPool(t *testing.T) {
	dir := t.TempDir()
	var pools []*pool.Pool
	for _, name := range []string{"good", "gone"} {
		p, err := pool.Open(pool.Config{Name: name, Path: filepath.Join(dir, name)})
		if err != nil {
			t.Fatal(err)
		}
		pools = append(pools, p)
	}
	d, err := driver.New(driver.Options{Name: "status.test", Version: "v-test", NodeID: "node-a", Mode: driver.ModeAll, Pools: pools, PathPrefix: dir})
	if err != nil {
		t.Fatal(err)
	}
	endpoint := serveInTest(t, d, dir)
	if err := os.Rename(filepath.Join(dir, "gone"), filepath.Join(dir, "moved")); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI("status", "--endpoint", endpoint)
	if code != 2 {
		t.Fatalf("exit %d, want 2: %s\n%s", code, out, errOut)
	}
	for _, w := range []string{"storage health:  ! STORAGE_UNREACHABLE PoolUnavailable", "  good  ", "! gone  ?",
		"incomplete: ListVolumes failed", "! pool gone: GetCapacity: Unavailable", "available: good "} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q", w)
		}
	}
	if t.Failed() {
		t.Log(out)
	}
}

// fakeCSI is a driver that is not poolcsi and misbehaves: not ready, a
// listing whose next_token never ends, no Node service; its one pool is
// asked for without parameters.
type fakeCSI struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	lists int
}

func (f *fakeCSI) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: "fake.csi", VendorVersion: "0"}, nil
}

func (f *fakeCSI) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{Type: &csi.PluginCapability_Service_{
		Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}}}}, nil
}

func (f *fakeCSI) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil
}

func (f *fakeCSI) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_LIST_VOLUMES, csi.ControllerServiceCapability_RPC_GET_CAPACITY} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (f *fakeCSI) ListVolumes(_ context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	f.lists++
	id := fmt.Sprintf("vol-%d", f.lists)
	return &csi.ListVolumesResponse{NextToken: "again", Entries: []*csi.ListVolumesResponse_Entry{{
		Volume: &csi.Volume{VolumeId: id, CapacityBytes: 3 << 20, AccessibleTopology: []*csi.Topology{{Segments: map[string]string{"zone": "a"}}}}}}}, nil
}

func (f *fakeCSI) GetCapacity(_ context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	if len(req.GetParameters()) > 0 {
		return nil, status.Error(codes.InvalidArgument, "no parameters here")
	}
	return &csi.GetCapacityResponse{AvailableCapacity: 7 << 30}, nil
}

func TestStatusAnotherDriver(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	f := &fakeCSI{}
	csi.RegisterIdentityServer(srv, f)
	csi.RegisterControllerServer(srv, f)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	code, out, errOut := runCLI("status", "--endpoint", "unix://"+sock)
	if code != 2 {
		t.Fatalf("exit %d, want 2: %s\n%s", code, out, errOut)
	}
	for _, w := range []string{
		"Plugin fake.csi 0", "probe:         ! not ready", "services:      Identity, Controller",
		"this socket serves no Node service (NodeGetInfo: Unimplemented)",
		"  (the only pool)  7 GiB      -                   -\n",
		"  vol-1   -     -       3 MiB  zone=a", "  vol-2 ",
		"  ! ListVolumes: next_token \"again\" came twice: the listing stopped there\n  ! Probe: the plugin says it is not ready\n",
		"2 volumes (6 MiB), 0 abnormal; available: 7 GiB; 2 problems\n",
	} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q", w)
		}
	}
	if t.Failed() {
		t.Log(out)
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

// Without --endpoint, status asks the default sockets in order and shows the
// first that answers; when none does, it says what each one did.
func TestStatusDefaultEndpoints(t *testing.T) {
	dir := t.TempDir()
	missing := "unix://" + filepath.Join(dir, "missing.sock")
	dead := filepath.Join(dir, "dead.sock") // a socket no process listens on any more
	l, err := net.Listen("unix", dead)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	serving := statusDriver(t, driver.ModeAll, "web")
	tests := []struct {
		name      string
		endpoints []string
		code      int
		stdout    []string
		stderr    []string
	}{
		{"the second answers", []string{missing, "unix://" + dead, serving}, 0,
			[]string{"Plugin status.test v-test at " + serving + "\n", "1 volume (1 GiB)"}, nil},
		{"none answers", []string{missing, "unix://" + dead}, 1, nil, []string{
			"no driver answers on the default sockets (is the driver running? Name its socket with --endpoint):\n",
			"  " + missing + ": no socket there\n",
			"  unix://" + dead + ": Unavailable: ", "connection refused",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func(old []string) { statusEndpoints = old }(statusEndpoints)
			statusEndpoints = tt.endpoints
			code, out, errOut := runCLI("status", "--timeout", "5s")
			if code != tt.code {
				t.Fatalf("exit %d, want %d; stdout:\n%s\nstderr:\n%s", code, tt.code, out, errOut)
			}
			checkOutput(t, out, tt.stdout, nil)
			checkOutput(t, errOut, tt.stderr, nil)
		})
	}
}
