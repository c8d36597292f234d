package main

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// hostile is what a hostile or broken driver puts in its strings: a window title, an
// OSC 52 clipboard write, a line rewritten by a carriage return, a fake line, a C1
// control sequence introducer, a right-to-left override, a tab that shifts columns,
// (and, in error messages, which protobuf does not check, bytes that are not UTF-8).
const hostile = "x\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07\r\x1b[2Kall is well\nvolume ok\u009b31m\u202e\tcol"

// hostileCSI answers every call with hostile strings and a ListVolumes (and a
// ControllerListVolumeHealth) that never ends: each page a new token, entries and bytes.
type hostileCSI struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer
	lists, healths atomic.Int64
}

func (f *hostileCSI) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: "name" + hostile, VendorVersion: "version" + hostile}, nil
}

func (f *hostileCSI) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{Type: &csi.PluginCapability_Service_{
		Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}}}}, nil
}

func (f *hostileCSI) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "probe"+hostile+"\xff")
}

func (f *hostileCSI) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: "node" + hostile, AccessibleTopology: &csi.Topology{Segments: map[string]string{"key" + hostile: "value" + hostile}}}, nil
}

func (f *hostileCSI) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{Type: &csi.NodeServiceCapability_Rpc{
		Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH}}}}}, nil
}

func (f *hostileCSI) NodeGetStorageHealth(context.Context, *csi.NodeGetStorageHealthRequest) (*csi.NodeGetStorageHealthResponse, error) {
	return &csi.NodeGetStorageHealthResponse{BackendHealth: []*csi.NodeGetStorageHealthResponse_StorageBackendHealth{{Status: csi.StorageHealthErrorType_STORAGE_UNREACHABLE,
		Reason: "reason" + hostile, Message: "message" + hostile}}}, nil
}

func (f *hostileCSI) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_GET_CAPACITY} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// hostilePageLimit is where the fake stops by itself, so that a status without a cap
// fails the test rather than running out of memory.
const hostilePageLimit = 5000

func (f *hostileCSI) ListVolumes(_ context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	n := f.lists.Add(1)
	if n > hostilePageLimit {
		return nil, status.Error(codes.ResourceExhausted, "the fake gives up")
	}
	resp := &csi.ListVolumesResponse{NextToken: fmt.Sprintf("token-%d", n)}
	for i := range 8 {
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: &csi.Volume{VolumeId: fmt.Sprintf("vol-%d-%d%s", n, i, hostile), CapacityBytes: 1 << 20,
				VolumeContext: map[string]string{"pool": "pool" + hostile, "k" + hostile: strings.Repeat("v", 4096) + hostile}},
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: []string{"pub" + hostile}},
		})
	}
	return resp, nil
}

func (f *hostileCSI) ControllerListVolumeHealth(_ context.Context, req *csi.ControllerListVolumeHealthRequest) (*csi.ControllerListVolumeHealthResponse, error) {
	n := f.healths.Add(1)
	if n > hostilePageLimit {
		return nil, status.Error(codes.ResourceExhausted, "the fake gives up")
	}
	// Pages with no entries at all: only the page count can stop these.
	return &csi.ControllerListVolumeHealthResponse{NextToken: fmt.Sprintf("token-%d", n)}, nil
}

func (f *hostileCSI) GetCapacity(_ context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	return nil, status.Error(codes.Internal, "capacity"+hostile+"\xff")
}

func startHostile(t *testing.T) (*hostileCSI, string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "hostile.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	f := &hostileCSI{}
	csi.RegisterIdentityServer(srv, f)
	csi.RegisterControllerServer(srv, f)
	csi.RegisterNodeServer(srv, f)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return f, "unix://" + sock
}

// checkNoControls fails if out holds any control character but the newlines and the
// padding status writes itself, any C1 control or bidi override.
func checkNoControls(t *testing.T, out string) {
	t.Helper()
	for i, r := range out {
		bad := (r < 0x20 && r != '\n') || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == 0x202e
		if bad {
			t.Fatalf("output holds %U at byte %d: %q", r, i, out[max(0, i-40):min(len(out), i+40)])
		}
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "all is well") || strings.HasPrefix(line, "volume ok") {
			t.Fatalf("a line of the driver's making: %q", line)
		}
	}
}

