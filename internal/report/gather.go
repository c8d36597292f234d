package report

import (
	"context"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/csilegacy"
)

// Options are how Gather asks. The zero value of a field is its default.
type Options struct {
	// Timeout is how long each call may take (default 10 s).
	Timeout time.Duration
	// PageSize is the max_entries of each ListVolumes and
	// ControllerListVolumeHealth page: the driver never builds one huge
	// answer (default 256).
	PageSize int32
	// A listing (ListVolumes, ControllerListVolumeHealth) stops at the first
	// of these caps, noted as a problem: a driver whose listing never ends (a
	// new next_token each page) must not keep status reading until it runs
	// out of memory. The defaults are far above what a real pool lists (1024
	// pages of 256 volumes, or 64 MiB of answers).
	MaxPages, MaxEntries, MaxBytes int
}

// The defaults of Options.
const (
	DefaultTimeout    = 10 * time.Second
	DefaultPageSize   = 256
	DefaultMaxPages   = 1024
	DefaultMaxEntries = 100_000
	DefaultMaxBytes   = 64 << 20
)

func (o Options) withDefaults() Options {
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.PageSize <= 0 {
		o.PageSize = DefaultPageSize
	}
	if o.MaxPages <= 0 {
		o.MaxPages = DefaultMaxPages
	}
	if o.MaxEntries <= 0 {
		o.MaxEntries = DefaultMaxEntries
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	return o
}

// UnreachableError is Gather's error when the socket does not answer
// GetPluginInfo: nothing is known of the driver.
type UnreachableError struct {
	Endpoint string
	// Reason is the failed call's code and message, printable.
	Reason string
	Err    error
}

func (e *UnreachableError) Error() string {
	return fmt.Sprintf("cannot reach the driver at %s: GetPluginInfo: %s", e.Endpoint, e.Reason)
}

func (e *UnreachableError) Unwrap() error { return e.Err }

// listBudget counts what one listing has read against the caps.
type listBudget struct {
	method                string
	pages, entries, bytes int
}

// spend adds one page; false, with the problem noted, once a cap is passed.
func (g *gatherer) spend(b *listBudget, entries int, resp proto.Message) bool {
	b.pages++
	b.entries += entries
	b.bytes += proto.Size(resp)
	o := g.opts
	if b.pages < o.MaxPages && b.entries < o.MaxEntries && b.bytes < o.MaxBytes {
		return true
	}
	g.r.Errors = append(g.r.Errors, fmt.Sprintf("%s: stopped after %d pages, %d entries, %s: status reads at most %d pages, %d entries, %s (does the listing end?)",
		b.method, b.pages, b.entries, HumanBytes(int64(b.bytes)), o.MaxPages, o.MaxEntries, HumanBytes(int64(o.MaxBytes))))
	return false
}

// gatherer asks one socket, each call with its own timeout, and notes the
// calls that fail in the report.
type gatherer struct {
	ctx  context.Context
	opts Options
	r    *Report
}

func (g *gatherer) fail(method string, err error) {
	g.r.Errors = append(g.r.Errors, method+": "+callError(err))
}

// ask makes one call with the gatherer's timeout.
func ask[T any](g *gatherer, call func(context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithTimeout(g.ctx, g.opts.Timeout)
	defer cancel()
	return call(ctx)
}

// callError is a failed call's gRPC code and message.
func callError(err error) string {
	if s, ok := status.FromError(err); ok {
		return s.Code().String() + ": " + s.Message()
	}
	return err.Error()
}

// Gather asks conn everything status shows, and finishes the report
// (Finish). endpoint is only for the report. It fails only when the socket
// does not answer GetPluginInfo (an *UnreachableError); any other failure is
// in the report.
func Gather(ctx context.Context, conn grpc.ClientConnInterface, endpoint string, opts Options) (*Report, error) {
	r := &Report{Endpoint: endpoint}
	g := &gatherer{ctx: ctx, opts: opts.withDefaults(), r: r}
	ids := csi.NewIdentityClient(conn)
	info, err := ask(g, func(ctx context.Context) (*csi.GetPluginInfoResponse, error) {
		return ids.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	})
	if err != nil {
		return nil, &UnreachableError{Endpoint: endpoint, Reason: Printable(callError(err)), Err: err}
	}
	r.Plugin.Name, r.Plugin.Version = info.GetName(), info.GetVendorVersion()
	r.Plugin.Services = []string{"Identity"}
	hasController := false
	if caps, err := ask(g, func(ctx context.Context) (*csi.GetPluginCapabilitiesResponse, error) {
		return ids.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	}); err != nil {
		g.fail("GetPluginCapabilities", err)
	} else {
		for _, c := range caps.GetCapabilities() {
			r.Plugin.Capabilities = append(r.Plugin.Capabilities, pluginCapName(c))
			if c.GetService().GetType() == csi.PluginCapability_Service_CONTROLLER_SERVICE {
				hasController = true
			}
		}
	}
	if probe, err := ask(g, func(ctx context.Context) (*csi.ProbeResponse, error) {
		return ids.Probe(ctx, &csi.ProbeRequest{})
	}); err != nil {
		r.Plugin.ProbeError = callError(err)
	} else {
		// No readiness in the answer is ready, says the spec.
		r.Plugin.Ready = probe.GetReady() == nil || probe.GetReady().GetValue()
	}
	if g.node(csi.NewNodeClient(conn)) {
		r.Plugin.Services = append(r.Plugin.Services, "Node")
	}
	if g.controller(csi.NewControllerClient(conn), hasController) {
		r.Plugin.Services = append(r.Plugin.Services, "Controller")
	}
	r.Finish()
	return r, nil
}

// node fills the node's part of the report and tells whether the socket
// serves the Node service.
func (g *gatherer) node(nc csi.NodeClient) bool {
	n := &g.r.Node
	info, err := ask(g, func(ctx context.Context) (*csi.NodeGetInfoResponse, error) {
		return nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	})
	if status.Code(err) == codes.Unimplemented {
		n.NotServed = "this socket serves no Node service (NodeGetInfo: Unimplemented): a controller's; the node's view is on a node plugin's socket"
		return false
	}
	if err != nil {
		g.fail("NodeGetInfo", err)
	} else {
		n.NodeID, n.MaxVolumes = info.GetNodeId(), info.GetMaxVolumesPerNode()
		n.Topology = info.GetAccessibleTopology().GetSegments()
	}
	n.VolumeHealthNote = nodeVolumeHealthNote
	caps, err := ask(g, func(ctx context.Context) (*csi.NodeGetCapabilitiesResponse, error) {
		return nc.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	})
	if err != nil {
		g.fail("NodeGetCapabilities", err)
		return true
	}
	storageHealth := false
	for _, c := range caps.GetCapabilities() {
		t := c.GetRpc().GetType()
		n.Capabilities = append(n.Capabilities, nodeCapName(t))
		storageHealth = storageHealth || t == csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH
	}
	if !storageHealth {
		n.StorageHealthNote = "not offered (no GET_STORAGE_HEALTH capability)"
		return true
	}
	sh, err := ask(g, func(ctx context.Context) (*csi.NodeGetStorageHealthResponse, error) {
		return nc.NodeGetStorageHealth(ctx, &csi.NodeGetStorageHealthRequest{})
	})
	if err != nil {
		g.fail("NodeGetStorageHealth", err)
		n.StorageHealthNote = "unknown: NodeGetStorageHealth failed"
		return true
	}
	n.StorageHealth = []HealthEntry{}
	for _, b := range sh.GetBackendHealth() {
		n.StorageHealth = append(n.StorageHealth, HealthEntry{Status: b.GetStatus().String(), Reason: b.GetReason(), Message: b.GetMessage()})
	}
	return true
}

// controller fills the controller's part of the report and tells whether the
// socket serves the Controller service.
func (g *gatherer) controller(cc csi.ControllerClient, advertised bool) bool {
	c := &g.r.Controller
	if !advertised {
		c.NotServed = "this socket serves no Controller service (no CONTROLLER_SERVICE capability): a node plugin's; volumes and capacity are on the controller's socket"
		return false
	}
	caps, err := ask(g, func(ctx context.Context) (*csi.ControllerGetCapabilitiesResponse, error) {
		return cc.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	})
	if status.Code(err) == codes.Unimplemented {
		c.NotServed = "this socket serves no Controller service (ControllerGetCapabilities: Unimplemented), although the plugin advertises CONTROLLER_SERVICE"
		return false
	}
	if err != nil {
		g.fail("ControllerGetCapabilities", err)
		c.VolumesNote = "not asked: ControllerGetCapabilities failed (see the problems)"
		c.PoolsNote = c.VolumesNote
		return true
	}
	has := map[csi.ControllerServiceCapability_RPC_Type]bool{}
	for _, cp := range caps.GetCapabilities() {
		t := cp.GetRpc().GetType()
		has[t] = true
		c.Capabilities = append(c.Capabilities, controllerCapName(t))
	}
	if has[csi.ControllerServiceCapability_RPC_LIST_VOLUMES] {
		g.listVolumes(cc)
	} else {
		c.VolumesNote = "not listed: the controller offers no LIST_VOLUMES"
	}
	if has[csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH] {
		g.listVolumeHealth(cc)
	}
	if has[csi.ControllerServiceCapability_RPC_GET_CAPACITY] {
		g.capacity(cc)
	} else {
		c.PoolsNote = "not known: the controller offers no GET_CAPACITY"
	}
	return true
}

// listVolumes reads every page of ListVolumes.
func (g *gatherer) listVolumes(cc csi.ControllerClient) {
	c := &g.r.Controller
	seen := map[string]bool{}
	budget := &listBudget{method: "ListVolumes"}
	for token := ""; ; {
		resp, err := ask(g, func(ctx context.Context) (*csi.ListVolumesResponse, error) {
			return cc.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: g.opts.PageSize, StartingToken: token})
		})
		if err != nil {
			g.fail("ListVolumes", err)
			c.VolumesNote = "incomplete: ListVolumes failed (see the problems)"
			return
		}
		for _, e := range resp.GetEntries() {
			v := e.GetVolume()
			vs := Volume{ID: v.GetVolumeId(), CapacityBytes: v.GetCapacityBytes(), Context: v.GetVolumeContext(),
				Published: e.GetStatus().GetPublishedNodeIds()}
			for _, t := range v.GetAccessibleTopology() {
				vs.Topology = append(vs.Topology, t.GetSegments())
			}
			if st := e.GetStatus(); st != nil {
				if abnormal, msg, ok := csilegacy.Condition(st); ok {
					vs.Abnormal, vs.Condition = abnormal, msg
				}
			}
			c.Volumes = append(c.Volumes, vs)
		}
		token = resp.GetNextToken()
		if token == "" {
			return
		}
		if !g.spend(budget, len(resp.GetEntries()), resp) {
			c.VolumesNote = "incomplete: the listing did not end (see the problems)"
			return
		}
		if seen[token] {
			g.r.Errors = append(g.r.Errors, fmt.Sprintf("ListVolumes: next_token %q came twice: the listing stopped there", token))
			return
		}
		seen[token] = true
	}
}

