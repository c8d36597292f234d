package central

// Stand-in until call39/server39 merge; the lead deletes this file.
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
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// NodeView is a stand-in (nodes.go).
type NodeView struct{ inf cache.SharedIndexInformer }

// NewNodeView is a stand-in (nodes.go).
func NewNodeView(inf cache.SharedIndexInformer, staleAfter time.Duration, clk clock.Clock) *NodeView {
	return &NodeView{inf: inf}
}

// Live is a stand-in: no node is live.
func (v *NodeView) Live(string) (bool, time.Duration) { return false, 0 }

// Known is a stand-in.
func (v *NodeView) Known() []string { return nil }

// Pools is a stand-in.
func (v *NodeView) Pools(string) []nodecall.PoolCapacity { return nil }

// Synced is the informer's.
func (v *NodeView) Synced() bool { return v.inf.HasSynced() }

// ChannelDeps is a stand-in (call.go).
type ChannelDeps struct {
	Store            nodecall.Store
	Calls            cache.SharedIndexInformer
	Nodes            Nodes
	NodeUID          func(ctx context.Context, node string) (string, error)
	Clock            clock.Clock
	Pickup, Lifetime time.Duration
}

// Channel is a stand-in (call.go).
type Channel struct{}

// NewChannel is a stand-in (call.go).
func NewChannel(d ChannelDeps) *Channel { return &Channel{} }

// Call is a stand-in: UNIMPLEMENTED.
func (c *Channel) Call(context.Context, string, string, string, proto.Message) (proto.Message, error) {
	return nil, status.Error(codes.Unimplemented, "central: stand-in channel")
}

// Sweeper is a stand-in (sweep.go).
type Sweeper struct{}

// NewSweeper is a stand-in (sweep.go).
func NewSweeper(store nodecall.Store, calls cache.SharedIndexInformer, clk clock.Clock) *Sweeper {
	return &Sweeper{}
}

// Run waits for ctx.
func (s *Sweeper) Run(ctx context.Context) error { <-ctx.Done(); return nil }

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

var (
	_ Nodes  = (*NodeView)(nil)
	_ Caller = (*Channel)(nil)
	_ Hints  = (*HintIndex)(nil)
)
