package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"regexp"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/csilegacy"
)

const statusSynopsis = `status [--endpoint unix:///path/csi.sock] [--timeout D] [-o text|json]

Shows what the driver on a CSI socket answers, for an operator on a node: the
plugin (GetPluginInfo, its capabilities, Probe), the node (NodeGetInfo, its
capabilities, the pools' health as the node sees them), each pool's capacity
(GetCapacity) and every volume (ListVolumes, all pages: size, pool and layout,
where it can be used and whom it is published to, its health), abnormal volumes
last, then the problems and a summary line. It makes only calls that change
nothing, through the socket alone, so it works on a controller's socket, a node
plugin's or an all-in-one one, and says what a socket does not serve.

Exit status: 0 all is well; 1 the socket cannot be reached (or a flag is wrong);
2 the driver answers and something is abnormal (listed under "problems").`

// errAbnormal makes `status` exit 2 without a second message: what is
// abnormal was printed.
var errAbnormal = errors.New("something is abnormal")

// statusPageSize is the max_entries of each ListVolumes and
// ControllerListVolumeHealth page: the driver never builds one huge answer.
// A variable for the tests.
var statusPageSize int32 = 256

// A listing status reads (ListVolumes, ControllerListVolumeHealth) stops at the
// first of these, noted as a problem: a driver whose listing never ends (a new
// next_token each page) must not keep status reading until it runs out of
// memory. Far above what a real pool lists (256 pages of 256 volumes, or 64 MiB
// of answers). Variables for the tests.
var (
	statusMaxPages   = 1024
	statusMaxEntries = 100_000
	statusMaxBytes   = 64 << 20
)

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
	if b.pages < statusMaxPages && b.entries < statusMaxEntries && b.bytes < statusMaxBytes {
		return true
	}
	g.r.Errors = append(g.r.Errors, fmt.Sprintf("%s: stopped after %d pages, %d entries, %s: status reads at most %d pages, %d entries, %s (does the listing end?)",
		b.method, b.pages, b.entries, humanBytes(int64(b.bytes)), statusMaxPages, statusMaxEntries, humanBytes(int64(statusMaxBytes))))
	return false
}

// nodeVolumeHealthNote says why status shows no node-side volume health.
const nodeVolumeHealthNote = "not shown: the node checks a volume at its staging or publish path, which no CSI call lists " +
	`(kubelet asks for each volume it mounted); for one: poolcsi call NodeGetVolumeStats '{"volume_id": "…", "volume_path": "…"}'`

// statusReport is everything status found, the same facts for the text and
// the JSON output.
type statusReport struct {
	Endpoint   string           `json:"endpoint"`
	Plugin     pluginStatus     `json:"plugin"`
	Node       nodeStatus       `json:"node"`
	Controller controllerStatus `json:"controller"`
	// Errors are the calls that failed, each "Method: Code: message".
	Errors   []string      `json:"errors,omitempty"`
	Problems []string      `json:"problems"`
	Summary  statusSummary `json:"summary"`
}

type pluginStatus struct {
	Name         string   `json:"name"`
	Version      string   `json:"version"`
	Services     []string `json:"services"`
	Capabilities []string `json:"capabilities"`
	Ready        bool     `json:"ready"`
	ProbeError   string   `json:"probe_error,omitempty"`
}

// nodeStatus is what the Node service answered; NotServed says why nothing.
type nodeStatus struct {
	NotServed         string            `json:"not_served,omitempty"`
	NodeID            string            `json:"node_id,omitempty"`
	MaxVolumes        int64             `json:"max_volumes_per_node"`
	Topology          map[string]string `json:"topology,omitempty"`
	Capabilities      []string          `json:"capabilities,omitempty"`
	StorageHealth     []healthEntry     `json:"storage_health"`
	StorageHealthNote string            `json:"storage_health_note,omitempty"`
	VolumeHealthNote  string            `json:"volume_health_note,omitempty"`
}

// controllerStatus is what the Controller service answered; NotServed says
// why nothing.
type controllerStatus struct {
	NotServed    string         `json:"not_served,omitempty"`
	Capabilities []string       `json:"capabilities,omitempty"`
	Pools        []poolCapacity `json:"pools,omitempty"`
	PoolsNote    string         `json:"pools_note,omitempty"`
	Volumes      []volumeStatus `json:"volumes,omitempty"`
	VolumesNote  string         `json:"volumes_note,omitempty"`
}