// listVolumeHealth reads every page of ControllerListVolumeHealth (the
// volumes with an adverse condition) onto the listed volumes.
func (g *gatherer) listVolumeHealth(cc csi.ControllerClient) {
	c := &g.r.Controller
	index := map[string]int{}
	for i, v := range c.Volumes {
		index[v.ID] = i
	}
	seen := map[string]bool{}
	budget := &listBudget{method: "ControllerListVolumeHealth"}
	for token := ""; ; {
		resp, err := ask(g, func(ctx context.Context) (*csi.ControllerListVolumeHealthResponse, error) {
			return cc.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{MaxEntries: g.opts.PageSize, StartingToken: token})
		})
		if err != nil {
			g.fail("ControllerListVolumeHealth", err)
			c.VolumesNote = strings.TrimPrefix(c.VolumesNote+"; ", "; ") + "health incomplete: ControllerListVolumeHealth failed (see the problems)"
			return
		}
		for _, h := range resp.GetEntries() {
			var entries []HealthEntry
			for _, s := range h.GetHealthStatuses() {
				entries = append(entries, HealthEntry{Status: s.GetStatus().String(), Reason: s.GetReason(), Message: s.GetMessage()})
			}
			if len(entries) == 0 {
				continue
			}
			i, ok := index[h.GetVolumeId()]
			if !ok {
				// Made between the two listings, or not listed at all.
				i = len(c.Volumes)
				index[h.GetVolumeId()] = i
				c.Volumes = append(c.Volumes, Volume{ID: h.GetVolumeId(), Unlisted: true})
			}
			c.Volumes[i].Health = append(c.Volumes[i].Health, entries...)
			c.Volumes[i].Abnormal = true
		}
		token = resp.GetNextToken()
		if token == "" {
			return
		}
		if !g.spend(budget, len(resp.GetEntries()), resp) {
			c.VolumesNote = strings.TrimPrefix(c.VolumesNote+"; ", "; ") + "health incomplete: the listing did not end (see the problems)"
			return
		}
		if seen[token] {
			g.r.Errors = append(g.r.Errors, fmt.Sprintf("ControllerListVolumeHealth: next_token %q came twice: the listing stopped there", token))
			return
		}
		seen[token] = true
	}
}

