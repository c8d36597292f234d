package central

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/lru"
)

// The hints (docs/design/central-controller.md §4): where the Kubernetes objects that
// name an ID say it is, and the answers of calls that were done.

var (
	// PVsResource is the PersistentVolume API.
	PVsResource = schema.GroupVersionResource{Version: "v1", Resource: "persistentvolumes"}
	// ContentsResource and GroupContentsResource are the snapshot contents' APIs, as
	// internal/snapclaim watches them.
	ContentsResource      = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotcontents"}
	GroupContentsResource = schema.GroupVersionResource{Group: "groupsnapshot.storage.k8s.io", Version: "v1", Resource: "volumegroupsnapshotcontents"}
)

// managedByLabel names the node whose per-node csi-snapshotter took a content (every
// content of the per-node era has it; internal/snapclaim sets it to the node's name).
const managedByLabel = "snapshot.storage.kubernetes.io/managed-by"

// learntHints is how many answers of done calls are kept.
const learntHints = 10000

// byHandle indexes the trimmed objects by the IDs they name.
const byHandle = "central.handle"

// The fields a trimmed object keeps, beside its name and resourceVersion.
const (
	// The lists are []any of strings, JSON values as unstructured objects hold them (a
	// deep copy of a []string would panic).
	hintHandles = "handles" // the IDs it names
	hintNode    = "node"    // a PV's node-affinity node, a content's managed-by label
	hintSources = "sources" // a content's source volume IDs
	hintTrimmed = "trimmed" // set once trimmed (a transform may see an object twice)
)

// HintsDeps is what the hints read.
type HintsDeps struct {
	Client dynamic.Interface
	// Driver is the local driver's name: only its PVs and contents are hints.
	Driver string
	// TopologyKey is the node key of a PV's node affinity (topology.poolcsi.io/node).
	TopologyKey string
	// Discovery tells whether the snapshot contents' CRDs exist; nil: no content
	// informers.
	Discovery discovery.DiscoveryInterface
	// Resync is the informers' resync period (0: none).
	Resync time.Duration
}

// HintIndex is the Hints of informers on PVs and snapshot contents, each object trimmed
// to the IDs it names and the node it says, and an LRU of answers learnt.
type HintIndex struct {
	d      HintsDeps
	learnt *lru.Cache

	mu                    sync.Mutex
	pvs, contents, groups cache.SharedIndexInformer // nil until Run made them
}

var _ Hints = (*HintIndex)(nil)

// NewHints returns the hints; Run runs their informers.
func NewHints(d HintsDeps) *HintIndex {
	return &HintIndex{d: d, learnt: lru.New(learntHints)}
}

// Run runs the informers until ctx ends. The content informers run only if discovery
// finds their CRDs when Run starts (an informer on a missing resource would log its
// failure to list forever), as csi-snapshotter decides for its own run.
func (h *HintIndex) Run(ctx context.Context) error {
	f := dynamicinformer.NewDynamicSharedInformerFactory(h.d.Client, h.d.Resync)
	pvs, err := h.informer(f, PVsResource, h.trimPV)
	if err != nil {
		return err
	}
	var contents, groups cache.SharedIndexInformer
	if h.served(ctx, ContentsResource) {
		if contents, err = h.informer(f, ContentsResource, h.trimContent); err != nil {
			return err
		}
		if h.served(ctx, GroupContentsResource) {
			if groups, err = h.informer(f, GroupContentsResource, h.trimGroupContent); err != nil {
				return err
			}
		}
	}
	h.mu.Lock()
	h.pvs, h.contents, h.groups = pvs, contents, groups
	h.mu.Unlock()
	f.Start(ctx.Done())
	<-ctx.Done()
	f.Shutdown()
	return nil
}

func (h *HintIndex) informer(f dynamicinformer.DynamicSharedInformerFactory, r schema.GroupVersionResource, trim func(*unstructured.Unstructured) map[string]any) (cache.SharedIndexInformer, error) {
	inf := f.ForResource(r).Informer()
	if err := inf.SetTransform(func(obj any) (any, error) {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok || u.Object[hintTrimmed] != nil {
			return obj, nil // a tombstone, or trimmed already
		}
		out := trim(u)
		out[hintTrimmed] = true
		out["metadata"] = map[string]any{"name": u.GetName(), "namespace": u.GetNamespace(), "resourceVersion": u.GetResourceVersion(), "uid": string(u.GetUID())}
		return &unstructured.Unstructured{Object: out}, nil
	}); err != nil {
		return nil, fmt.Errorf("%s informer: %w", r.Resource, err)
	}
	if err := inf.AddIndexers(cache.Indexers{byHandle: func(obj any) ([]string, error) {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return nil, nil
		}
		return stringList(u.Object[hintHandles]), nil
	}}); err != nil {
		return nil, fmt.Errorf("%s informer: %w", r.Resource, err)
	}
	return inf, nil
}