// poolCapacity is GetCapacity's answer for one pool. Pool is empty for the
// answer to a request without parameters, from a driver with one pool.
type poolCapacity struct {
	Pool               string `json:"pool"`
	AvailableBytes     int64  `json:"available_bytes"`
	MaximumVolumeBytes *int64 `json:"maximum_volume_bytes,omitempty"`
	MinimumVolumeBytes *int64 `json:"minimum_volume_bytes,omitempty"`
	Error              string `json:"error,omitempty"`
}

type volumeStatus struct {
	ID            string              `json:"volume_id"`
	CapacityBytes int64               `json:"capacity_bytes"`
	Context       map[string]string   `json:"volume_context,omitempty"`
	Topology      []map[string]string `json:"accessible_topology,omitempty"`
	Published     []string            `json:"published_node_ids,omitempty"`
	Abnormal      bool                `json:"abnormal"`
	// Condition is the message of the volume_condition ListVolumes carries
	// (CSI ≤ v1.12, which kubelet and the health monitor read).
	Condition string `json:"condition,omitempty"`
	// Health is what ControllerListVolumeHealth (CSI v1.13) said of it.
	Health []healthEntry `json:"health,omitempty"`
	// Unlisted: ControllerListVolumeHealth named it, ListVolumes did not.
	Unlisted bool `json:"unlisted,omitempty"`
}

type healthEntry struct {
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message,omitempty"`
}

type statusSummary struct {
	Volumes          int   `json:"volumes"`
	Abnormal         int   `json:"abnormal_volumes"`
	ProvisionedBytes int64 `json:"provisioned_bytes"`
	Pools            int   `json:"pools"`
	Problems         int   `json:"problems"`
}

func statusCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", statusSynopsis, stderr)
	endpoint := fs.String("endpoint", "unix:///csi/csi.sock", "the driver's CSI socket")
	timeout := fs.Duration("timeout", 10*time.Second, "how long each call may take")
	output := fs.String("o", "text", "output format: text or json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *output != "text" && *output != "json" {
		return fmt.Errorf("status: -o %q: want text or json", *output)
	}
	conn, err := grpc.NewClient(*endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	defer func() { _ = conn.Close() }()
	r, err := gatherStatus(ctx, conn, *endpoint, *timeout)
	if err != nil {
		return err
	}
	if *output == "json" {
		err = writeStatusJSON(stdout, r)
	} else {
		err = writeStatusText(stdout, r)
	}
	if err != nil {
		return err
	}
	if len(r.Problems) > 0 {
		return errAbnormal
	}
	return nil
}

// gatherer asks one socket, each call with its own timeout, and notes the
// calls that fail in the report.
type gatherer struct {
	ctx     context.Context
	timeout time.Duration
	r       *statusReport
}

func (g *gatherer) fail(method string, err error) {
	g.r.Errors = append(g.r.Errors, method+": "+callError(err))
}