// poolsInMessage finds the configured pools poolcsi names when GetCapacity
// has no pool parameter and it has several pools.
var poolsInMessage = regexp.MustCompile(`\(pools: ([^)]*)\)`)

// capacity asks GetCapacity for each pool. A poolcsi StorageClass selects a
// pool with the parameter "pool" (needed when the driver has several); the
// pools are those the listed volumes name in their volume context, and those
// poolcsi names when a request without parameters is ambiguous. Shares that
// StorageClasses name are not asked: asking would mount them.
func (g *gatherer) capacity(cc csi.ControllerClient) {
	c := &g.r.Controller
	names := map[string]bool{}
	shares := 0
	for _, v := range c.Volumes {
		if v.Context["shareType"] != "" {
			shares++
			continue
		}
		if p := v.Context["pool"]; p != "" {
			names[p] = true
		}
	}
	getCapacity := func(params map[string]string) (*csi.GetCapacityResponse, error) {
		return ask(g, func(ctx context.Context) (*csi.GetCapacityResponse, error) {
			return cc.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: params})
		})
	}
	one, err := getCapacity(nil)
	switch {
	case err == nil && len(names) == 0:
		c.Pools = append(c.Pools, capacityOf("", one))
	case err == nil:
	case status.Code(err) == codes.InvalidArgument:
		if m := poolsInMessage.FindStringSubmatch(status.Convert(err).Message()); m != nil {
			for _, n := range strings.Split(m[1], ",") {
				if n = strings.TrimSpace(n); n != "" {
					names[n] = true
				}
			}
		}
		if len(names) == 0 {
			c.PoolsNote = "no pool found to ask (GetCapacity without parameters: " + callError(err) + ")"
		}
	default:
		g.fail("GetCapacity", err)
	}
	for _, n := range slices.Sorted(maps.Keys(names)) {
		resp, err := getCapacity(map[string]string{"pool": n})
		if err != nil {
			c.Pools = append(c.Pools, PoolCapacity{Pool: n, Error: callError(err)})
			continue
		}
		c.Pools = append(c.Pools, capacityOf(n, resp))
	}
	if shares > 0 {
		c.PoolsNote = strings.TrimPrefix(c.PoolsNote+"; ", "; ") + "the shares StorageClasses name are not asked (asking would mount them)"
	}
}

func capacityOf(pool string, r *csi.GetCapacityResponse) PoolCapacity {
	pc := PoolCapacity{Pool: pool, AvailableBytes: r.GetAvailableCapacity()}
	if m := r.GetMaximumVolumeSize(); m != nil {
		pc.MaximumVolumeBytes = &m.Value
	}
	if m := r.GetMinimumVolumeSize(); m != nil {
		pc.MinimumVolumeBytes = &m.Value
	}
	return pc
}

func pluginCapName(c *csi.PluginCapability) string {
	switch {
	case c.GetService() != nil:
		return c.GetService().GetType().String()
	case c.GetVolumeExpansion() != nil:
		return c.GetVolumeExpansion().GetType().String() + " expansion"
	}
	return "unknown"
}

func controllerCapName(t csi.ControllerServiceCapability_RPC_Type) string {
	if t == csilegacy.ControllerVolumeCondition {
		return "VOLUME_CONDITION (v1.12)"
	}
	return t.String()
}

func nodeCapName(t csi.NodeServiceCapability_RPC_Type) string {
	if t == csilegacy.NodeVolumeCondition {
		return "VOLUME_CONDITION (v1.12)"
	}
	return t.String()
}
