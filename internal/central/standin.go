package central

// Stand-in until server39 merges; the lead deletes this file.
//
// These are the signatures cmd/poolcsi (--local-central) wires, so that the wiring
// builds and its tests run before the real NodeView, Channel, Sweeper, Server and
// HintIndex land. Nothing here works: calls answer UNIMPLEMENTED, the views know nothing,
// the runners wait for their context.

import (
	"context"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
)

// Server is a stand-in (server.go): GetPluginInfo only, the rest UNIMPLEMENTED.
type Server struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedGroupControllerServer
	d Deps
}

// NewServer is a stand-in (server.go).
func NewServer(d Deps) *Server { return &Server{d: d} }

// Register registers the three services on g.
func (s *Server) Register(g grpc.ServiceRegistrar) {
	csi.RegisterIdentityServer(g, s)
	csi.RegisterControllerServer(g, s)
	csi.RegisterGroupControllerServer(g, s)
}

// GetPluginInfo answers the driver's name and version.
func (s *Server) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.d.Name, VendorVersion: s.d.Version}, nil
}

// HintsDeps is a stand-in (locate.go).
type HintsDeps struct {
	Client              dynamic.Interface
	Driver, TopologyKey string
	Discovery           discovery.DiscoveryInterface
	Resync              time.Duration
}

// HintIndex is a stand-in (locate.go).
type HintIndex struct{}

// NewHints is a stand-in (locate.go).
func NewHints(d HintsDeps) *HintIndex { return &HintIndex{} }

// VolumeNode is a stand-in.
func (h *HintIndex) VolumeNode(string) (string, bool) { return "", false }

// SnapshotNode is a stand-in.
func (h *HintIndex) SnapshotNode(string) (string, bool) { return "", false }

// GroupNode is a stand-in.
func (h *HintIndex) GroupNode(string) (string, bool) { return "", false }

// Learn is a stand-in.
func (h *HintIndex) Learn(string, string) {}

// Synced is a stand-in: always.
func (h *HintIndex) Synced() bool { return true }

// Run waits for ctx.
func (h *HintIndex) Run(ctx context.Context) error { <-ctx.Done(); return nil }

var _ Hints = (*HintIndex)(nil)