// ask makes one call with the gatherer's timeout.
func ask[T any](g *gatherer, call func(context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithTimeout(g.ctx, g.timeout)
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

// gatherStatus asks the socket everything status shows. It fails only when
// the socket does not answer GetPluginInfo; any other failure is in the report.
func gatherStatus(ctx context.Context, conn grpc.ClientConnInterface, endpoint string, timeout time.Duration) (*statusReport, error) {
	r := &statusReport{Endpoint: endpoint}
	g := &gatherer{ctx: ctx, timeout: timeout, r: r}
	ids := csi.NewIdentityClient(conn)
	info, err := ask(g, func(ctx context.Context) (*csi.GetPluginInfoResponse, error) {
		return ids.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	})
	if err != nil {
		return nil, fmt.Errorf("status: cannot reach the driver at %s: GetPluginInfo: %s (is the driver running, and is this its --endpoint? The chart's containers serve unix:///csi/csi.sock)", endpoint, printable(callError(err)))
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
	r.finish()
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
	n.StorageHealth = []healthEntry{}
	for _, b := range sh.GetBackendHealth() {
		n.StorageHealth = append(n.StorageHealth, healthEntry{Status: b.GetStatus().String(), Reason: b.GetReason(), Message: b.GetMessage()})
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
			return cc.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: statusPageSize, StartingToken: token})
		})
		if err != nil {
			g.fail("ListVolumes", err)
			c.VolumesNote = "incomplete: ListVolumes failed (see the problems)"
			return
		}
		for _, e := range resp.GetEntries() {
			v := e.GetVolume()
			vs := volumeStatus{ID: v.GetVolumeId(), CapacityBytes: v.GetCapacityBytes(), Context: v.GetVolumeContext(),
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
			return cc.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{MaxEntries: statusPageSize, StartingToken: token})
		})
		if err != nil {
			g.fail("ControllerListVolumeHealth", err)
			c.VolumesNote = strings.TrimPrefix(c.VolumesNote+"; ", "; ") + "health incomplete: ControllerListVolumeHealth failed (see the problems)"
			return
		}
		for _, h := range resp.GetEntries() {
			var entries []healthEntry
			for _, s := range h.GetHealthStatuses() {
				entries = append(entries, healthEntry{Status: s.GetStatus().String(), Reason: s.GetReason(), Message: s.GetMessage()})
			}
			if len(entries) == 0 {
				continue
			}
			i, ok := index[h.GetVolumeId()]
			if !ok {
				// Made between the two listings, or not listed at all.
				i = len(c.Volumes)
				index[h.GetVolumeId()] = i
				c.Volumes = append(c.Volumes, volumeStatus{ID: h.GetVolumeId(), Unlisted: true})
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
			c.Pools = append(c.Pools, poolCapacity{Pool: n, Error: callError(err)})
			continue
		}
		c.Pools = append(c.Pools, capacityOf(n, resp))
	}
	if shares > 0 {
		c.PoolsNote = strings.TrimPrefix(c.PoolsNote+"; ", "; ") + "the shares StorageClasses name are not asked (asking would mount them)"
	}
}

func capacityOf(pool string, r *csi.GetCapacityResponse) poolCapacity {
	pc := poolCapacity{Pool: pool, AvailableBytes: r.GetAvailableCapacity()}
	if m := r.GetMaximumVolumeSize(); m != nil {
		pc.MaximumVolumeBytes = &m.Value
	}
	if m := r.GetMinimumVolumeSize(); m != nil {
		pc.MinimumVolumeBytes = &m.Value
	}
	return pc
}

// finish sorts the volumes, healthy first and abnormal last, and derives the
// problems and the summary from what was gathered.
func (r *statusReport) finish() {
	c := &r.Controller
	sort.SliceStable(c.Volumes, func(i, j int) bool {
		a, b := c.Volumes[i], c.Volumes[j]
		if a.Abnormal != b.Abnormal {
			return !a.Abnormal
		}
		return a.ID < b.ID
	})
	var p []string
	p = append(p, r.Errors...)
	switch {
	case r.Plugin.ProbeError != "":
		p = append(p, "Probe: "+r.Plugin.ProbeError)
	case !r.Plugin.Ready:
		p = append(p, "Probe: the plugin says it is not ready")
	}
	for _, h := range r.Node.StorageHealth {
		p = append(p, "storage "+h.String())
	}
	s := statusSummary{}
	for _, pc := range c.Pools {
		if pc.Error != "" {
			p = append(p, fmt.Sprintf("pool %s: GetCapacity: %s", pc.Pool, pc.Error))
			continue
		}
		s.Pools++
	}
	for _, v := range c.Volumes {
		s.Volumes++
		s.ProvisionedBytes += v.CapacityBytes
		if !v.Abnormal {
			continue
		}
		s.Abnormal++
		switch {
		case len(v.Health) > 0:
			for _, h := range v.Health {
				p = append(p, "volume "+v.ID+": "+h.String())
			}
		case v.Condition != "":
			p = append(p, "volume "+v.ID+": "+v.Condition)
		default:
			p = append(p, "volume "+v.ID+": abnormal")
		}
	}
	r.Problems = p
	if r.Problems == nil {
		r.Problems = []string{}
	}
	s.Problems = len(p)
	r.Summary = s
}

