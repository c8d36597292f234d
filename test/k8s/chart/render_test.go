package chart

import (
	"bytes"
	"os"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"

	"sigs.k8s.io/yaml"
)

// TestRenderedYAMLMatchesChart fails when deploy/kubernetes/poolcsi.yaml is not what the chart
// renders: someone edited one without the other.
func TestRenderedYAMLMatchesChart(t *testing.T) {
	want, err := render.RenderRepo()
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(render.RenderedFile())
	if err != nil {
		t.Fatalf("%v (generate it: cd test/k8s && go run ./cmd/render)", err)
	}
	if !bytes.Equal(got, want) {
		gl, wl := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
		line := 0
		for line < len(gl) && line < len(wl) && gl[line] == wl[line] {
			line++
		}
		g, w := "<end of file>", "<end of file>"
		if line < len(gl) {
			g = gl[line]
		}
		if line < len(wl) {
			w = wl[line]
		}
		t.Fatalf("deploy/kubernetes/poolcsi.yaml has drifted from deploy/helm/poolcsi: first difference at line %d:\n  file:  %q\n  chart: %q\nregenerate it with: cd test/k8s && go run ./cmd/render",
			line+1, g, w)
	}
}

// chartVariant is a set of values an operator is likely to change, and what the chart
// renders with them.
type chartVariant struct {
	name      string
	overrides map[string]any
	want      []string // kind/name that must be present
	notWant   []string
}

// chartVariants are rendered by TestChartVariants; TestValuesSchema checks the schema
// accepts each of them.
var chartVariants = []chartVariant{
	// The default install: the local pool only, which needs nothing on the nodes (issue: a
	// default shared pool kept every node pod in FailedMount where it was not mounted).
	// The local pools' central controller is the default layout.
	{"defaults", nil,
		[]string{"CSIDriver/local.poolcsi.io", "DaemonSet/poolcsi-node", "ClusterRole/poolcsi-node", "Deployment/poolcsi-local-controller"},
		[]string{"Namespace/poolcsi", "StorageClass/", "Secret/", "Deployment/poolcsi-controller", "CSIDriver/poolcsi.io", "ClusterRole/poolcsi-controller"}},
	{"the per-node layout", perNodeValues(),
		[]string{"CSIDriver/local.poolcsi.io", "DaemonSet/poolcsi-node", "ClusterRole/poolcsi-node"},
		[]string{"Namespace/poolcsi", "StorageClass/", "Secret/", "Deployment/", "CSIDriver/poolcsi.io", "ClusterRole/poolcsi-controller", "CustomResourceDefinition/"}},
	{"a shared pool mounted by the admin, its share key from an existing Secret", withSharedPool(nil),
		[]string{"CSIDriver/poolcsi.io", "CSIDriver/local.poolcsi.io", "Deployment/poolcsi-controller", "DaemonSet/poolcsi-node"},
		[]string{"Secret/"}},
	{"the share key's Secret by its former name, shares.keySecret", map[string]any{
		"pools":  render.SharedPoolValues()["pools"],
		"shares": map[string]any{"keySecret": "my-key"}},
		[]string{"Deployment/poolcsi-controller"}, []string{"Secret/"}},
	{"shares off", map[string]any{"pools": render.SharedPoolValues()["pools"], "shares": map[string]any{"enabled": false}},
		[]string{"Deployment/poolcsi-controller"}, []string{"Secret/"}},
	{"local pools only", map[string]any{"pools": map[string]any{"shared": []any{}}},
		[]string{"CSIDriver/local.poolcsi.io", "DaemonSet/poolcsi-node", "ClusterRole/poolcsi-node", "Deployment/poolcsi-local-controller"},
		[]string{"CSIDriver/poolcsi.io", "Deployment/poolcsi-controller", "ClusterRole/poolcsi-controller"}},
	{"shared pools only, mounted by poolcsi", map[string]any{"pools": map[string]any{"local": []any{},
		"shared": []any{map[string]any{"name": "nfs", "path": "/mnt/nfs", "mount": map[string]any{"type": "nfs", "source": "server:/export", "options": []any{"nfsvers=4.1"}}}}},
		"shareKey": map[string]any{"existingSecret": "my-key"}},
		[]string{"CSIDriver/poolcsi.io", "Deployment/poolcsi-controller", "DaemonSet/poolcsi-node"},
		[]string{"CSIDriver/local.poolcsi.io", "ClusterRole/poolcsi-node"}},
	{"shared pools, one mounted by the admin and one by poolcsi", map[string]any{"pools": map[string]any{
		"shared": []any{
			map[string]any{"name": "admin", "path": "/mnt/admin"},
			map[string]any{"name": "nfs", "path": "/mnt/nfs", "mount": map[string]any{"type": "nfs", "source": "server:/export"}},
		}}, "shareKey": map[string]any{"existingSecret": "my-key"}},
		[]string{"DaemonSet/poolcsi-node", "Deployment/poolcsi-controller"}, nil},
	{"storage classes", withSharedPool(map[string]any{"createNamespace": true, "storageClasses": []any{
		map[string]any{"name": "poolcsi-local", "pool": "local", "layout": "image", "fsType": "xfs", "default": true},
		map[string]any{"name": "poolcsi-shared-dir", "pool": "shared", "layout": "dir", "shared": true, "allowVolumeExpansion": false},
	}}), []string{"StorageClass/poolcsi-local", "StorageClass/poolcsi-shared-dir", "Namespace/poolcsi"}, nil},
	{"snapshots: local node deployment and classes", withPerNode(withSharedPool(map[string]any{
		"snapshots":     map[string]any{"local": true},
		"snapshotClass": map[string]any{"create": true, "default": true}})),
		[]string{"VolumeSnapshotClass/poolcsi-shared", "VolumeSnapshotClass/poolcsi-local"}, nil},
	{"the local pools' central controller: its channel", map[string]any{"localController": map[string]any{"central": true}},
		[]string{"CustomResourceDefinition/poolcalls.poolcsi.io", "CustomResourceDefinition/poolnodes.poolcsi.io",
			"ValidatingAdmissionPolicy/poolcsi-node-scope", "Role/poolcsi-node-agent", "DaemonSet/poolcsi-node"}, nil},
	{"snapshots: the central layout's classes", withSharedPool(map[string]any{
		"snapshotClass": map[string]any{"create": true, "default": true}}),
		[]string{"VolumeSnapshotClass/poolcsi-shared", "VolumeSnapshotClass/poolcsi-local"}, nil},
	{"snapshots disabled", withSharedPool(map[string]any{
		"snapshots":     map[string]any{"enabled": false},
		"snapshotClass": map[string]any{"create": true}}),
		nil, []string{"VolumeSnapshotClass/"}},
}

