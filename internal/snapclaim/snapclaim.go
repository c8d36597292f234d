// Package snapclaim gives a node-local driver's snapshot contents that nobody labelled to
// the node whose pools hold their source.
//
// Local snapshots are taken by a csi-snapshotter on each node (--node-deployment), which
// only sees (Volume|VolumeGroup)SnapshotContents labelled
// snapshot.storage.kubernetes.io/managed-by=<its node>. The snapshot-controller
// (--enable-distributed-snapshotting, external-snapshotter v8.7.0) sets that label only on
// the single dynamic contents it creates, from the source volume's node. It sets none on
//   - a VolumeSnapshotContent written by hand for an existing snapshot (static
//     provisioning, a restore into another namespace): it has no source volume;
//   - a VolumeGroupSnapshotContent, dynamic or pre-provisioned: the group controller never
//     labels;
//   - the member VolumeSnapshotContents it creates after a group is cut (a volumeHandle
//     source, the group handle as an annotation, the snapshot handle in status): without a
//     snapshotter to remove their finalizer they never go away.
//
// No snapshotter ever reads an unlabelled content, so it never becomes ready (or never goes
// away). The node that holds the source is the one that can say so: each node's driver
// watches the unlabelled contents of its driver name and labels those whose source its own
// pools hold. The lookups are the caller's (the driver's CSI calls, which parse and refuse
// hostile IDs); this package only reads the objects and patches the label.
package snapclaim

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/poolcsi/poolcsi/internal/pool"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// ManagedByLabel is the label a node's csi-snapshotter selects its contents by.
const ManagedByLabel = "snapshot.storage.kubernetes.io/managed-by"

// GroupHandleAnnotation marks the member contents the snapshot-controller creates for a
// group snapshot (external-snapshotter's utils.VolumeGroupSnapshotHandleAnnotation).
const GroupHandleAnnotation = "groupsnapshot.storage.k8s.io/volumeGroupSnapshotHandle"

var (
	// ContentsResource is the VolumeSnapshotContent API.
	ContentsResource = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotcontents"}
	// GroupContentsResource is the VolumeGroupSnapshotContent API.
	GroupContentsResource = schema.GroupVersionResource{Group: "groupsnapshot.storage.k8s.io", Version: "v1", Resource: "volumegroupsnapshotcontents"}
)

// maxGroupHandles bounds the handles of one group content looked up: a group of more
// members than the driver ever cuts is not one of ours, and each handle costs a lookup.
const maxGroupHandles = pool.MaxGroupMembers

// Claimer labels, for Node, the unlabelled contents of Driver whose source is here.
//
// Every handle it passes on comes from the API server, written by whoever may create
// contents: the funcs parse it as the CSI calls do, refusing what is not one of the
// driver's IDs, and answer (false, nil) for an ID that is the driver's but not here.
type Claimer struct {
	Client dynamic.Interface
	// Discovery tells whether the group snapshot API is served; nil watches single
	// contents only.
	Discovery discovery.DiscoveryInterface
	Driver    string
	Node      string
	// Holds reports whether this node's pools hold the snapshot.
	Holds func(ctx context.Context, snapshotHandle string) (bool, error)
	// HoldsVolume reports whether this node's pools hold the volume; nil claims no dynamic
	// group content.
	HoldsVolume func(ctx context.Context, volumeHandle string) (bool, error)
	// HoldsGroup reports whether this node's pools hold the group snapshot with exactly
	// these members; nil claims no pre-provisioned group content.
	HoldsGroup func(ctx context.Context, groupHandle string, snapshotHandles []string) (bool, error)
}

// Run watches the unlabelled contents until ctx ends, looking at each when it appears or
// changes, and at all of them again every resync. Group contents are watched only if the
// API server serves them when Run starts, as csi-snapshotter decides for its own run: an
// informer on a missing resource would log its failure to list forever.
func (c *Claimer) Run(ctx context.Context, resync time.Duration) {
	log := klog.FromContext(ctx)
	f := dynamicinformer.NewFilteredDynamicSharedInformerFactory(c.Client, resync, metav1.NamespaceAll,
		func(o *metav1.ListOptions) { o.LabelSelector = "!" + ManagedByLabel })
	if !c.watch(ctx, f, ContentsResource, c.Claim) {
		return
	}
	if c.groupsServed(ctx) {
		if !c.watch(ctx, f, GroupContentsResource, c.ClaimGroup) {
			return
		}
		log.Info("Claiming group snapshot contents held here for this node's snapshotter", "node", c.Node)
	}
	f.Start(ctx.Done())
	<-ctx.Done()
	f.Shutdown()
}

func (c *Claimer) watch(ctx context.Context, f dynamicinformer.DynamicSharedInformerFactory, r schema.GroupVersionResource, claim func(context.Context, *unstructured.Unstructured) bool) bool {
	look := func(obj any) {
		if u, ok := obj.(*unstructured.Unstructured); ok {
			claim(ctx, u)
		}
	}
	if _, err := f.ForResource(r).Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    look,
		UpdateFunc: func(_, obj any) { look(obj) },
	}); err != nil {
		klog.FromContext(ctx).Error(err, "Watching contents", "resource", r.Resource)
		return false
	}
	return true
}

