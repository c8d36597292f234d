package cluster

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/tools"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// InstallSnapshotCRDs installs the snapshot CRDs of the external-snapshotter release the
// harness runs, read from its client module in the Go module cache (they are never copied
// into this repository), and waits until the API server serves them.
func InstallSnapshotCRDs(t testing.TB, c *Cluster) {
	t.Helper()
	ctx := context.Background()
	info, err := tools.ModDownload(tools.SnapshotClientModule, tools.SnapshotterVersion)
	if err != nil {
		t.Fatal(err)
	}
	dir := info.Dir
	files, err := filepath.Glob(filepath.Join(dir, "config", "crd", "*storage.k8s.io_*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no CRDs under %s/config/crd (%v)", dir, err)
	}
	ap := c.Applier()
	var names []string
	for _, f := range files {
		objs, err := ParseFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if o.GetKind() != "CustomResourceDefinition" {
				continue
			}
			if err := ap.Apply(ctx, o, false); err != nil {
				t.Fatalf("installing %s: %v", filepath.Base(f), err)
			}
			names = append(names, o.GetName())
		}
	}
	dyn := dynamic.NewForConfigOrDie(c.Config)
	for _, n := range names {
		WaitFor(t, 60*time.Second, "CRD "+n+" Established", func() error {
			crd, err := dyn.Resource(crdGVR).Get(ctx, n, metav1.GetOptions{})
			if err != nil {
				return err
			}
			conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
			for _, cd := range conds {
				m, _ := cd.(map[string]any)
				if m["type"] == "Established" && m["status"] == "True" {
					return nil
				}
			}
			return fmt.Errorf("conditions %v", conds)
		})
	}
	t.Logf("installed the snapshot CRDs of %s@%s: %s", tools.SnapshotClientModule, tools.SnapshotterVersion, strings.Join(names, ", "))
}