func (h healthEntry) String() string {
	s := h.Status + " " + h.Reason
	if h.Message != "" {
		s += ": " + h.Message
	}
	return s
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

// The VOLUME_CONDITION capabilities of CSI ≤ v1.12, reserved in v1.13.
const (
	legacyControllerVolumeCondition = csi.ControllerServiceCapability_RPC_Type(11)
	legacyNodeVolumeCondition       = csi.NodeServiceCapability_RPC_Type(4)
)

func controllerCapName(t csi.ControllerServiceCapability_RPC_Type) string {
	if t == legacyControllerVolumeCondition {
		return "VOLUME_CONDITION (v1.12)"
	}
	return t.String()
}

func nodeCapName(t csi.NodeServiceCapability_RPC_Type) string {
	if t == legacyNodeVolumeCondition {
		return "VOLUME_CONDITION (v1.12)"
	}
	return t.String()
}

func writeStatusJSON(w io.Writer, r *statusReport) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return err
	}
	_, err := w.Write(escapeJSON(b.Bytes()))
	return err
}

// writeStatusText renders the report for a person: sections of aligned
// "key: value" lines and tables, abnormal volumes marked "!" and last.
func writeStatusText(out io.Writer, r *statusReport) error {
	r = printableCopy(r) // every string in it is the driver's, or holds the driver's
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	p := r.Plugin
	fmt.Fprintf(w, "Plugin %s %s at %s\n", p.Name, p.Version, r.Endpoint)
	probe := "ready"
	switch {
	case p.ProbeError != "":
		probe = "! failed: " + p.ProbeError
	case !p.Ready:
		probe = "! not ready"
	}
	fmt.Fprintf(w, "  probe:\t%s\n", probe)
	fmt.Fprintf(w, "  services:\t%s\n", strings.Join(p.Services, ", "))
	fmt.Fprintf(w, "  capabilities:\t%s\n", orDash(strings.Join(p.Capabilities, ", ")))

	n := r.Node
	fmt.Fprintln(w, "\nNode")
	if n.NotServed != "" {
		fmt.Fprintf(w, "  %s\n", n.NotServed)
	} else {
		fmt.Fprintf(w, "  node ID:\t%s\n", orDash(n.NodeID))
		fmt.Fprintf(w, "  max volumes:\t%s\n", maxVolumes(n.MaxVolumes))
		fmt.Fprintf(w, "  topology:\t%s\n", orDash(segments(n.Topology)))
		fmt.Fprintf(w, "  capabilities:\t%s\n", orDash(strings.Join(n.Capabilities, ", ")))
		fmt.Fprintf(w, "  storage health:\t%s\n", storageHealth(n))
		fmt.Fprintf(w, "  volume health:\t%s\n", n.VolumeHealthNote)
	}

	c := r.Controller
	fmt.Fprintln(w, "\nController")
	if c.NotServed != "" {
		fmt.Fprintf(w, "  %s\n", c.NotServed)
	} else {
		fmt.Fprintf(w, "  capabilities:\t%s\n", orDash(strings.Join(c.Capabilities, ", ")))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if c.NotServed == "" {
		writePools(w, c)
		writeVolumes(w, c)
	}
	if len(r.Problems) > 0 {
		fmt.Fprintf(w, "\nProblems (%d)\n", len(r.Problems))
		for _, pr := range r.Problems {
			fmt.Fprintf(w, "  ! %s\n", pr)
		}
	}
	fmt.Fprintf(w, "\n%s\n", summaryLine(r))
	return w.Flush()
}

func writePools(w *tabwriter.Writer, c controllerStatus) {
	fmt.Fprintln(w, "\nPools (GetCapacity)")
	if len(c.Pools) > 0 {
		fmt.Fprintln(w, "  POOL\tAVAILABLE\tLARGEST NEW VOLUME\tSMALLEST")
	}
	for _, pc := range c.Pools {
		name := pc.Pool
		if name == "" {
			name = "(the only pool)"
		}
		if pc.Error != "" {
			fmt.Fprintf(w, "! %s\t?\t?\t?\n", name)
			continue
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\n", name, humanBytes(pc.AvailableBytes), optBytes(pc.MaximumVolumeBytes), optBytes(pc.MinimumVolumeBytes))
	}
	if c.PoolsNote != "" {
		fmt.Fprintf(w, "  %s\n", c.PoolsNote)
	}
	_ = w.Flush()
}

func writeVolumes(w *tabwriter.Writer, c controllerStatus) {
	fmt.Fprintf(w, "\nVolumes (ListVolumes): %d\n", len(c.Volumes))
	if len(c.Volumes) > 0 {
		fmt.Fprintln(w, "  VOLUME\tPOOL\tLAYOUT\tSIZE\tACCESSIBLE FROM\tPUBLISHED TO\tCONTEXT\tHEALTH")
	}
	for _, v := range c.Volumes {
		mark := " "
		if v.Abnormal {
			mark = "!"
		}
		size := humanBytes(v.CapacityBytes)
		if v.CapacityBytes == 0 {
			size = "?" // 0 is unknown in CSI
		}
		fmt.Fprintf(w, "%s %s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", mark, v.ID, orDash(v.Context["pool"]), orDash(v.Context["layout"]),
			size, accessibleFrom(v), orDash(strings.Join(v.Published, ",")), orDash(otherContext(v.Context)), volumeHealth(v))
	}
	if c.VolumesNote != "" {
		fmt.Fprintf(w, "  %s\n", c.VolumesNote)
	}
	_ = w.Flush()
}

func maxVolumes(n int64) string {
	if n <= 0 {
		return "no limit"
	}
	return fmt.Sprint(n)
}

func optBytes(n *int64) string {
	if n == nil {
		return "-"
	}
	return humanBytes(*n)
}

// segments is a topology as k=v pairs, by key.
func segments(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, ",")
}

// accessibleFrom is where a volume can be used: poolcsi's node topology as
// the node's name, any other as k=v; none is every node.
func accessibleFrom(v volumeStatus) string {
	if v.Unlisted {
		return "?"
	}
	var parts []string
	for _, t := range v.Topology {
		if node, ok := t["topology.poolcsi.io/node"]; ok && len(t) == 1 {
			parts = append(parts, node)
		} else {
			parts = append(parts, segments(t))
		}
	}
	if len(parts) == 0 {
		return "any node"
	}
	return strings.Join(parts, " or ")
}

// otherContext is the volume context but for pool and layout, which have
// their own columns.
func otherContext(m map[string]string) string {
	rest := map[string]string{}
	for k, v := range m {
		if k != "pool" && k != "layout" {
			rest[k] = v
		}
	}
	return strings.ReplaceAll(segments(rest), ",", " ")
}

func volumeHealth(v volumeStatus) string {
	if !v.Abnormal {
		return "ok"
	}
	var reasons []string
	for _, h := range v.Health {
		if !slices.Contains(reasons, h.Reason) {
			reasons = append(reasons, h.Reason)
		}
	}
	if len(reasons) == 0 {
		return "ABNORMAL"
	}
	return "ABNORMAL: " + strings.Join(reasons, ", ")
}

func storageHealth(n nodeStatus) string {
	switch {
	case n.StorageHealthNote != "":
		return n.StorageHealthNote
	case len(n.StorageHealth) == 0:
		return "healthy (NodeGetStorageHealth)"
	}
	var parts []string
	for _, h := range n.StorageHealth {
		parts = append(parts, h.Status+" "+h.Reason)
	}
	return "! " + strings.Join(parts, ", ")
}

// summaryLine is the last line: counts a script can read at a glance.
func summaryLine(r *statusReport) string {
	s := r.Summary
	var b strings.Builder
	if r.Controller.NotServed != "" {
		b.WriteString("no volumes or capacity on this socket (no Controller service)")
	} else {
		fmt.Fprintf(&b, "%s (%s), %d abnormal", count(s.Volumes, "volume"), humanBytes(s.ProvisionedBytes), s.Abnormal)
		// Each pool's own: pools often share a filesystem, a sum would count its space twice.
		var free []string
		for _, pc := range r.Controller.Pools {
			if pc.Error == "" {
				free = append(free, strings.TrimSpace(pc.Pool+" "+humanBytes(pc.AvailableBytes)))
			}
		}
		if len(free) == 0 {
			b.WriteString("; capacity unknown")
		} else {
			b.WriteString("; available: " + strings.Join(free, ", "))
		}
	}
	if s.Problems == 0 {
		b.WriteString("; no problems")
	} else {
		b.WriteString("; " + count(s.Problems, "problem"))
	}
	return b.String()
}

// count is n things, in the plural unless one.
func count(n int, thing string) string {
	if n == 1 {
		return "1 " + thing
	}
	return fmt.Sprintf("%d %ss", n, thing)
}