// withSharedPool adds SharedPoolValues to values (nil: none).
func withSharedPool(values map[string]any) map[string]any {
	out := render.SharedPoolValues()
	for k, v := range values {
		out[k] = v
	}
	return out
}

// TestChartVariants renders the chart with the values an operator is likely to change and
// checks the result is well-formed and consistent.
func TestChartVariants(t *testing.T) {
	for _, tc := range chartVariants {
		t.Run(tc.name, func(t *testing.T) {
			docs, err := render.Render(render.ChartDir(), "", tc.overrides)
			if err != nil {
				t.Fatal(err)
			}
			have := map[string]render.Doc{}
			var all []string
			for _, d := range docs {
				have[d.Kind+"/"+d.Name] = d
				all = append(all, d.Kind+"/"+d.Name)
				var obj map[string]any
				if err := yaml.UnmarshalStrict([]byte(d.YAML), &obj); err != nil {
					t.Errorf("%s/%s from %s: %v", d.Kind, d.Name, d.Source, err)
				}
			}
			for _, w := range tc.want {
				if _, ok := have[w]; !ok {
					t.Errorf("missing %s; rendered %v", w, all)
				}
			}
			for _, nw := range tc.notWant {
				for k := range have {
					if strings.HasPrefix(k, nw) && (strings.HasSuffix(nw, "/") || k == nw) {
						t.Errorf("unexpected %s", k)
					}
				}
			}
			checkSnapshotters(t, tc.overrides, have)
			checkShareKey(t, tc.overrides, have)
			checkPoolHostPaths(t, tc.overrides, have)
			if sc, ok := have["StorageClass/poolcsi-local"]; ok {
				for _, s := range []string{"provisioner: local.poolcsi.io", "volumeBindingMode: WaitForFirstConsumer", `csi.storage.k8s.io/fstype: "xfs"`, `is-default-class: "true"`} {
					if !strings.Contains(sc.YAML, s) {
						t.Errorf("local StorageClass lacks %q:\n%s", s, sc.YAML)
					}
				}
			}
			if sc, ok := have["StorageClass/poolcsi-shared-dir"]; ok {
				for _, s := range []string{"provisioner: poolcsi.io", "allowVolumeExpansion: false", "volumeBindingMode: Immediate"} {
					if !strings.Contains(sc.YAML, s) {
						t.Errorf("shared StorageClass lacks %q:\n%s", s, sc.YAML)
					}
				}
				if strings.Contains(sc.YAML, "fstype") {
					t.Errorf("dir layout must not carry an fstype:\n%s", sc.YAML)
				}
			}
		})
	}
}

