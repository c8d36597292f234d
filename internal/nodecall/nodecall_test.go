package nodecall_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/poolcsi/poolcsi/internal/nodecall"
	"github.com/poolcsi/poolcsi/internal/nodecall/nodecalltest"
)

const secret = "hunter2-secret-value"

var secrets = map[string]string{"password": secret}

var mount = &csi.VolumeCapability{
	AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}

// requests is one request of every allowed method, each with what secrets it may carry.
func requests() map[string]proto.Message {
	return map[string]proto.Message{
		"CreateVolume": &csi.CreateVolumeRequest{Name: "pvc-1", CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
			VolumeCapabilities: []*csi.VolumeCapability{mount}, Parameters: map[string]string{"pool": "local", "layout": "image"},
			Secrets: secrets, MutableParameters: map[string]string{"readBytesPerSecond": "1000000"},
			AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"topology.poolcsi.io/node": "b"}}}},
			VolumeContentSource:       &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "local@abc"}}}},
		"DeleteVolume":               &csi.DeleteVolumeRequest{VolumeId: "local.abc", Secrets: secrets},
		"ControllerExpandVolume":     &csi.ControllerExpandVolumeRequest{VolumeId: "local.abc", CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}, Secrets: secrets, VolumeCapability: mount},
		"ControllerModifyVolume":     &csi.ControllerModifyVolumeRequest{VolumeId: "local.abc", Secrets: secrets, MutableParameters: map[string]string{"readIOPS": "100"}},
		"ControllerGetVolume":        &csi.ControllerGetVolumeRequest{VolumeId: "local.abc"},
		"ValidateVolumeCapabilities": &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "local.abc", VolumeCapabilities: []*csi.VolumeCapability{mount}, Secrets: secrets, Parameters: map[string]string{"pool": "local"}},
		"CreateSnapshot":             &csi.CreateSnapshotRequest{SourceVolumeId: "local.abc", Name: "snap-1", Secrets: secrets, Parameters: map[string]string{"a": "b"}},
		"DeleteSnapshot":             &csi.DeleteSnapshotRequest{SnapshotId: "local@abc", Secrets: secrets},
		"ListSnapshots":              &csi.ListSnapshotsRequest{SnapshotId: "local@abc", MaxEntries: 10, StartingToken: "local@aaa", Secrets: secrets},
		"CreateVolumeGroupSnapshot":  &csi.CreateVolumeGroupSnapshotRequest{Name: "group-1", SourceVolumeIds: []string{"local.a", "local.b"}, Secrets: secrets},
		"DeleteVolumeGroupSnapshot":  &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "local@g-1", SnapshotIds: []string{"local@1"}, Secrets: secrets},
		"GetVolumeGroupSnapshot":     &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "local@g-1", SnapshotIds: []string{"local@1"}, Secrets: secrets},
		"FreezeGroupHold":            mustStruct(nodecall.FreezeGroupHold{Group: "local@g-1", Name: "g", Members: []string{"local.a"}, BoundMillis: 30000}),
		"SnapshotHeld":               mustStruct(nodecall.SnapshotHeld{Group: "local@g-1", Name: "g", Members: []string{"local.a"}, All: []string{"local.a", "local.b"}, Nonce: "n"}),
		"ThawGroup":                  mustStruct(nodecall.ThawGroup{Group: "local@g-1", Nonce: "n"}),
	}
}

func mustStruct(v any) *structpb.Struct {
	s, err := nodecall.ToStruct(v)
	if err != nil {
		panic(err)
	}
	return s
}

