package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
)

var metav1GetOptions = metav1.GetOptions{}

// ParseObjects reads every object of a multi-document YAML stream.
func ParseObjects(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var out []*unstructured.Unstructured
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, err
		}
		if len(m) == 0 {
			continue
		}
		out = append(out, &unstructured.Unstructured{Object: m})
	}
}

// ParseFile reads the objects of one YAML file.
func ParseFile(path string) ([]*unstructured.Unstructured, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	objs, err := ParseObjects(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return objs, nil
}

// Applier applies objects with server-side apply and strict field validation.
type Applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

// Applier applies objects to the cluster as its admin.
func (c *Cluster) Applier() *Applier {
	return &Applier{
		dyn:    dynamic.NewForConfigOrDie(c.Config),
		mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(c.Client.Discovery())),
	}
}

// resource is the client of obj's resource: namespaced ones in obj's
// namespace, else default.
func (a *Applier) resource(obj *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", gvk.Kind, obj.GetName(), err)
	}
	if m.Scope.Name() != meta.RESTScopeNameNamespace {
		return a.dyn.Resource(m.Resource), nil
	}
	ns := obj.GetNamespace()
	if ns == "" {
		ns = "default"
	}
	return a.dyn.Resource(m.Resource).Namespace(ns), nil
}

// Apply applies obj; with dryRun the API server validates, defaults and admits it but
// stores nothing.
func (a *Applier) Apply(ctx context.Context, obj *unstructured.Unstructured, dryRun bool) error {
	gvk := obj.GroupVersionKind()
	ri, err := a.resource(obj)
	if err != nil {
		return err
	}
	data, err := json.Marshal(obj.Object)
	if err != nil {
		return err
	}
	force := true
	opts := metav1.PatchOptions{FieldManager: "poolcsi-k8s-test", Force: &force, FieldValidation: "Strict"}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	if _, err := ri.Patch(ctx, obj.GetName(), types.ApplyPatchType, data, opts); err != nil {
		return fmt.Errorf("%s %s/%s: %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), err)
	}
	return nil
}

// Delete deletes obj (namespaced: in its namespace, else default); gone already is no error.
func (a *Applier) Delete(ctx context.Context, obj *unstructured.Unstructured) error {
	gvk := obj.GroupVersionKind()
	ri, err := a.resource(obj)
	if err != nil {
		return err
	}
	if err := ri.Delete(ctx, obj.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("%s %s/%s: %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), err)
	}
	return nil
}

// Find returns the object of that kind and name.
func FindObject(objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

// ContainerArgs returns the args of a container in a rendered Deployment or DaemonSet.
func ContainerArgs(obj *unstructured.Unstructured, container string) ([]string, error) {
	cs, _, err := unstructured.NestedSlice(obj.Object, "spec", "template", "spec", "containers")
	if err != nil {
		return nil, err
	}
	for _, c := range cs {
		cm, _ := c.(map[string]any)
		if cm["name"] != container {
			continue
		}
		raw, _ := cm["args"].([]any)
		var out []string
		for _, a := range raw {
			out = append(out, fmt.Sprint(a))
		}
		return out, nil
	}
	return nil, fmt.Errorf("%s %s has no container %q", obj.GetKind(), obj.GetName(), container)
}

// RewriteArgs drops the flags whose name starts with one of drop and appends add.
func RewriteArgs(args []string, drop []string, add ...string) []string {
	var out []string
next:
	for _, a := range args {
		name := strings.SplitN(a, "=", 2)[0]
		for _, d := range drop {
			if name == d {
				continue next
			}
		}
		out = append(out, a)
	}
	return append(out, add...)
}
