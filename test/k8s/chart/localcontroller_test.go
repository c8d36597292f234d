package chart

import (
	"maps"
	"slices"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// withCentral is overrides with localController.central on (the default, said explicitly).
func withCentral(overrides map[string]any) map[string]any {
	out := maps.Clone(overrides)
	if out == nil {
		out = map[string]any{}
	}
	maps.Copy(out, centralValues())
	return out
}

// withPerNode is overrides with localController.central off: the per-node layout.
func withPerNode(overrides map[string]any) map[string]any {
	out := maps.Clone(overrides)
	if out == nil {
		out = map[string]any{}
	}
	maps.Copy(out, perNodeValues())
	return out
}

func container(t *testing.T, spec corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s; have %v", name, containerNames(spec))
	return corev1.Container{}
}

func containerNames(spec corev1.PodSpec) []string {
	var out []string
	for _, c := range spec.Containers {
		out = append(out, c.Name)
	}
	return out
}

// hasArgs: every one of want is among the container's arguments.
func hasArgs(t *testing.T, c corev1.Container, want ...string) {
	t.Helper()
	for _, w := range want {
		if !slices.Contains(c.Args, w) {
			t.Errorf("%s lacks %s: %v", c.Name, w, c.Args)
		}
	}
}

// TestLocalControllerDeployment: with localController.central, one Deployment runs poolcsi
// serve --local-central before the released provisioner, resizer and snapshotter in their
// leader-elected central mode, with the images the node pod's local sidecars have without
// it; poolcsi there opens no pool (no hostPath, not privileged).
func TestLocalControllerDeployment(t *testing.T) {
	def := renderMap(t, perNodeValues())
	on := renderMap(t, centralValues())
	var dep appsv1.Deployment
	strict(t, on["Deployment/poolcsi-local-controller"], &dep)
	var oldDS appsv1.DaemonSet
	strict(t, def["DaemonSet/poolcsi-node"], &oldDS)
	pod := dep.Spec.Template.Spec

	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != 1 {
		t.Errorf("replicas %v, want 1", dep.Spec.Replicas)
	}
	if pod.ServiceAccountName != "poolcsi-local-controller" {
		t.Errorf("service account %q", pod.ServiceAccountName)
	}
	if dep.Namespace != render.Namespace {
		t.Errorf("namespace %q", dep.Namespace)
	}
	for _, v := range pod.Volumes {
		if v.HostPath != nil {
			t.Errorf("volume %s is a host path: the central controller opens no pool", v.Name)
		}
	}

	p := container(t, pod, "poolcsi")
	hasArgs(t, p, "serve", "--mode=controller", "--local-central", "--driver-name=local.poolcsi.io",
		"--endpoint=unix:///csi/csi.sock", "--config=/etc/poolcsi/local.yaml", "--calls-namespace="+render.Namespace,
		"--healthz-address=:9821", "--metrics-address=:9824")
	// The metrics port has the name the chart's monitors scrape (TestMonitoringKit).
	if !slices.ContainsFunc(p.Ports, func(cp corev1.ContainerPort) bool { return cp.Name == "local-metrics" && cp.ContainerPort == 9824 }) {
		t.Errorf("poolcsi does not declare the port local-metrics 9824: %v", p.Ports)
	}
	for _, a := range p.Args {
		for _, no := range []string{"--local-agent", "--registration-dir", "--claim-local-snapshots", "--pool="} {
			if strings.HasPrefix(a, no) {
				t.Errorf("poolcsi has %s, which --local-central refuses", a)
			}
		}
	}
	if sc := p.SecurityContext; sc != nil && sc.Privileged != nil && *sc.Privileged {
		t.Error("poolcsi is privileged")
	}

	images := map[string]string{}
	for _, c := range oldDS.Spec.Template.Spec.Containers {
		images[c.Name] = c.Image
	}
	for name, local := range map[string]string{
		"csi-provisioner": "csi-provisioner-local",
		"csi-resizer":     "csi-resizer-local",
	} {
		if c := container(t, pod, name); c.Image != images[local] || c.Image == "" {
			t.Errorf("%s runs %q, the node pod's %s %q", name, c.Image, local, images[local])
		}
	}
	prov := container(t, pod, "csi-provisioner")
	hasArgs(t, prov, "--leader-election", "--leader-election-namespace="+render.Namespace, "--strict-topology",
		"--enable-capacity", "--capacity-ownerref-level=2", "--extra-create-metadata", "--timeout=60s",
		"--immediate-topology=true")
	envs := map[string]bool{}
	for _, e := range prov.Env {
		envs[e.Name] = true
	}
	if !envs["NAMESPACE"] || !envs["POD_NAME"] {
		t.Errorf("csi-provisioner lacks NAMESPACE/POD_NAME (the capacity owner lookup): %v", prov.Env)
	}
	hasArgs(t, container(t, pod, "csi-resizer"), "--leader-election", "--leader-election-namespace="+render.Namespace, "--timeout=60s")
	snap := container(t, pod, "csi-snapshotter")
	hasArgs(t, snap, "--leader-election", "--leader-election-namespace="+render.Namespace, "--timeout=60s")
	for _, c := range pod.Containers {
		if slices.Contains(c.Args, "--node-deployment") {
			t.Errorf("%s runs --node-deployment", c.Name)
		}
	}
	// The snapshotter's image is the one the node pod has with snapshots.local.
	var snapDS appsv1.DaemonSet
	strict(t, renderMap(t, withPerNode(map[string]any{"snapshots": map[string]any{"local": true}}))["DaemonSet/poolcsi-node"], &snapDS)
	if want := container(t, snapDS.Spec.Template.Spec, "csi-snapshotter-local").Image; snap.Image != want {
		t.Errorf("csi-snapshotter runs %q, the node pod's %q", snap.Image, want)
	}

	t.Run("variants", func(t *testing.T) {
		for _, tc := range []struct {
			name      string
			overrides map[string]any
			check     func(t *testing.T, pod corev1.PodSpec, dep appsv1.Deployment)
		}{
			{"snapshots off: no snapshotter", map[string]any{"snapshots": map[string]any{"enabled": false}}, func(t *testing.T, pod corev1.PodSpec, _ appsv1.Deployment) {
				if slices.Contains(containerNames(pod), "csi-snapshotter") {
					t.Error("csi-snapshotter runs with snapshots.enabled false")
				}
			}},
			{"the livenessprobe sidecar", map[string]any{"controller": map[string]any{"builtinLivenessProbe": false}}, func(t *testing.T, pod corev1.PodSpec, _ appsv1.Deployment) {
				hasArgs(t, container(t, pod, "liveness-probe"), "--csi-address=/csi/csi.sock", "--http-endpoint=:9821")
				if slices.ContainsFunc(container(t, pod, "poolcsi").Args, func(a string) bool { return strings.HasPrefix(a, "--healthz-address") }) {
					t.Error("poolcsi serves /healthz beside the livenessprobe sidecar")
				}
			}},
			{"Immediate claims left Pending", map[string]any{"node": map[string]any{"localImmediateBinding": false}}, func(t *testing.T, pod corev1.PodSpec, _ appsv1.Deployment) {
				hasArgs(t, container(t, pod, "csi-provisioner"), "--immediate-topology=false")
			}},
			{"replicas", map[string]any{"localController": map[string]any{"central": true, "replicas": 3}}, func(t *testing.T, _ corev1.PodSpec, dep appsv1.Deployment) {
				if dep.Spec.Replicas == nil || *dep.Spec.Replicas != 3 {
					t.Errorf("replicas %v, want 3", dep.Spec.Replicas)
				}
			}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				overrides := withCentral(tc.overrides)
				if lc, ok := tc.overrides["localController"]; ok {
					overrides["localController"] = lc
				}
				var dep appsv1.Deployment
				strict(t, renderMap(t, overrides)["Deployment/poolcsi-local-controller"], &dep)
				tc.check(t, dep.Spec.Template.Spec, dep)
			})
		}
	})
}