func responses() map[string]proto.Message {
	vol := &csi.Volume{VolumeId: "local.abc", CapacityBytes: 1 << 30, VolumeContext: map[string]string{"layout": "image"},
		AccessibleTopology: []*csi.Topology{{Segments: map[string]string{"topology.poolcsi.io/node": "b"}}}}
	snap := &csi.Snapshot{SnapshotId: "local@abc", SourceVolumeId: "local.abc", SizeBytes: 5, ReadyToUse: true, CreationTime: timestamppb.New(time.Unix(1700000000, 5))}
	group := &csi.VolumeGroupSnapshot{GroupSnapshotId: "local@g-1", Snapshots: []*csi.Snapshot{snap}, ReadyToUse: true}
	return map[string]proto.Message{
		"CreateVolume":               &csi.CreateVolumeResponse{Volume: vol},
		"DeleteVolume":               &csi.DeleteVolumeResponse{},
		"ControllerExpandVolume":     &csi.ControllerExpandVolumeResponse{CapacityBytes: 2 << 30, NodeExpansionRequired: true},
		"ControllerModifyVolume":     &csi.ControllerModifyVolumeResponse{},
		"ControllerGetVolume":        &csi.ControllerGetVolumeResponse{Volume: vol, Status: &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: []string{"b"}}},
		"ValidateVolumeCapabilities": &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{VolumeCapabilities: []*csi.VolumeCapability{mount}}},
		"CreateSnapshot":             &csi.CreateSnapshotResponse{Snapshot: snap},
		"DeleteSnapshot":             &csi.DeleteSnapshotResponse{},
		"ListSnapshots":              &csi.ListSnapshotsResponse{Entries: []*csi.ListSnapshotsResponse_Entry{{Snapshot: snap}}, NextToken: "local@b"},
		"CreateVolumeGroupSnapshot":  &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: group},
		"DeleteVolumeGroupSnapshot":  &csi.DeleteVolumeGroupSnapshotResponse{},
		"GetVolumeGroupSnapshot":     &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: group},
		"FreezeGroupHold":            mustStruct(nodecall.GroupHeld{Nonce: "n", HoldMillis: 30000}),
		"SnapshotHeld":               &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: group},
		"ThawGroup":                  mustStruct(struct{}{}),
	}
}

// The allow-list is the design's (§2.1), which the CRD's enum repeats.
func TestMethodsAreTheAllowList(t *testing.T) {
	want := []string{"ControllerExpandVolume", "ControllerGetVolume", "ControllerModifyVolume", "CreateSnapshot", "CreateVolume",
		"CreateVolumeGroupSnapshot", "DeleteSnapshot", "DeleteVolume", "DeleteVolumeGroupSnapshot", "FreezeGroupHold", "GetVolumeGroupSnapshot",
		"ListSnapshots", "SnapshotHeld", "ThawGroup", "ValidateVolumeCapabilities"}
	if got := nodecall.Methods(); !slices.Equal(got, want) {
		t.Fatalf("Methods() = %v, want %v", got, want)
	}
	abbrevs := map[string]bool{}
	for _, name := range want {
		m, _ := nodecall.Lookup(name)
		if abbrevs[m.Abbrev] {
			t.Errorf("%s: abbreviation %q used twice", name, m.Abbrev)
		}
		abbrevs[m.Abbrev] = true
	}
	for _, name := range []string{"NodePublishVolume", "ControllerPublishVolume", "Probe", "GetCapacity", "createvolume", ""} {
		if _, ok := nodecall.Lookup(name); ok {
			t.Errorf("Lookup(%q) allowed", name)
		}
		if _, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: name, Target: "x", Request: &csi.DeleteVolumeRequest{}}); err == nil {
			t.Errorf("NewCall(%q) made a call", name)
		}
	}
}

