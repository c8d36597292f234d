package harness

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
)

// The channel's resources (deploy/helm/poolcsi/templates/nodecall.yaml).
var (
	poolCallGVR = schema.GroupVersionResource{Group: "poolcsi.io", Version: "v1alpha1", Resource: "poolcalls"}
	poolNodeGVR = schema.GroupVersionResource{Group: "poolcsi.io", Version: "v1alpha1", Resource: "poolnodes"}
)

// nodeNameExtra is the extra a pod-bound ServiceAccount token gives its user: the name of
// the node the pod is bound to (ServiceAccountTokenPodNodeInfo, GA in 1.32).
const nodeNameExtra = "authentication.kubernetes.io/node-name"

// TestNodeScope: with localController.central, the node plugin's account may write only
// its own node's objects of the channel (docs/design/central-controller.md §3): its own
// PoolNode and the status of its own node's PoolCalls; another node's are refused by the
// chart's ValidatingAdmissionPolicy, a user without a node in its token is refused, and
// RBAC refuses the node a PoolCall create or delete. First as that account impersonated
// with the extra, then with real tokens the API server issues: one bound to a pod on a
// node, which the API server gives the node's name, and one bound to nothing.
//
// An API server alone (no kubelet, no pod runs): the policy and RBAC are the API server's,
// and a pod bound to a Node object is all a token needs to name it.
func TestNodeScope(t *testing.T) {
	start := time.Now()
	ctx := context.Background()
	c := cluster.StartCluster(t, t.TempDir())
	t.Logf("control plane up after %s", time.Since(start).Round(time.Second))

	docs, err := chart.Render(chart.ChartDir(), "", map[string]any{"localController": map[string]any{"central": true}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chart.Namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ap := c.Applier()
	nodeSA := ""
	var crds []string
	for _, d := range docs {
		switch d.Kind {
		case "DaemonSet", "Deployment", "CSIDriver": // no node runs them here
			continue
		}
		objs, err := cluster.ParseObjects([]byte(d.YAML))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if err := ap.Apply(ctx, o, false); err != nil {
				t.Fatalf("%s: %v", d.Source, err)
			}
			if o.GetKind() == "CustomResourceDefinition" {
				crds = append(crds, o.GetName())
			}
		}
		if d.Kind == "ServiceAccount" && strings.HasSuffix(d.Name, "-node") {
			nodeSA = d.Name
		}
	}
	if len(crds) != 2 || nodeSA == "" {
		t.Fatalf("the chart rendered CRDs %v and node account %q", crds, nodeSA)
	}
	user := "system:serviceaccount:" + chart.Namespace + ":" + nodeSA
	dyn := dynamic.NewForConfigOrDie(c.Config)
	poll(t, ctx, "the CRDs served", func() error {
		for _, gvr := range []schema.GroupVersionResource{poolCallGVR, poolNodeGVR} {
			if _, err := dyn.Resource(gvr).Namespace(chart.Namespace).List(ctx, metav1.ListOptions{}); err != nil {
				return err
			}
		}
		return nil
	})

	// What the controller makes (the admin here: the policy judges the node's account only).
	admin := dyn.Resource(poolCallGVR).Namespace(chart.Namespace)
	for _, n := range []string{"node-a", "node-b"} {
		if _, err := admin.Create(ctx, poolCall("cv-"+n, n), metav1.CreateOptions{}); err != nil {
			t.Fatalf("the controller's call for %s: %v", n, err)
		}
	}
	if _, err := dyn.Resource(poolNodeGVR).Namespace(chart.Namespace).Create(ctx, poolNode("node-b"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	as := func(node string) dynamic.Interface {
		cfg := rest.CopyConfig(c.Config)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: user,
			Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + chart.Namespace, "system:authenticated"}}
		if node != "" {
			cfg.Impersonate.Extra = map[string][]string{nodeNameExtra: {node}}
		}
		return dynamic.NewForConfigOrDie(cfg)
	}
	nodeA, noNode := as("node-a"), as("")
	// RBAC and the policy reach the API server's authorizer and admission through
	// informers: wait until both act before judging (the first write of node-a that RBAC
	// lets through, the first refusal of the policy).
	poll(t, ctx, "node-a's own PoolNode created (RBAC in effect)", func() error {
		_, err := nodeA.Resource(poolNodeGVR).Namespace(chart.Namespace).Create(ctx, poolNode("node-a"), metav1.CreateOptions{})
		return err
	})
	poll(t, ctx, "the policy in effect", func() error {
		return refusedByPolicy(statusWrite(ctx, noNode, poolNodeGVR, "node-a"), "no node in the token")
	})

	checkScope(t, ctx, "impersonated", nodeA, noNode)

	// What the agent and the controller rely on besides: the agent's watch takes its
	// node's calls alone (selectableFields), and no one, the controller included, changes
	// a call's spec.
	mine, err := nodeA.Resource(poolCallGVR).Namespace(chart.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "spec.node=node-a"})
	if err != nil || len(mine.Items) != 1 || mine.Items[0].GetName() != "cv-node-a" {
		t.Errorf("node-a's calls by field selector: %v, %v; want cv-node-a alone", names(mine), err)
	}
	o, err := admin.Get(ctx, "cv-node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = unstructured.SetNestedField(o.Object, "node-b", "spec", "node")
	if _, err := admin.Update(ctx, o, metav1.UpdateOptions{}); !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "immutable") {
		t.Errorf("the controller re-targets a call: %v, want refused (spec immutable)", err)
	}

	// A real token. The API server names the node in a token bound to a pod that is bound
	// to a node (a Node object: no kubelet needed); a token bound to nothing names none.
	if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	no := false
	pod, err := c.Client.CoreV1().Pods(chart.Namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "agent-node-a"},
		Spec: corev1.PodSpec{NodeName: "node-a", ServiceAccountName: nodeSA, AutomountServiceAccountToken: &no,
			Containers: []corev1.Container{{Name: "agent", Image: "poolcsi.test/never-pulled:1"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	token := func(bound *authv1.BoundObjectReference) dynamic.Interface {
		exp := int64(600)
		tr, err := c.Client.CoreV1().ServiceAccounts(chart.Namespace).CreateToken(ctx, nodeSA,
			&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &exp, BoundObjectRef: bound}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("token for %s: %v", nodeSA, err)
		}
		cfg := rest.AnonymousClientConfig(c.Config)
		cfg.BearerToken = tr.Status.Token
		return dynamic.NewForConfigOrDie(cfg)
	}
	podToken := token(&authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID})
	checkScope(t, ctx, "a pod's token", podToken, token(nil))
	t.Logf("TestNodeScope took %s", time.Since(start).Round(time.Second))
}

// checkScope: nodeA (node-a's agent) and noNode (the same account, no node named) against
// the objects TestNodeScope made: the calls cv-node-a and cv-node-b, the PoolNodes node-a
// and node-b.
func checkScope(t *testing.T, ctx context.Context, how string, nodeA, noNode dynamic.Interface) {
	calls := nodeA.Resource(poolCallGVR).Namespace(chart.Namespace)
	for _, tc := range []struct {
		name string
		do   func() error
		// want: "" allowed, "rbac" refused by RBAC, else refused by the policy saying this.
		want string
	}{
		{"its own PoolNode's status", func() error { return statusWrite(ctx, nodeA, poolNodeGVR, "node-a") }, ""},
		{"its own call's status", func() error { return statusWrite(ctx, nodeA, poolCallGVR, "cv-node-a") }, ""},
		{"its own call's status, patched", func() error {
			_, err := calls.Patch(ctx, "cv-node-a", types.MergePatchType, []byte(`{"status":{"phase":"Done","code":0}}`), metav1.PatchOptions{}, "status")
			return err
		}, ""},
		{"another node's PoolNode's status", func() error { return statusWrite(ctx, nodeA, poolNodeGVR, "node-b") }, "node node-a may not write poolnodes of node node-b"},
		{"another node's call's status", func() error { return statusWrite(ctx, nodeA, poolCallGVR, "cv-node-b") }, "node node-a may not write poolcalls of node node-b"},
		{"another node's PoolNode created", func() error {
			_, err := nodeA.Resource(poolNodeGVR).Namespace(chart.Namespace).Create(ctx, poolNode("node-c"), metav1.CreateOptions{})
			return err
		}, "node node-a may not write poolnodes of node node-c"},
		{"its own PoolNode's status, no node in the token", func() error { return statusWrite(ctx, noNode, poolNodeGVR, "node-a") }, "no node in the token"},
		{"its own call's status, no node in the token", func() error { return statusWrite(ctx, noNode, poolCallGVR, "cv-node-a") }, "no node in the token"},
		{"a call created", func() error {
			_, err := calls.Create(ctx, poolCall("cv-forged", "node-a"), metav1.CreateOptions{})
			return err
		}, "rbac"},
		{"its own call deleted", func() error { return calls.Delete(ctx, "cv-node-a", metav1.DeleteOptions{}) }, "rbac"},
		{"its own call's spec updated", func() error {
			o, err := calls.Get(ctx, "cv-node-a", metav1.GetOptions{})
			if err != nil {
				return err
			}
			_ = unstructured.SetNestedField(o.Object, "node-b", "spec", "node")
			_, err = calls.Update(ctx, o, metav1.UpdateOptions{})
			return err
		}, "rbac"},
		// RBAC cannot narrow a read to one node's objects: a node reads every call, which
		// holds no secret (docs/security.md).
		{"another node's call read", func() error { _, err := calls.Get(ctx, "cv-node-b", metav1.GetOptions{}); return err }, ""},
	} {
		t.Run(how+": "+tc.name, func(t *testing.T) {
			err := tc.do()
			switch tc.want {
			case "":
				if err != nil {
					t.Errorf("refused: %v", err)
				}
			case "rbac":
				if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "cannot") {
					t.Errorf("%v, want refused by RBAC", err)
				}
			default:
				if err := refusedByPolicy(err, tc.want); err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// refusedByPolicy is nil when err is the node-scope policy's refusal with the message want.
func refusedByPolicy(err error, want string) error {
	if err == nil {
		return fmt.Errorf("allowed, want refused by the node-scope policy: %s", want)
	}
	if !strings.Contains(err.Error(), "node-scope") || !strings.Contains(err.Error(), want) {
		return fmt.Errorf("%w, want refused by the node-scope policy: %s", err, want)
	}
	return nil
}

// statusWrite reads the object as client and writes its status back, changed: what an
// agent does to answer a call or renew its PoolNode.
func statusWrite(ctx context.Context, client dynamic.Interface, gvr schema.GroupVersionResource, name string) error {
	ri := client.Resource(gvr).Namespace(chart.Namespace)
	o, err := ri.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	now := time.Now().UTC().Format(time.RFC3339Nano)
	if gvr == poolCallGVR {
		nonce, _, _ := unstructured.NestedString(o.Object, "spec", "nonce")
		_ = unstructured.SetNestedMap(o.Object, map[string]any{"nonce": nonce, "phase": "Running", "attempts": int64(1), "started": now}, "status")
	} else {
		_ = unstructured.SetNestedField(o.Object, now, "status", "renewTime")
	}
	_, err = ri.UpdateStatus(ctx, o, metav1.UpdateOptions{})
	return err
}

func poolCall(name, node string) *unstructured.Unstructured {
	now := time.Now().UTC()
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "poolcsi.io/v1alpha1", "kind": "PoolCall",
		"metadata": map[string]any{"name": name, "namespace": chart.Namespace},
		"spec": map[string]any{"node": node, "method": "CreateVolume", "target": "local.0123", "request": `{"name":"pvc-1"}`,
			"nonce": "0123456789abcdef0123456789abcdef", "issued": now.Format(time.RFC3339Nano),
			"notAfter": now.Add(15 * time.Minute).Format(time.RFC3339)},
	}}
}

func poolNode(name string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "poolcsi.io/v1alpha1", "kind": "PoolNode",
		"metadata": map[string]any{"name": name, "namespace": chart.Namespace},
		"spec":     map[string]any{},
	}}
}

func names(l *unstructured.UnstructuredList) []string {
	if l == nil {
		return nil
	}
	var out []string
	for _, o := range l.Items {
		out = append(out, o.GetName())
	}
	return out
}

// poll retries f every 200 ms until it returns nil, failing the test after a minute.
func poll(t *testing.T, ctx context.Context, what string, f func() error) {
	t.Helper()
	var last error
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		last = f()
		return last == nil, nil
	}); err != nil {
		t.Fatalf("waiting for %s: %v (last: %v)", what, err, last)
	}
}