// TestLocalControllerNodePod: with localController.central, the node pod's local driver
// runs the agent and no sidecar of its own (snapshots.local and node.localResizer
// included); without it, the per-node sidecars are today's.
func TestLocalControllerNodePod(t *testing.T) {
	local := []string{"csi-provisioner-local", "csi-resizer-local", "csi-snapshotter-local"}
	all := map[string]any{"snapshots": map[string]any{"local": true}, "node": map[string]any{"localResizer": true}}
	for _, tc := range []struct {
		name      string
		overrides map[string]any
		central   bool
	}{
		{"central", withCentral(all), true},
		{"central, plain sidecars", withCentral(map[string]any{"node": map[string]any{"builtinRegistration": false}}), true},
		{"defaults", nil, true},
		{"per node", withPerNode(all), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ds appsv1.DaemonSet
			strict(t, renderMap(t, tc.overrides)["DaemonSet/poolcsi-node"], &ds)
			pod := ds.Spec.Template.Spec
			names := containerNames(pod)
			for _, s := range local {
				if got := slices.Contains(names, s); got == tc.central {
					t.Errorf("%s in the node pod: %v (central %v)", s, got, tc.central)
				}
			}
			p := container(t, pod, "poolcsi-local")
			agent := slices.Contains(p.Args, "--local-agent")
			if agent != tc.central {
				t.Errorf("poolcsi-local --local-agent: %v, want %v: %v", agent, tc.central, p.Args)
			}
			if tc.central {
				hasArgs(t, p, "--mode=all", "--expand-on-node", "--calls-namespace="+render.Namespace)
				if slices.Contains(p.Args, "--claim-local-snapshots") {
					t.Error("poolcsi-local labels contents for a node snapshotter that is gone")
				}
			}
		})
	}
}