// served asks discovery whether r exists.
func (h *HintIndex) served(ctx context.Context, r schema.GroupVersionResource) bool {
	log := klog.FromContext(ctx)
	if h.d.Discovery == nil {
		return false
	}
	gv := r.GroupVersion().String()
	list, err := h.d.Discovery.ServerResourcesForGroupVersion(gv)
	if err != nil && !apierrors.IsNotFound(err) {
		log.Error(err, "No hints from snapshot contents: cannot tell whether the API server serves them; restart to retry", "groupVersion", gv)
		return false
	}
	if err == nil {
		for _, res := range list.APIResources {
			if res.Name == r.Resource {
				return true
			}
		}
	}
	log.Info("No hints from snapshot contents: their CRD is not installed; restart once it is (calls about them ask every node)", "resource", r.Resource, "groupVersion", gv)
	return false
}

// trimPV keeps a PV of the driver's handle and the node of its node affinity.
func (h *HintIndex) trimPV(u *unstructured.Unstructured) map[string]any {
	out := map[string]any{}
	if d, _, _ := unstructured.NestedString(u.Object, "spec", "csi", "driver"); d != h.d.Driver {
		return out
	}
	handle, _, _ := unstructured.NestedString(u.Object, "spec", "csi", "volumeHandle")
	if handle == "" {
		return out
	}
	out[hintHandles] = []any{handle}
	terms, _, _ := unstructured.NestedSlice(u.Object, "spec", "nodeAffinity", "required", "nodeSelectorTerms")
	if n := h.affinityNode(terms); n != "" {
		out[hintNode] = n
	}
	return out
}

// affinityNode is the one node the terms name by the topology key: every term that
// names the key names the same single node (terms are ORed: two nodes would be a guess).
func (h *HintIndex) affinityNode(terms []any) string {
	node := ""
	for _, t := range terms {
		term, _ := t.(map[string]any)
		exprs, _, _ := unstructured.NestedSlice(term, "matchExpressions")
		for _, e := range exprs {
			expr, _ := e.(map[string]any)
			key, _, _ := unstructured.NestedString(expr, "key")
			op, _, _ := unstructured.NestedString(expr, "operator")
			values, _, _ := unstructured.NestedStringSlice(expr, "values")
			if key != h.d.TopologyKey {
				continue
			}
			if op != "In" || len(values) != 1 || (node != "" && node != values[0]) {
				return ""
			}
			node = values[0]
		}
	}
	return node
}

// trimContent keeps a VolumeSnapshotContent of the driver's snapshot handles, its
// source volume and its managed-by label.
func (h *HintIndex) trimContent(u *unstructured.Unstructured) map[string]any {
	out := map[string]any{}
	if d, _, _ := unstructured.NestedString(u.Object, "spec", "driver"); d != h.d.Driver {
		return out
	}
	var handles []any
	for _, path := range [][]string{{"status", "snapshotHandle"}, {"spec", "source", "snapshotHandle"}} {
		if s, _, _ := unstructured.NestedString(u.Object, path...); s != "" {
			handles = append(handles, s)
		}
	}
	out[hintHandles] = handles
	if v, _, _ := unstructured.NestedString(u.Object, "spec", "source", "volumeHandle"); v != "" {
		out[hintSources] = []any{v}
	}
	if n := u.GetLabels()[managedByLabel]; n != "" {
		out[hintNode] = n
	}
	return out
}

// trimGroupContent keeps a VolumeGroupSnapshotContent of the driver's group handles,
// its source volumes and its managed-by label.
func (h *HintIndex) trimGroupContent(u *unstructured.Unstructured) map[string]any {
	out := map[string]any{}
	if d, _, _ := unstructured.NestedString(u.Object, "spec", "driver"); d != h.d.Driver {
		return out
	}
	var handles []any
	for _, path := range [][]string{{"status", "volumeGroupSnapshotHandle"}, {"spec", "source", "groupSnapshotHandles", "volumeGroupSnapshotHandle"}} {
		if s, _, _ := unstructured.NestedString(u.Object, path...); s != "" {
			handles = append(handles, s)
		}
	}
	out[hintHandles] = handles
	if vs, _, _ := unstructured.NestedSlice(u.Object, "spec", "source", "volumeHandles"); len(vs) > 0 {
		out[hintSources] = vs
	}
	if n := u.GetLabels()[managedByLabel]; n != "" {
		out[hintNode] = n
	}
	return out
}