// groupsServed asks discovery whether VolumeGroupSnapshotContents exist, and says once why
// group contents are not claimed when they do not.
func (c *Claimer) groupsServed(ctx context.Context) bool {
	log := klog.FromContext(ctx)
	if c.Discovery == nil || (c.HoldsVolume == nil && c.HoldsGroup == nil) {
		return false
	}
	gv := GroupContentsResource.GroupVersion().String()
	list, err := c.Discovery.ServerResourcesForGroupVersion(gv)
	if err != nil && !apierrors.IsNotFound(err) {
		log.Error(err, "Not claiming group snapshot contents: cannot tell whether the API server serves them; restart to retry", "groupVersion", gv)
		return false
	}
	if err == nil {
		for _, r := range list.APIResources {
			if r.Name == GroupContentsResource.Resource {
				return true
			}
		}
	}
	log.Info("Not claiming group snapshot contents: the VolumeGroupSnapshot CRDs are not installed (csi-snapshotter disables group snapshots too); restart once they are", "groupVersion", gv)
	return false
}

// Claim labels one VolumeSnapshotContent for this node if it is an unlabelled content of
// this driver whose snapshot is here — a pre-provisioned one (spec.source.snapshotHandle)
// or a group member (annotated, status.snapshotHandle) — and reports whether it did.
func (c *Claimer) Claim(ctx context.Context, u *unstructured.Unstructured) bool {
	if !c.unclaimed(u) {
		return false
	}
	handle, _, _ := unstructured.NestedString(u.Object, "spec", "source", "snapshotHandle")
	if handle == "" {
		// A member's source is its volume, which may be gone by now: its snapshot, in
		// status once the group is cut, is what must be here. A dynamic single content
		// without the label is left alone: the snapshot-controller labels those it
		// creates, and claiming one would have this node cut it.
		if _, member := u.GetAnnotations()[GroupHandleAnnotation]; !member {
			return false
		}
		handle, _, _ = unstructured.NestedString(u.Object, "status", "snapshotHandle")
		if handle == "" {
			return false // looked at again when the status arrives
		}
	}
	return c.claimIf(ctx, ContentsResource, u, "snapshotHandle", handle, func() (bool, error) { return c.Holds(ctx, handle) })
}

// ClaimGroup labels one VolumeGroupSnapshotContent for this node if it is an unlabelled
// content of this driver whose volumes (dynamic) or group snapshot (pre-provisioned) are
// all here, and reports whether it did.
func (c *Claimer) ClaimGroup(ctx context.Context, u *unstructured.Unstructured) bool {
	if !c.unclaimed(u) {
		return false
	}
	log := klog.FromContext(ctx).WithValues("groupContent", u.GetName())
	volumes, _, _ := unstructured.NestedStringSlice(u.Object, "spec", "source", "volumeHandles")
	group, _, _ := unstructured.NestedString(u.Object, "spec", "source", "groupSnapshotHandles", "volumeGroupSnapshotHandle")
	snaps, _, _ := unstructured.NestedStringSlice(u.Object, "spec", "source", "groupSnapshotHandles", "volumeSnapshotHandles")
	if n := max(len(volumes), len(snaps)); n > maxGroupHandles {
		log.Info("Not claiming a group snapshot content of more members than a group snapshot takes", "handles", n, "max", maxGroupHandles)
		return false
	}
	switch {
	case len(volumes) > 0 && group == "" && c.HoldsVolume != nil:
		// A group's volumes are of one pool: one not here makes the group not ours.
		return c.claimIf(ctx, GroupContentsResource, u, "volumeHandles", volumes, func() (bool, error) {
			for _, v := range volumes {
				if here, err := c.HoldsVolume(ctx, v); err != nil || !here {
					return false, err
				}
			}
			return true, nil
		})
	case group != "" && len(volumes) == 0 && c.HoldsGroup != nil:
		return c.claimIf(ctx, GroupContentsResource, u, "volumeGroupSnapshotHandle", group, func() (bool, error) { return c.HoldsGroup(ctx, group, snaps) })
	}
	return false
}

func (c *Claimer) unclaimed(u *unstructured.Unstructured) bool {
	if _, labelled := u.GetLabels()[ManagedByLabel]; labelled {
		return false
	}
	driver, _, _ := unstructured.NestedString(u.Object, "spec", "driver")
	return driver == c.Driver
}

// claimIf labels u for this node if here says its source is here.
func (c *Claimer) claimIf(ctx context.Context, r schema.GroupVersionResource, u *unstructured.Unstructured, key string, handle any, here func() (bool, error)) bool {
	log := klog.FromContext(ctx).WithValues("resource", r.Resource, "content", u.GetName(), key, handle)
	ok, err := here()
	if err != nil {
		log.Error(err, "Looking for a content's source in this node's pools")
		return false
	}
	if !ok {
		return false
	}
	// The resourceVersion makes the patch conditional: a content changed since it was read
	// (labelled by an administrator, say) is looked at again when its update arrives.
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"resourceVersion": u.GetResourceVersion(),
		"labels":          map[string]string{ManagedByLabel: c.Node},
	}})
	if err != nil {
		log.Error(err, "Building the label patch")
		return false
	}
	if _, err := c.Client.Resource(r).Patch(ctx, u.GetName(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		log.Error(fmt.Errorf("labelling %s=%s: %w", ManagedByLabel, c.Node, err), "Claiming a content for this node")
		return false
	}
	log.Info("Claimed a content for this node's snapshotter", "node", c.Node)
	return true
}