func TestStatusHostileDriver(t *testing.T) {
	f, endpoint := startHostile(t)
	code, out, errOut := runCLI("status", "--endpoint", endpoint)
	if code != 2 {
		t.Fatalf("exit %d, want 2: %s\n%s", code, out, errOut)
	}
	if n := f.lists.Load(); n > int64(statusMaxPages) {
		t.Errorf("status asked ListVolumes for %d pages; the cap is %d", n, statusMaxPages)
	}
	if n := f.healths.Load(); n > int64(statusMaxPages) {
		t.Errorf("status asked ControllerListVolumeHealth for %d pages; the cap is %d", n, statusMaxPages)
	}
	checkNoControls(t, out+errOut)
	for _, w := range []string{`Plugin namex\x1b]0;owned\a\x1b]52;c;cm0gLXJmIH4=\a\r\x1b[2Kall is well\nvolume ok\u009b31m\u202e\tcol version`,
		`  vol-1-0x\x1b]0;owned\a`, "ListVolumes: stopped after", "ControllerListVolumeHealth: stopped after", "incomplete"} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q", w)
		}
	}
	if t.Failed() && len(out) < 1<<16 {
		t.Log(out)
	}
}

func TestCallHostileError(t *testing.T) {
	_, endpoint := startHostile(t)
	code, out, errOut := runCLI("call", "--endpoint", endpoint, "Probe")
	if code != 1 || !strings.Contains(errOut, "FailedPrecondition: probe") {
		t.Fatalf("exit %d; stdout:\n%q\nstderr:\n%q", code, out, errOut)
	}
	checkNoControls(t, errOut)
	if !strings.Contains(errOut, `probex\x1b]0;owned\a`) {
		t.Errorf("the message is not shown escaped: %q", errOut)
	}
	// The answer, JSON, escapes what JSON escapes.
	code, out, errOut = runCLI("call", "--endpoint", endpoint, "NodeGetInfo")
	if code != 0 {
		t.Fatalf("exit %d; stdout:\n%q\nstderr:\n%q", code, out, errOut)
	}
	checkNoControls(t, out)
	if !strings.Contains(out, `"node_id": "nodex\u001b]0;owned\u0007\u001b]52;c;cm0gLXJmIH4=\u0007\r\u001b[2Kall is well\nvolume ok\u009b31m\u202e\tcol"`) {
		t.Errorf("the answer is not the driver's strings, escaped: %s", out)
	}
}

// hostilePageBytes is the size of one of hostileCSI's first nine pages.
func hostilePageBytes(t *testing.T) int {
	resp, err := (&hostileCSI{}).ListVolumes(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	return proto.Size(resp)
}

// A listing is cut at whichever cap comes first.
func TestStatusListingCaps(t *testing.T) {
	for _, tt := range []struct {
		name                  string
		pages, entries, bytes int
		wantPages             int64
	}{
		{"pages", 10, 1 << 30, 1 << 30, 10},
		{"entries", 1 << 30, 8 * 5, 1 << 30, 5},
		{"bytes", 1 << 30, 1 << 30, 3 * hostilePageBytes(t), 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			defer func(p, e, b int) { statusMaxPages, statusMaxEntries, statusMaxBytes = p, e, b }(statusMaxPages, statusMaxEntries, statusMaxBytes)
			statusMaxPages, statusMaxEntries, statusMaxBytes = tt.pages, tt.entries, tt.bytes
			f, endpoint := startHostile(t)
			code, out, errOut := runCLI("status", "--endpoint", endpoint, "-o", "json")
			if code != 2 || !strings.Contains(out, "ListVolumes: stopped after") {
				t.Fatalf("exit %d: %.2000s\n%s", code, out, errOut)
			}
			if n := f.lists.Load(); n != tt.wantPages {
				t.Errorf("ListVolumes asked for %d pages, want %d", n, tt.wantPages)
			}
		})
	}
}