// Every allowed method's request and response survive the codec, minus the secrets, and
// the call's name and text never hold a secret.
func TestCodecRoundTrip(t *testing.T) {
	resps := responses()
	for name, req := range requests() {
		t.Run(name, func(t *testing.T) {
			m, ok := nodecall.Lookup(name)
			if !ok {
				t.Fatalf("%s not allowed", name)
			}
			c, err := nodecall.NewCall(nodecall.Ask{Node: "b", NodeUID: "u1", Method: name, Target: "local.abc", Request: req,
				Issued: time.Now(), NotAfter: time.Now().Add(time.Minute)})
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(c.Spec.Request, secret) || strings.Contains(c.Spec.Request, "password") {
				t.Errorf("request holds a secret: %s", c.Spec.Request)
			}
			if fd := req.ProtoReflect().Descriptor().Fields().ByName("secrets"); fd != nil && req.ProtoReflect().Get(fd).Map().Len() == 0 {
				t.Errorf("the caller's request lost its secrets")
			}
			back, err := m.DecodeRequest(c.Spec.Request)
			if err != nil {
				t.Fatal(err)
			}
			want := proto.Clone(req)
			nodecall.Strip(want)
			if !proto.Equal(back, want) {
				t.Errorf("request round trip:\n got %v\nwant %v", back, want)
			}
			if !strings.HasPrefix(c.Name, m.Abbrev+"-") || len(c.Name) != len(m.Abbrev)+41 {
				t.Errorf("name %q", c.Name)
			}
			if len(c.Spec.Nonce) != 32 || c.Labels[nodecall.MethodLabel] != name || len(c.Labels[nodecall.TargetLabel]) != 40 {
				t.Errorf("nonce %q labels %v", c.Spec.Nonce, c.Labels)
			}
			if len(c.OwnerReferences) != 1 || c.OwnerReferences[0].Kind != "Node" || c.OwnerReferences[0].Name != "b" {
				t.Errorf("owner %v", c.OwnerReferences)
			}
			// Through unstructured, as the API server stores it.
			u, err := c.ToUnstructured()
			if err != nil {
				t.Fatal(err)
			}
			c2, err := nodecall.CallFrom(u)
			if err != nil || c2.Spec.Request != c.Spec.Request || c2.Spec.Method != name || !c2.Spec.Issued.Equal(&c.Spec.Issued) {
				t.Errorf("unstructured round trip: %v %+v", err, c2.Spec)
			}

			resp := resps[name]
			s, err := m.EncodeResponse(resp)
			if err != nil {
				t.Fatal(err)
			}
			rback, err := m.DecodeResponse(s)
			if err != nil || !proto.Equal(rback, resp) {
				t.Errorf("response round trip: %v\n got %v\nwant %v", err, rback, resp)
			}
			// The hold's and the thaw's messages are both Structs.
			if _, err := m.EncodeResponse(req); err == nil && req.ProtoReflect().Descriptor() != resp.ProtoReflect().Descriptor() {
				t.Errorf("a request encoded as the response")
			}
		})
	}
}

// The name is one function of (method, node, request): neither the order of a map nor
// the secrets change it; the node and the method do.
func TestObjectName(t *testing.T) {
	m, _ := nodecall.Lookup("CreateVolume")
	params := map[string]string{}
	for _, k := range strings.Split("abcdefghijklmnopqrstuvwxyz", "") {
		params[k] = k + k
	}
	base, err := m.ObjectName("b", &csi.CreateVolumeRequest{Name: "pvc-1", Parameters: params})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		p := map[string]string{}
		for k, v := range params { // a new map, filled in another order each time
			p[k] = v
		}
		got, _ := m.ObjectName("b", &csi.CreateVolumeRequest{Name: "pvc-1", Parameters: p, Secrets: map[string]string{"k": string(rune('a' + i))}})
		if got != base {
			t.Fatalf("name %s, want %s", got, base)
		}
	}
	for _, tc := range []struct {
		what, method, node string
		req                proto.Message
	}{
		{"another node", "CreateVolume", "c", &csi.CreateVolumeRequest{Name: "pvc-1", Parameters: params}},
		{"another request", "CreateVolume", "b", &csi.CreateVolumeRequest{Name: "pvc-2", Parameters: params}},
		{"node and name run together", "CreateVolume", "bp", &csi.CreateVolumeRequest{Name: "vc-1", Parameters: params}},
	} {
		mm, _ := nodecall.Lookup(tc.method)
		if got, _ := mm.ObjectName(tc.node, tc.req); got == base {
			t.Errorf("%s: same name %s", tc.what, got)
		}
	}
	if _, err := m.ObjectName("b", &csi.DeleteVolumeRequest{}); err == nil {
		t.Error("a DeleteVolumeRequest named as a CreateVolume")
	}
}