// TestLocalControllerRBAC: the central controller has what its sidecars, the capacity
// migration and the owner lookup need; the node's ClusterRole keeps only its Node's
// lookup, and the node's Role (leases, CSIStorageCapacity, the DaemonSet) goes.
func TestLocalControllerRBAC(t *testing.T) {
	def := renderMap(t, perNodeValues())
	on := renderMap(t, centralValues())
	// The node's RBAC is the per-node layout's while that layout exists: an upgrade
	// changes RBAC at once and rolls the DaemonSet node by node, and the pods not yet
	// rolled still run the per-node sidecars, which must go on serving their nodes' claims
	// (docs/design/central-controller.md §8 item 3). The agent needs nodes get of it.
	for _, k := range []string{"ClusterRole/poolcsi-node", "Role/poolcsi-node", "RoleBinding/poolcsi-node"} {
		if def[k].YAML == "" || on[k].YAML != def[k].YAML {
			t.Errorf("%s differs with localController.central (the upgrade window needs it as it was)", k)
		}
	}
	var node rbacv1.ClusterRole
	strict(t, on["ClusterRole/poolcsi-node"], &node)
	nodeGet := false
	for _, r := range node.Rules {
		nodeGet = nodeGet || (slices.Contains(r.APIGroups, "") && slices.Contains(r.Resources, "nodes") && slices.Contains(r.Verbs, "get"))
	}
	if !nodeGet {
		t.Errorf("the node's ClusterRole lacks nodes get, which the agent needs: %+v", node.Rules)
	}
	checkBinding(t, on["ClusterRoleBinding/poolcsi-node"], "ClusterRole", "poolcsi-node", "poolcsi-node")

	var ctl rbacv1.ClusterRole
	strict(t, on["ClusterRole/poolcsi-local-controller"], &ctl)
	grants := func(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
		for _, r := range rules {
			if slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb) {
				return true
			}
		}
		return false
	}
	for _, g := range []struct{ group, resource, verb string }{
		{"", "persistentvolumes", "create"},
		{"", "persistentvolumeclaims", "update"},
		{"", "nodes", "get"},
		{"storage.k8s.io", "csinodes", "watch"},
		{"snapshot.storage.k8s.io", "volumesnapshotcontents", "patch"},
		{"snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update"},
		{"groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "watch"},
	} {
		if !grants(ctl.Rules, g.group, g.resource, g.verb) {
			t.Errorf("the local controller's ClusterRole lacks %s %s/%s", g.verb, g.group, g.resource)
		}
	}
	role := decodeRole(t, on["Role/poolcsi-local-controller"])
	for _, g := range []struct{ group, resource, verb string }{
		{"coordination.k8s.io", "leases", "update"},
		{"storage.k8s.io", "csistoragecapacities", "delete"},
		{"storage.k8s.io", "csistoragecapacities", "list"},
		{"apps", "deployments", "get"},
		{"apps", "replicasets", "get"},
		{"", "pods", "get"},
		{"", "pods", "list"},
	} {
		if !grants(role.Rules, g.group, g.resource, g.verb) {
			t.Errorf("the local controller's Role lacks %s %s/%s", g.verb, g.group, g.resource)
		}
	}
	// Without snapshots, still the group contents' read (the hints).
	var noSnap rbacv1.ClusterRole
	strict(t, renderMap(t, withCentral(map[string]any{"snapshots": map[string]any{"enabled": false}}))["ClusterRole/poolcsi-local-controller"], &noSnap)
	if !grants(noSnap.Rules, "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "list") ||
		grants(noSnap.Rules, "snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update") {
		t.Errorf("snapshots off: %+v", noSnap.Rules)
	}
}
