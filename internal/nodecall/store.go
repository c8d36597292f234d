package nodecall

import (
	"context"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
)

// Store reads and writes the calls and PoolNodes of one namespace (the release's).
//
// Every write that decides something is conditional: UpdateStatus sends the
// resourceVersion the caller read (the API server refuses it with a Conflict if the object
// changed since), Delete takes the resourceVersion as a precondition. Two writers racing
// (an agent's commit point and the sweeper's delete, an old agent and a re-created call)
// end with exactly one winner.
type Store struct {
	Client    dynamic.Interface
	Namespace string
}

func (s Store) calls() dynamic.ResourceInterface {
	return s.Client.Resource(CallsResource).Namespace(s.Namespace)
}

func (s Store) nodes() dynamic.ResourceInterface {
	return s.Client.Resource(NodesResource).Namespace(s.Namespace)
}

// Create writes a new call; an existing one of the name is AlreadyExists.
func (s Store) Create(ctx context.Context, c *Call) (*Call, error) {
	u, err := c.ToUnstructured()
	if err != nil {
		return nil, err
	}
	u.SetNamespace(s.Namespace)
	out, err := s.calls().Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		return nil, err
	}
	return CallFrom(out)
}

// Get reads one call.
func (s Store) Get(ctx context.Context, name string) (*Call, error) {
	u, err := s.calls().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return CallFrom(u)
}

// List reads the calls for node ("" for every node's).
func (s Store) List(ctx context.Context, node string) ([]*Call, error) {
	l, err := s.calls().List(ctx, metav1.ListOptions{FieldSelector: nodeSelector(node)})
	if err != nil {
		return nil, err
	}
	out := make([]*Call, 0, len(l.Items))
	for i := range l.Items {
		c, err := CallFrom(&l.Items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// Delete deletes a call if it still has resourceVersion rv (any version if rv is empty).
func (s Store) Delete(ctx context.Context, name, rv string) error {
	opts := metav1.DeleteOptions{}
	if rv != "" {
		opts.Preconditions = &metav1.Preconditions{ResourceVersion: &rv}
	}
	return s.calls().Delete(ctx, name, opts)
}

// UpdateStatus writes c.Status if the call still has c's resourceVersion; the spec is
// not written (status subresource).
func (s Store) UpdateStatus(ctx context.Context, c *Call) (*Call, error) {
	if c.ResourceVersion == "" {
		return nil, fmt.Errorf("PoolCall %s: a status write needs the resourceVersion it was read at", c.Name)
	}
	u, err := c.ToUnstructured()
	if err != nil {
		return nil, err
	}
	u.SetNamespace(s.Namespace)
	out, err := s.calls().UpdateStatus(ctx, u, metav1.UpdateOptions{})
	if err != nil {
		return nil, err
	}
	return CallFrom(out)
}

// Informer watches the calls for node ("" for every node's), with the API server's field
// selector on spec.node; the reader still checks spec.node itself.
func (s Store) Informer(node string, resync time.Duration) cache.SharedIndexInformer {
	return dynamicinformer.NewFilteredDynamicInformer(s.Client, CallsResource, s.Namespace, resync, cache.Indexers{},
		func(o *metav1.ListOptions) { o.FieldSelector = nodeSelector(node) }).Informer()
}

// NodeInformer watches the PoolNodes.
func (s Store) NodeInformer(resync time.Duration) cache.SharedIndexInformer {
	return dynamicinformer.NewFilteredDynamicInformer(s.Client, NodesResource, s.Namespace, resync, cache.Indexers{}, nil).Informer()
}

func nodeSelector(node string) string {
	if node == "" {
		return ""
	}
	return fields.OneTermEqualSelector("spec.node", node).String()
}

// GetNode reads the PoolNode of a node.
func (s Store) GetNode(ctx context.Context, node string) (*PoolNode, error) {
	u, err := s.nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return NodeFrom(u)
}

// CreateNode writes a new PoolNode (its status is written by UpdateNodeStatus: the API
// server drops the status of a create).
func (s Store) CreateNode(ctx context.Context, n *PoolNode) (*PoolNode, error) {
	u, err := n.ToUnstructured()
	if err != nil {
		return nil, err
	}
	u.SetNamespace(s.Namespace)
	out, err := s.nodes().Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		return nil, err
	}
	return NodeFrom(out)
}

// UpdateNodeStatus writes n.Status if the PoolNode still has n's resourceVersion.
func (s Store) UpdateNodeStatus(ctx context.Context, n *PoolNode) (*PoolNode, error) {
	u, err := n.ToUnstructured()
	if err != nil {
		return nil, err
	}
	u.SetNamespace(s.Namespace)
	out, err := s.nodes().UpdateStatus(ctx, u, metav1.UpdateOptions{})
	if err != nil {
		return nil, err
	}
	return NodeFrom(out)
}

// NodeUID reads the UID of the Node of that name, for an ownerReference.
func (s Store) NodeUID(ctx context.Context, node string) (types.UID, error) {
	u, err := s.Client.Resource(KubeNodesResource).Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	return u.GetUID(), nil
}

// FromCache converts an informer's object; nil if it is not a call (a tombstone, a
// malformed object).
func FromCache(obj any) *Call {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil
	}
	c, err := CallFrom(u)
	if err != nil {
		return nil
	}
	return c
}