func TestCaps(t *testing.T) {
	m, _ := nodecall.Lookup("CreateVolume")
	big := &csi.CreateVolumeRequest{Name: "pvc", Parameters: map[string]string{"x": strings.Repeat("a", nodecall.MaxRequest)}}
	if _, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: "CreateVolume", Target: "t", Request: big}); !errors.Is(err, nodecall.ErrTooLarge) {
		t.Errorf("oversized request: %v", err)
	}
	// Secrets do not count: they are gone before the size is taken.
	withSecret := &csi.CreateVolumeRequest{Name: "pvc", Secrets: map[string]string{"x": strings.Repeat("a", nodecall.MaxRequest)}}
	if _, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: "CreateVolume", Target: "t", Request: withSecret}); err != nil {
		t.Errorf("large secret: %v", err)
	}
	for _, tc := range []struct {
		what string
		ask  nodecall.Ask
	}{
		{"no node", nodecall.Ask{Method: "CreateVolume", Target: "t", Request: &csi.CreateVolumeRequest{}}},
		{"no target", nodecall.Ask{Node: "b", Method: "CreateVolume", Request: &csi.CreateVolumeRequest{}}},
		{"long target", nodecall.Ask{Node: "b", Method: "CreateVolume", Target: strings.Repeat("t", nodecall.MaxTarget+1), Request: &csi.CreateVolumeRequest{}}},
		{"wrong request type", nodecall.Ask{Node: "b", Method: "CreateVolume", Target: "t", Request: &csi.DeleteVolumeRequest{}}},
	} {
		if _, err := nodecall.NewCall(tc.ask); err == nil {
			t.Errorf("%s: made a call", tc.what)
		}
	}
	hostile := []struct{ what, text string }{
		{"over the cap", `{"name":"` + strings.Repeat("a", nodecall.MaxRequest) + `"}`},
		{"wrong type", `{"name":5}`},
		{"not JSON", `name: a`},
	}
	for _, h := range hostile {
		if _, err := m.DecodeRequest(h.text); err == nil {
			t.Errorf("decoded a request %s", h.what)
		}
	}
	// A field of a newer CSI spec (a controller newer than this agent, mid-upgrade) is
	// dropped as gRPC drops it, and the rest of the request stands.
	if req, err := m.DecodeRequest(`{"name":"a","newerField":{"x":1}}`); err != nil || req.(*csi.CreateVolumeRequest).GetName() != "a" {
		t.Errorf("request with a newer field: %v %v", req, err)
	}
	// A secret a hostile writer put in a call is dropped on the way in.
	req, err := m.DecodeRequest(`{"name":"a","secrets":{"k":"v"}}`)
	if err != nil || len(req.(*csi.CreateVolumeRequest).GetSecrets()) != 0 {
		t.Errorf("secrets decoded: %v %v", req, err)
	}
	if _, err := m.EncodeResponse(&csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeContext: map[string]string{"x": strings.Repeat("a", nodecall.MaxResponse)}}}); !errors.Is(err, nodecall.ErrTooLarge) {
		t.Errorf("oversized response: %v", err)
	}
}