// checkSnapshotters: csi-snapshotter runs leader-elected in the Deployments unless
// snapshots.enabled is false, and per node (--node-deployment, never leader-elected, which
// the sidecar refuses) in the DaemonSet only with snapshots.local.
func checkSnapshotters(t *testing.T, overrides map[string]any, have map[string]render.Doc) {
	t.Helper()
	snaps, _ := overrides["snapshots"].(map[string]any)
	wantShared, wantLocal := true, false
	if v, ok := snaps["enabled"].(bool); ok {
		wantShared = v
	}
	if v, ok := snaps["local"].(bool); ok {
		wantLocal = v
	}
	if dep, ok := have["Deployment/poolcsi-controller"]; ok {
		if got := strings.Contains(dep.YAML, "- name: csi-snapshotter\n"); got != wantShared {
			t.Errorf("Deployment has csi-snapshotter: %v, want %v", got, wantShared)
		}
		if got := strings.Contains(have["ClusterRole/poolcsi-controller"].YAML, "volumesnapshotcontents/status"); got != wantShared {
			t.Errorf("ClusterRole poolcsi-controller may update volumesnapshotcontents/status: %v, want %v", got, wantShared)
		}
	}
	// The local pools' central controller (the default layout) takes every local snapshot
	// with snapshots.enabled; snapshots.local is the per-node layout's alone.
	if dep, ok := have["Deployment/poolcsi-local-controller"]; ok {
		if got := strings.Contains(dep.YAML, "- name: csi-snapshotter\n"); got != wantShared {
			t.Errorf("the local controller has csi-snapshotter: %v, want %v", got, wantShared)
		}
	}
	ds, ok := have["DaemonSet/poolcsi-node"]
	if !ok || !strings.Contains(ds.YAML, "csi-provisioner-local") {
		return
	}
	i := strings.Index(ds.YAML, "- name: csi-snapshotter-local\n")
	if got := i >= 0; got != wantLocal {
		t.Fatalf("DaemonSet has csi-snapshotter-local: %v, want %v", got, wantLocal)
	}
	if got := strings.Contains(have["ClusterRole/poolcsi-node"].YAML, "volumesnapshotcontents/status"); got != wantLocal {
		t.Errorf("ClusterRole poolcsi-node may update volumesnapshotcontents/status: %v, want %v", got, wantLocal)
	}
	if i < 0 {
		return
	}
	c := ds.YAML[i:]
	if j := strings.Index(c[1:], "\n        - name: "); j >= 0 {
		c = c[:j+1]
	}
	for _, s := range []string{"--node-deployment", "name: NODE_NAME"} {
		if !strings.Contains(c, s) {
			t.Errorf("csi-snapshotter-local lacks %q:\n%s", s, c)
		}
	}
	if strings.Contains(c, "--leader-election") {
		t.Errorf("csi-snapshotter-local is leader-elected; with --node-deployment the sidecar exits:\n%s", c)
	}
}

// checkShareKey: where shares are on, the controller and the node plugin of the shared
// driver read the cluster's share key from the Secret shareKey.existingSecret (or its
// former name, shares.keySecret) names; where they are off, neither is given one.
func checkShareKey(t *testing.T, overrides map[string]any, have map[string]render.Doc) {
	t.Helper()
	shares, _ := overrides["shares"].(map[string]any)
	shareKey, _ := overrides["shareKey"].(map[string]any)
	secret, _ := shareKey["existingSecret"].(string)
	if s, ok := shares["keySecret"].(string); ok && s != "" && secret == "" {
		secret = s
	}
	pools, _ := overrides["pools"].(map[string]any)
	shared, _ := pools["shared"].([]any)
	on := shares["enabled"] != false && len(shared) > 0 // shares are the shared driver's
	for _, w := range []string{"Deployment/poolcsi-controller", "DaemonSet/poolcsi-node"} {
		d, ok := have[w]
		if !ok {
			continue
		}
		hasFlag := strings.Contains(d.YAML, "--share-key-file=/etc/poolcsi-share-key/key")
		hasSecret := strings.Contains(d.YAML, "secretName: "+secret)
		if on != hasFlag || on != hasSecret {
			t.Errorf("%s: shares on %t, --share-key-file %t, Secret %s mounted %t", w, on, hasFlag, secret, hasSecret)
		}
	}
}