// stringList are the strings of a trimmed object's list.
func stringList(v any) []string {
	l, _ := v.([]any)
	out := make([]string, 0, len(l))
	for _, e := range l {
		if s, ok := e.(string); ok && s != "" {
			out = append(out, s)
		}
	}
	return out
}

func (h *HintIndex) informers() (pvs, contents, groups cache.SharedIndexInformer) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.pvs, h.contents, h.groups
}

// indexed are the trimmed objects of inf that name id.
func indexed(inf cache.SharedIndexInformer, id string) []map[string]any {
	if inf == nil {
		return nil
	}
	objs, _ := inf.GetIndexer().ByIndex(byHandle, id)
	out := make([]map[string]any, 0, len(objs))
	for _, o := range objs {
		if u, ok := o.(*unstructured.Unstructured); ok {
			out = append(out, u.Object)
		}
	}
	return out
}

// fromObjects is the node the objects agree on: their sources' PVs' node, else their
// node field. Objects that disagree name none.
func (h *HintIndex) fromObjects(objs []map[string]any) (string, bool) {
	node := ""
	for _, o := range objs {
		n := ""
		for _, src := range stringList(o[hintSources]) {
			if pn, ok := h.pvNode(src); ok {
				n = pn
				break
			}
		}
		if n == "" {
			n, _ = o[hintNode].(string)
		}
		if n == "" {
			continue
		}
		if node != "" && node != n {
			return "", false
		}
		node = n
	}
	return node, node != ""
}

func (h *HintIndex) pvNode(volumeID string) (string, bool) {
	pvs, _, _ := h.informers()
	return h.fromObjects(indexed(pvs, volumeID))
}

func (h *HintIndex) fromLearnt(id string) (string, bool) {
	v, ok := h.learnt.Get(id)
	if !ok {
		return "", false
	}
	n, ok := v.(string)
	return n, ok
}

// VolumeNode is the node of the volume's PV, else learnt.
func (h *HintIndex) VolumeNode(volumeID string) (string, bool) {
	if n, ok := h.pvNode(volumeID); ok {
		return n, true
	}
	return h.fromLearnt(volumeID)
}

// SnapshotNode is the node of the snapshot's content (its source volume's PV, else its
// managed-by label), else learnt.
func (h *HintIndex) SnapshotNode(snapshotID string) (string, bool) {
	_, contents, _ := h.informers()
	if n, ok := h.fromObjects(indexed(contents, snapshotID)); ok {
		return n, true
	}
	return h.fromLearnt(snapshotID)
}

// GroupNode is the node of the group snapshot's content (a member volume's PV, else its
// managed-by label), else learnt.
func (h *HintIndex) GroupNode(groupID string) (string, bool) {
	_, _, groups := h.informers()
	if n, ok := h.fromObjects(indexed(groups, groupID)); ok {
		return n, true
	}
	return h.fromLearnt(groupID)
}

// GroupNodes are the nodes of the group content's member PVs, when they name several,
// else the nodes learnt at its create.
func (h *HintIndex) GroupNodes(groupID string) []string {
	_, _, groups := h.informers()
	var nodes []string
	for _, o := range indexed(groups, groupID) {
		for _, src := range stringList(o[hintSources]) {
			if n, ok := h.pvNode(src); ok && !slices.Contains(nodes, n) {
				nodes = append(nodes, n)
			}
		}
	}
	if len(nodes) < 2 {
		if v, ok := h.learnt.Get(groupNodesKey + groupID); ok {
			nodes, _ = v.([]string)
		}
	}
	out := slices.Clone(nodes)
	slices.Sort(out)
	return out
}

// groupNodesKey prefixes a group's learnt nodes: no ID starts with it.
const groupNodesKey = "nodes:"

// LearnGroup records the nodes a group across nodes was made on.
func (h *HintIndex) LearnGroup(groupID string, nodes []string) {
	h.learnt.Add(groupNodesKey+groupID, slices.Clone(nodes))
}

// Learn records that id answered on node.
func (h *HintIndex) Learn(id, node string) { h.learnt.Add(id, node) }

// Synced says whether Run made the informers and each has its first full list.
func (h *HintIndex) Synced() bool {
	pvs, contents, groups := h.informers()
	if pvs == nil {
		return false
	}
	for _, inf := range []cache.SharedIndexInformer{pvs, contents, groups} {
		if inf != nil && !inf.HasSynced() {
			return false
		}
	}
	return true
}