func TestStoreConcurrency(t *testing.T) {
	ctx := context.Background()
	s := nodecall.Store{Client: nodecalltest.NewClient(), Namespace: "ns"}
	c, err := nodecall.NewCall(nodecall.Ask{Node: "b", Method: "DeleteVolume", Target: "local.abc", Request: &csi.DeleteVolumeRequest{VolumeId: "local.abc"}})
	if err != nil {
		t.Fatal(err)
	}
	c.Status = nodecall.CallStatus{Phase: nodecall.Done, Nonce: c.Spec.Nonce} // dropped: status is the agent's
	made, err := s.Create(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if made.ResourceVersion == "" || made.Status.Phase != "" {
		t.Fatalf("created %+v", made)
	}
	if _, err := s.Create(ctx, c); !apierrors.IsAlreadyExists(err) {
		t.Errorf("second create: %v", err)
	}

	running := made.DeepCopy()
	running.Status = nodecall.CallStatus{Nonce: made.Spec.Nonce, Phase: nodecall.Running, Attempts: 1}
	running.Spec.Node = "c" // not written: the status subresource
	after, err := s.UpdateStatus(ctx, running)
	if err != nil {
		t.Fatal(err)
	}
	if after.Spec.Node != "b" || after.Status.Phase != nodecall.Running || after.ResourceVersion == made.ResourceVersion {
		t.Errorf("status write: %+v", after)
	}
	// A writer that read the call before is refused, for a status and for a delete.
	stale := made.DeepCopy()
	stale.Status.Phase = nodecall.Done
	if _, err := s.UpdateStatus(ctx, stale); !apierrors.IsConflict(err) {
		t.Errorf("stale status write: %v", err)
	}
	if err := s.Delete(ctx, made.Name, made.ResourceVersion); !apierrors.IsConflict(err) {
		t.Errorf("stale delete: %v", err)
	}
	noRV := after.DeepCopy()
	noRV.ResourceVersion = ""
	if _, err := s.UpdateStatus(ctx, noRV); err == nil {
		t.Error("a status write without a resourceVersion")
	}
	if got, err := s.Get(ctx, made.Name); err != nil || got.Status.Phase != nodecall.Running {
		t.Errorf("get: %+v %v", got, err)
	}
	if l, err := s.List(ctx, "b"); err != nil || len(l) != 1 {
		t.Errorf("list: %v %v", l, err)
	}
	if err := s.Delete(ctx, made.Name, after.ResourceVersion); err != nil {
		t.Errorf("delete: %v", err)
	}
	if _, err := s.Get(ctx, made.Name); !apierrors.IsNotFound(err) {
		t.Errorf("after delete: %v", err)
	}
}

func TestStoreNode(t *testing.T) {
	ctx := context.Background()
	s := nodecall.Store{Client: nodecalltest.NewClient(nodecalltest.Node("b", "uid-b")), Namespace: "ns"}
	uid, err := s.NodeUID(ctx, "b")
	if err != nil || uid != "uid-b" {
		t.Fatalf("NodeUID: %q %v", uid, err)
	}
	n := &nodecall.PoolNode{}
	n.Name = "b"
	n.OwnerReferences = append(n.OwnerReferences, nodecall.NodeOwner("b", string(uid)))
	made, err := s.CreateNode(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	made.Status.Pools = []nodecall.PoolCapacity{{Name: "local", AvailableBytes: 5 << 20, MaximumVolumeSize: 5 << 20, MinimumVolumeSize: 1 << 20, Condition: nodecall.PoolOk}}
	made.Status.Agent = nodecall.AgentInfo{Version: "v", Pod: "p"}
	if _, err := s.UpdateNodeStatus(ctx, made); err != nil {
		t.Fatal(err)
	}
	got, err := s.GetNode(ctx, "b")
	if err != nil || len(got.Status.Pools) != 1 || got.Status.Pools[0] != made.Status.Pools[0] || got.Status.Agent.Pod != "p" {
		t.Errorf("PoolNode %+v %v", got, err)
	}
	if _, err := s.UpdateNodeStatus(ctx, made); !apierrors.IsConflict(err) {
		t.Errorf("stale PoolNode write: %v", err)
	}
}