// checkPoolHostPaths: the node plugin's hostPath of a shared pool the admin mounts is of
// type Directory, so that kubelet never makes a missing share path on the node's own disk
// (an empty directory there looks like a new pool); a pool poolcsi mounts itself, and a
// local pool, may have its directory made (DirectoryOrCreate).
func checkPoolHostPaths(t *testing.T, overrides map[string]any, have map[string]render.Doc) {
	t.Helper()
	d, ok := have["DaemonSet/poolcsi-node"]
	if !ok {
		return
	}
	var ds struct {
		Spec struct {
			Template struct {
				Spec struct {
					Volumes []struct {
						Name     string
						HostPath *struct{ Path, Type string }
					}
				}
			}
		}
	}
	if err := yaml.Unmarshal([]byte(d.YAML), &ds); err != nil {
		t.Fatalf("DaemonSet/poolcsi-node: %v", err)
	}
	mountedByPoolcsi := map[string]bool{}
	pools, _ := overrides["pools"].(map[string]any)
	shared, _ := pools["shared"].([]any)
	for _, p := range shared {
		if p, ok := p.(map[string]any); ok && p["mount"] != nil {
			mountedByPoolcsi[p["name"].(string)] = true
		}
	}
	seen := 0
	for _, v := range ds.Spec.Template.Spec.Volumes {
		var want string
		switch {
		case strings.HasPrefix(v.Name, "pool-shared-"):
			want = "Directory"
			if mountedByPoolcsi[strings.TrimPrefix(v.Name, "pool-shared-")] {
				want = "DirectoryOrCreate"
			}
		case strings.HasPrefix(v.Name, "pool-local-"):
			want = "DirectoryOrCreate"
		default:
			continue
		}
		seen++
		if v.HostPath == nil || v.HostPath.Type != want {
			t.Errorf("DaemonSet/poolcsi-node volume %s: hostPath %+v, want type %s", v.Name, v.HostPath, want)
		}
	}
	if seen == 0 {
		t.Errorf("DaemonSet/poolcsi-node has no pool volumes")
	}
}

// TestMaxVolumesReachEachDriver: node.maxVolumes gives each driver's node plugin its own
// --max-volumes-per-node (reported in CSINode for the scheduler), and 0 leaves it out.
func TestMaxVolumesReachEachDriver(t *testing.T) {
	for _, tc := range []struct {
		name          string
		max           map[string]any
		shared, local string // the flag expected in each container, "" for none
	}{
		{name: "default", max: nil},
		{name: "both", max: map[string]any{"shared": 8, "local": 4}, shared: "--max-volumes-per-node=8", local: "--max-volumes-per-node=4"},
		{name: "local only", max: map[string]any{"shared": 0, "local": 16}, local: "--max-volumes-per-node=16"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			overrides := withSharedPool(nil)
			if tc.max != nil {
				overrides["node"] = map[string]any{"maxVolumes": tc.max}
			}
			docs, err := render.Render(render.ChartDir(), "", overrides)
			if err != nil {
				t.Fatal(err)
			}
			var ds string
			for _, d := range docs {
				if d.Kind == "DaemonSet" && d.Name == "poolcsi-node" {
					ds = d.YAML
				}
			}
			for container, want := range map[string]string{"poolcsi": tc.shared, "poolcsi-local": tc.local} {
				c := containerYAML(t, ds, container)
				n := strings.Count(c, "--max-volumes-per-node")
				switch {
				case want == "" && n != 0:
					t.Errorf("container %s has --max-volumes-per-node, want none:\n%s", container, c)
				case want != "" && (n != 1 || !strings.Contains(c, "- "+want+"\n")):
					t.Errorf("container %s: want exactly %q:\n%s", container, want, c)
				}
			}
		})
	}
}

// containerYAML is the part of a pod template's YAML that is container name's.
func containerYAML(t *testing.T, podYAML, name string) string {
	t.Helper()
	i := strings.Index(podYAML, "- name: "+name+"\n")
	if i < 0 {
		t.Fatalf("no container %s in:\n%s", name, podYAML)
	}
	c := podYAML[i:]
	if j := strings.Index(c[1:], "\n        - name: "); j >= 0 {
		c = c[:j+1]
	}
	return c
}
