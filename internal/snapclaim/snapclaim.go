// Package snapclaim gives a node-local driver's pre-provisioned VolumeSnapshotContents to
// the node whose pool holds the snapshot.
//
// Local snapshots are taken by a csi-snapshotter on each node (--node-deployment), which
// only sees contents labelled snapshot.storage.kubernetes.io/managed-by=<its node>. The
// snapshot-controller (--enable-distributed-snapshotting) sets that label on the contents
// it creates, from the source volume's node; a content written by hand for an existing
// snapshot (static provisioning, a restore into another namespace) has no source volume and
// gets no label, so no snapshotter ever reads it and its VolumeSnapshot never becomes ready.
// The node that holds the snapshot is the one that can say so: each node's driver watches
// the unlabelled contents of its driver name and labels those whose snapshot its own pools
// hold.
package snapclaim

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// ManagedByLabel is the label a node's csi-snapshotter selects its contents by.
const ManagedByLabel = "snapshot.storage.kubernetes.io/managed-by"

// ContentsResource is the VolumeSnapshotContent API.
var ContentsResource = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotcontents"}

// Claimer labels, for Node, the unlabelled pre-provisioned contents of Driver whose snapshot
// Holds says is here.
type Claimer struct {
	Client dynamic.Interface
	Driver string
	Node   string
	// Holds reports whether this node's pools hold the snapshot the handle names. The handle
	// comes from the API server, written by whoever may create contents: Holds parses it as
	// the CSI calls do, refusing what is not one of the driver's snapshot IDs.
	Holds func(ctx context.Context, snapshotHandle string) (bool, error)
}

// Run watches the unlabelled contents until ctx ends, looking at each when it appears or
// changes, and at all of them again every resync.
func (c *Claimer) Run(ctx context.Context, resync time.Duration) {
	f := dynamicinformer.NewFilteredDynamicSharedInformerFactory(c.Client, resync, metav1.NamespaceAll,
		func(o *metav1.ListOptions) { o.LabelSelector = "!" + ManagedByLabel })
	inf := f.ForResource(ContentsResource).Informer()
	look := func(obj any) {
		if u, ok := obj.(*unstructured.Unstructured); ok {
			c.Claim(ctx, u)
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    look,
		UpdateFunc: func(_, obj any) { look(obj) },
	}); err != nil {
		klog.FromContext(ctx).Error(err, "Watching VolumeSnapshotContents")
		return
	}
	f.Start(ctx.Done())
	<-ctx.Done()
	f.Shutdown()
}

// Claim labels one content for this node if it is an unlabelled pre-provisioned content of
// this driver whose snapshot is here, and reports whether it did.
func (c *Claimer) Claim(ctx context.Context, u *unstructured.Unstructured) bool {
	log := klog.FromContext(ctx).WithValues("content", u.GetName())
	if _, labelled := u.GetLabels()[ManagedByLabel]; labelled {
		return false
	}
	driver, _, _ := unstructured.NestedString(u.Object, "spec", "driver")
	handle, _, _ := unstructured.NestedString(u.Object, "spec", "source", "snapshotHandle")
	if driver != c.Driver || handle == "" {
		return false
	}
	here, err := c.Holds(ctx, handle)
	if err != nil {
		log.Error(err, "Looking for a pre-provisioned snapshot in this node's pools", "snapshotHandle", handle)
		return false
	}
	if !here {
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
	if _, err := c.Client.Resource(ContentsResource).Patch(ctx, u.GetName(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		log.Error(fmt.Errorf("labelling %s=%s: %w", ManagedByLabel, c.Node, err), "Claiming a pre-provisioned snapshot for this node")
		return false
	}
	log.Info("Claimed a pre-provisioned snapshot for this node's snapshotter", "snapshotHandle", handle, "node", c.Node)
	return true
}
