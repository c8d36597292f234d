// Package nodecalltest is a fake API server for the channel's objects: a
// k8s.io/client-go/dynamic/fake client that, unlike the plain fake, keeps resourceVersions
// the way the API server does (each write a new one, an update or a delete with a stale one
// a Conflict), drops the status of a create and separates the status subresource from the
// rest of the object, so the channel's optimistic concurrency can be tested without a
// cluster.
package nodecalltest

import (
	"fmt"
	"strconv"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	clienttesting "k8s.io/client-go/testing"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// Client is the fake.
type Client struct {
	*dynamicfake.FakeDynamicClient

	mu  sync.Mutex
	rv  int
	uid int
}

// NewClient returns the fake holding objs (given resourceVersions as they are).
func NewClient(objs ...runtime.Object) *Client {
	f := &Client{FakeDynamicClient: dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), nodecall.ListKinds(), objs...), rv: 1000}
	f.PrependReactor("create", "*", f.create)
	f.PrependReactor("update", "*", f.update)
	f.PrependReactor("delete", "*", f.delete)
	return f
}

// Node is a Node object of that name and UID, for a PoolNode's owner.
func Node(name, uid string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetAPIVersion("v1")
	u.SetKind("Node")
	u.SetName(name)
	u.SetUID(types.UID(uid))
	u.SetResourceVersion("1")
	return u
}

func (f *Client) nextRV() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rv++
	return strconv.Itoa(f.rv)
}

func (f *Client) nextUID() types.UID {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.uid++
	return types.UID(fmt.Sprintf("uid-%d", f.uid))
}

func hasStatus(a clienttesting.Action) bool {
	r := a.GetResource().Resource
	return r == nodecall.CallsResource.Resource || r == nodecall.NodesResource.Resource
}

func (f *Client) create(a clienttesting.Action) (bool, runtime.Object, error) {
	ca := a.(clienttesting.CreateAction)
	if ca.GetSubresource() != "" {
		return false, nil, nil
	}
	u := ca.GetObject().(*unstructured.Unstructured).DeepCopy()
	if hasStatus(a) {
		unstructured.RemoveNestedField(u.Object, "status")
	}
	u.SetResourceVersion(f.nextRV())
	if u.GetUID() == "" {
		u.SetUID(f.nextUID())
	}
	if err := f.Tracker().Create(a.GetResource(), u, ca.GetNamespace()); err != nil {
		return true, nil, err
	}
	return true, u, nil
}

func (f *Client) stored(a clienttesting.Action, name string) (*unstructured.Unstructured, error) {
	o, err := f.Tracker().Get(a.GetResource(), a.GetNamespace(), name)
	if err != nil {
		return nil, err
	}
	return o.(*unstructured.Unstructured).DeepCopy(), nil
}

func (f *Client) update(a clienttesting.Action) (bool, runtime.Object, error) {
	ua := a.(clienttesting.UpdateAction)
	in := ua.GetObject().(*unstructured.Unstructured)
	cur, err := f.stored(a, in.GetName())
	if err != nil {
		return true, nil, err
	}
	gr := a.GetResource().GroupResource()
	if rv := in.GetResourceVersion(); rv != "" && rv != cur.GetResourceVersion() {
		return true, nil, apierrors.NewConflict(gr, in.GetName(), fmt.Errorf("the object has been modified: resourceVersion %s, stored %s", rv, cur.GetResourceVersion()))
	}
	var out *unstructured.Unstructured
	switch {
	case ua.GetSubresource() == "status":
		out = cur
		if st, ok := in.Object["status"]; ok {
			out.Object["status"] = runtime.DeepCopyJSONValue(st)
		} else {
			delete(out.Object, "status")
		}
	case hasStatus(a):
		out = in.DeepCopy()
		if st, ok := cur.Object["status"]; ok {
			out.Object["status"] = st
		} else {
			delete(out.Object, "status")
		}
	default:
		out = in.DeepCopy()
	}
	out.SetResourceVersion(f.nextRV())
	if err := f.Tracker().Update(a.GetResource(), out, a.GetNamespace()); err != nil {
		return true, nil, err
	}
	return true, out, nil
}

func (f *Client) delete(a clienttesting.Action) (bool, runtime.Object, error) {
	da := a.(clienttesting.DeleteAction)
	cur, err := f.stored(a, da.GetName())
	if err != nil {
		return true, nil, err
	}
	if p := da.GetDeleteOptions().Preconditions; p != nil {
		if p.ResourceVersion != nil && *p.ResourceVersion != cur.GetResourceVersion() {
			return true, nil, apierrors.NewConflict(a.GetResource().GroupResource(), da.GetName(), fmt.Errorf("precondition failed: resourceVersion %s, stored %s", *p.ResourceVersion, cur.GetResourceVersion()))
		}
		if p.UID != nil && *p.UID != cur.GetUID() {
			return true, nil, apierrors.NewConflict(a.GetResource().GroupResource(), da.GetName(), fmt.Errorf("precondition failed: UID %s, stored %s", *p.UID, cur.GetUID()))
		}
	}
	return true, nil, f.Tracker().Delete(a.GetResource(), a.GetNamespace(), da.GetName())
}
