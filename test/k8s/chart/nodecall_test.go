package chart

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"
)

// centralValues turns on the channel of the local pools' central controller.
func centralValues() map[string]any {
	return map[string]any{"localController": map[string]any{"central": true}}
}

// centralObjects are the objects localController.central adds, and nothing else
// (docs/design/central-controller.md §1, §2, §3).
var centralObjects = []string{
	"Deployment/poolcsi-local-controller",
	"CustomResourceDefinition/poolcalls.poolcsi.io",
	"CustomResourceDefinition/poolnodes.poolcsi.io",
	"ServiceAccount/poolcsi-local-controller",
	"ClusterRole/poolcsi-local-controller",
	"ClusterRoleBinding/poolcsi-local-controller",
	"Role/poolcsi-local-controller",
	"RoleBinding/poolcsi-local-controller",
	"Role/poolcsi-node-agent",
	"RoleBinding/poolcsi-node-agent",
	"ValidatingAdmissionPolicy/poolcsi-node-scope",
	"ValidatingAdmissionPolicyBinding/poolcsi-node-scope",
}

// centralChanged are the objects localController.central changes: the node pod loses its
// local sidecars and runs the agent. The node's RBAC is not among them: the pods of nodes
// an upgrade has not rolled yet still run the sidecars (TestLocalControllerRBAC).
var centralChanged = []string{"DaemonSet/poolcsi-node"}

// centralRemoved are the objects it removes: none while the per-node path exists.
var centralRemoved = []string{}

func renderMap(t *testing.T, overrides map[string]any) map[string]render.Doc {
	t.Helper()
	docs, err := render.Render(render.ChartDir(), "", overrides)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]render.Doc{}
	for _, d := range docs {
		m[d.Kind+"/"+d.Name] = d
	}
	return m
}

// perNodeValues turns the local pools' central controller off: the per-node layout, the
// node pods running the local provisioner, resizer and (snapshots.local) snapshotter.
func perNodeValues() map[string]any {
	return map[string]any{"localController": map[string]any{"central": false}}
}

// perNodeGolden is the plain YAML (deploy/kubernetes/values.yaml) with
// localController.central false, the chart's version written VERSION: the per-node layout
// as it was the default until the central controller became it.
var perNodeGolden = filepath.Join("testdata", "pernode.yaml")

// TestLocalControllerOff: localController.central false renders the per-node layout byte
// for byte as it was when it was the default (testdata/pernode.yaml, so that an installed
// chart that keeps it upgrades to the same objects), and nothing of the channel. A change
// to the per-node layout meant on purpose rewrites the file with POOLCSI_UPDATE_GOLDEN=1.
func TestLocalControllerOff(t *testing.T) {
	off, err := render.Render(render.ChartDir(), render.RenderedValues(), perNodeValues())
	if err != nil {
		t.Fatal(err)
	}
	ch, err := loader.Load(render.ChartDir())
	if err != nil {
		t.Fatal(err)
	}
	got := bytes.ReplaceAll(render.Join(off), []byte(ch.Metadata.Version), []byte("VERSION"))
	if os.Getenv("POOLCSI_UPDATE_GOLDEN") == "1" {
		if err := os.WriteFile(perNodeGolden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(perNodeGolden)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		g, w := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
		i := 0
		for i < len(g) && i < len(w) && g[i] == w[i] {
			i++
		}
		line := func(l []string) string {
			if i < len(l) {
				return l[i]
			}
			return "(end)"
		}
		t.Errorf("localController.central=false renders otherwise than %s: first difference at line %d:\n  file:  %q\n  chart: %q",
			perNodeGolden, i+1, line(w), line(g))
	}
	for _, d := range off {
		if strings.Contains(d.YAML, "poolcsi.io/v1alpha1") || strings.Contains(d.YAML, "poolcalls") ||
			d.Kind == "CustomResourceDefinition" || strings.HasPrefix(d.Kind, "ValidatingAdmissionPolicy") {
			t.Errorf("with the central controller off: %s/%s from %s", d.Kind, d.Name, d.Source)
		}
	}
}

// TestLocalControllerDefault: the chart's defaults are the central layout.
func TestLocalControllerDefault(t *testing.T) {
	def, err := render.Render(render.ChartDir(), render.RenderedValues(), nil)
	if err != nil {
		t.Fatal(err)
	}
	on, err := render.Render(render.ChartDir(), render.RenderedValues(), centralValues())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(render.Join(def), render.Join(on)) {
		t.Error("the defaults render otherwise than localController.central=true")
	}
}

// TestLocalControllerCentral: localController.central adds the central Deployment, the
// CRDs, their RBAC and the per-node admission policy, changes only the node pod and its
// ClusterRole (localcontroller_test.go checks those), removes the node's Role, and each is
// what the design says:
// the field names the Go types (internal/nodecall) use, the node agent's rights and the
// policy's subject.
func TestLocalControllerCentral(t *testing.T) {
	def := renderMap(t, perNodeValues())
	on := renderMap(t, centralValues())
	var added []string
	for k, d := range on {
		old, ok := def[k]
		if !ok {
			added = append(added, k)
			continue
		}
		if old.YAML != d.YAML && !slices.Contains(centralChanged, k) {
			t.Errorf("%s changes with localController.central", k)
		}
	}
	var removed []string
	for k := range def {
		if _, ok := on[k]; !ok {
			removed = append(removed, k)
		}
	}
	if !slices.Equal(sorted(removed), sorted(centralRemoved)) {
		t.Errorf("localController.central removes %v, want %v", sorted(removed), sorted(centralRemoved))
	}
	sort.Strings(added)
	want := slices.Clone(centralObjects)
	sort.Strings(want)
	if !slices.Equal(added, want) {
		t.Errorf("localController.central adds %v, want %v", added, want)
	}
	if len(on) != len(def)+len(centralObjects)-len(centralRemoved) {
		t.Errorf("%d objects with it, %d without", len(on), len(def))
	}

	// No local pool: no local driver, nothing for its controller.
	noLocal := withSharedPool(centralValues())
	noLocal["pools"] = map[string]any{"local": []any{}, "shared": render.SharedPoolValues()["pools"].(map[string]any)["shared"]}
	for k := range renderMap(t, noLocal) {
		if slices.Contains(centralObjects, k) {
			t.Errorf("without a local pool: %s", k)
		}
	}

	t.Run("PoolCall", func(t *testing.T) {
		crd := decodeCRD(t, on["CustomResourceDefinition/poolcalls.poolcsi.io"])
		v := checkCRD(t, crd, "PoolCall", "poolcalls")
		if len(v.SelectableFields) != 1 || v.SelectableFields[0].JSONPath != ".spec.node" {
			t.Errorf("selectableFields %+v, want .spec.node (the agent's field selector)", v.SelectableFields)
		}
		root := v.Schema.OpenAPIV3Schema
		if !slices.Contains(root.Required, "spec") {
			t.Errorf("spec not required: %v", root.Required)
		}
		spec := root.Properties["spec"]
		checkFields(t, "spec", spec, "node", "method", "target", "request", "nonce", "issued", "notAfter")
		if got := sorted(spec.Required); !slices.Equal(got, sorted([]string{"node", "method", "target", "request", "nonce", "issued", "notAfter"})) {
			t.Errorf("spec requires %v", got)
		}
		if len(spec.XValidations) != 1 || spec.XValidations[0].Rule != "self == oldSelf" {
			t.Errorf("spec is not immutable: %+v", spec.XValidations)
		}
		var methods []string
		for _, e := range spec.Properties["method"].Enum {
			var m string
			if err := yaml.Unmarshal(e.Raw, &m); err != nil {
				t.Fatal(err)
			}
			methods = append(methods, m)
		}
		allow := []string{"CreateVolume", "DeleteVolume", "ControllerExpandVolume", "ControllerModifyVolume", "ControllerGetVolume",
			"ValidateVolumeCapabilities", "CreateSnapshot", "DeleteSnapshot", "ListSnapshots",
			"CreateVolumeGroupSnapshot", "DeleteVolumeGroupSnapshot", "GetVolumeGroupSnapshot",
			"FreezeGroupHold", "SnapshotHeld", "ThawGroup"}
		if !slices.Equal(sorted(methods), sorted(allow)) {
			t.Errorf("method enum %v, want the allow-list %v", methods, allow)
		}
		for _, f := range []string{"request"} {
			if m := spec.Properties[f].MaxLength; m == nil || *m != 262144 {
				t.Errorf("spec.%s maxLength %v, want 262144", f, m)
			}
		}
		if p := spec.Properties["nonce"].Pattern; p != "^[0-9a-f]{32}$" {
			t.Errorf("spec.nonce pattern %q", p)
		}
		for _, f := range []string{"issued", "notAfter"} {
			if spec.Properties[f].Format != "date-time" {
				t.Errorf("spec.%s is not a time: %+v", f, spec.Properties[f])
			}
		}
		status := root.Properties["status"]
		checkFields(t, "status", status, "nonce", "phase", "code", "message", "response", "attempts", "started", "finished")
		if m := status.Properties["response"].MaxLength; m == nil || *m != 262144 {
			t.Errorf("status.response maxLength %v, want 262144", m)
		}
		if len(status.Properties["phase"].Enum) != 2 {
			t.Errorf("status.phase enum %v, want Running and Done", status.Properties["phase"].Enum)
		}
	})

	t.Run("PoolNode", func(t *testing.T) {
		crd := decodeCRD(t, on["CustomResourceDefinition/poolnodes.poolcsi.io"])
		v := checkCRD(t, crd, "PoolNode", "poolnodes")
		root := v.Schema.OpenAPIV3Schema
		checkFields(t, "spec", root.Properties["spec"])
		status := root.Properties["status"]
		checkFields(t, "status", status, "renewTime", "agent", "pools")
		checkFields(t, "status.agent", status.Properties["agent"], "version", "pod")
		pools := status.Properties["pools"]
		if pools.XListType == nil || *pools.XListType != "map" || !slices.Equal(pools.XListMapKeys, []string{"name"}) {
			t.Errorf("status.pools is not a list keyed by name: %+v", pools)
		}
		item := pools.Items.Schema
		checkFields(t, "status.pools[]", *item, "name", "availableBytes", "maximumVolumeSize", "minimumVolumeSize", "condition")
		for _, f := range []string{"availableBytes", "maximumVolumeSize", "minimumVolumeSize"} {
			if p := item.Properties[f]; p.Type != "integer" || p.Format != "int64" {
				t.Errorf("status.pools[].%s is %s/%s, want integer/int64", f, p.Type, p.Format)
			}
		}
	})

	nodeSA := daemonSetAccount(t, on["DaemonSet/poolcsi-node"])
	t.Run("RBAC", func(t *testing.T) {
		agent := decodeRole(t, on["Role/poolcsi-node-agent"])
		wantAgent := map[string][]string{
			"poolcalls":        {"get", "list", "watch"},
			"poolcalls/status": {"update", "patch"},
			"poolnodes":        {"get", "create"},
			"poolnodes/status": {"update", "patch"},
		}
		if got := poolcsiRules(agent.Rules); !reflect.DeepEqual(got, wantAgent) {
			t.Errorf("the node agent's rights: %v, want %v", got, wantAgent)
		}
		if len(poolcsiRules(agent.Rules)) != len(agent.Rules) {
			t.Errorf("the node agent's Role grants more than poolcsi.io: %+v", agent.Rules)
		}
		checkBinding(t, on["RoleBinding/poolcsi-node-agent"], "Role", "poolcsi-node-agent", nodeSA)
		ctl := decodeRole(t, on["Role/poolcsi-local-controller"])
		wantCtl := map[string][]string{
			"poolcalls": {"get", "list", "watch", "create", "delete"},
			"poolnodes": {"get", "list", "watch"},
		}
		if got := poolcsiRules(ctl.Rules); !reflect.DeepEqual(got, wantCtl) {
			t.Errorf("the local controller's rights on poolcsi.io: %v, want %v", got, wantCtl)
		}
		checkBinding(t, on["RoleBinding/poolcsi-local-controller"], "Role", "poolcsi-local-controller", "poolcsi-local-controller")
		checkBinding(t, on["ClusterRoleBinding/poolcsi-local-controller"], "ClusterRole", "poolcsi-local-controller", "poolcsi-local-controller")
		// The node's own ClusterRole gains nothing of poolcsi.io: that is the agent's Role.
		if strings.Contains(on["ClusterRole/poolcsi-node"].YAML, "poolcsi.io") {
			t.Errorf("ClusterRole/poolcsi-node gains poolcsi.io rights")
		}
	})

	t.Run("policy", func(t *testing.T) {
		var vap admissionv1.ValidatingAdmissionPolicy
		strict(t, on["ValidatingAdmissionPolicy/poolcsi-node-scope"], &vap)
		if vap.Spec.FailurePolicy == nil || *vap.Spec.FailurePolicy != admissionv1.Fail {
			t.Errorf("failurePolicy %v, want Fail", vap.Spec.FailurePolicy)
		}
		wantUser := `request.userInfo.username == "system:serviceaccount:` + render.Namespace + `:` + nodeSA + `"`
		if len(vap.Spec.MatchConditions) != 1 || vap.Spec.MatchConditions[0].Expression != wantUser {
			t.Errorf("matchConditions %+v, want %s (the DaemonSet's account)", vap.Spec.MatchConditions, wantUser)
		}
		rules := vap.Spec.MatchConstraints.ResourceRules
		if len(rules) != 1 || !slices.Equal(sorted(rules[0].Resources), []string{"poolcalls", "poolcalls/status", "poolnodes", "poolnodes/status"}) ||
			!slices.Equal(sorted(rules[0].APIGroups), []string{"poolcsi.io"}) {
			t.Errorf("the policy matches %+v", rules)
		}
		if ops := rules[0].Operations; !slices.Equal(sorted(stringsOf(ops)), []string{"CREATE", "DELETE", "UPDATE"}) {
			t.Errorf("the policy judges %v, want CREATE, UPDATE, DELETE", ops)
		}
		var userNode string
		for _, v := range vap.Spec.Variables {
			if v.Name == "userNode" {
				userNode = v.Expression
			}
		}
		if !strings.Contains(userNode, "'authentication.kubernetes.io/node-name'") {
			t.Errorf("userNode %q does not read the token's node-name extra", userNode)
		}
		var b admissionv1.ValidatingAdmissionPolicyBinding
		strict(t, on["ValidatingAdmissionPolicyBinding/poolcsi-node-scope"], &b)
		if b.Spec.PolicyName != vap.Name || !slices.Equal(b.Spec.ValidationActions, []admissionv1.ValidationAction{admissionv1.Deny}) {
			t.Errorf("binding %+v", b.Spec)
		}
		if sel := b.Spec.MatchResources.NamespaceSelector; sel == nil || sel.MatchLabels["kubernetes.io/metadata.name"] != render.Namespace {
			t.Errorf("the binding is not the release namespace's: %+v", b.Spec.MatchResources)
		}
	})
}

// TestKubeVersion: the chart needs 1.32, where a pod-bound token names its node
// (ServiceAccountTokenPodNodeInfo GA), which the per-node policy reads.
func TestKubeVersion(t *testing.T) {
	ch, err := loader.Load(render.ChartDir())
	if err != nil {
		t.Fatal(err)
	}
	for v, want := range map[string]bool{"v1.31.9": false, "v1.32.0": true, "v1.36.3": true} {
		if got := chartutil.IsCompatibleRange(ch.Metadata.KubeVersion, v); got != want {
			t.Errorf("kubeVersion %q takes %s: %v, want %v", ch.Metadata.KubeVersion, v, got, want)
		}
	}
}

func strict(t *testing.T, d render.Doc, into any) {
	t.Helper()
	if d.YAML == "" {
		t.Fatalf("not rendered")
	}
	if err := yaml.UnmarshalStrict([]byte(d.YAML), into); err != nil {
		t.Fatalf("%s/%s: %v", d.Kind, d.Name, err)
	}
}

func decodeCRD(t *testing.T, d render.Doc) *apiextensionsv1.CustomResourceDefinition {
	t.Helper()
	var crd apiextensionsv1.CustomResourceDefinition
	strict(t, d, &crd)
	return &crd
}

// checkCRD checks what both CRDs share and returns their one version.
func checkCRD(t *testing.T, crd *apiextensionsv1.CustomResourceDefinition, kind, plural string) apiextensionsv1.CustomResourceDefinitionVersion {
	t.Helper()
	if crd.Spec.Group != "poolcsi.io" || crd.Spec.Names.Kind != kind || crd.Spec.Names.Plural != plural ||
		crd.Spec.Scope != apiextensionsv1.NamespaceScoped {
		t.Errorf("%s: group %s, kind %s, plural %s, scope %s", crd.Name, crd.Spec.Group, crd.Spec.Names.Kind, crd.Spec.Names.Plural, crd.Spec.Scope)
	}
	if len(crd.Spec.Versions) != 1 {
		t.Fatalf("%s: %d versions", crd.Name, len(crd.Spec.Versions))
	}
	v := crd.Spec.Versions[0]
	if v.Name != "v1alpha1" || !v.Served || !v.Storage {
		t.Errorf("%s: version %s served %v storage %v", crd.Name, v.Name, v.Served, v.Storage)
	}
	if v.Subresources == nil || v.Subresources.Status == nil {
		t.Errorf("%s: no status subresource (the agent writes only status)", crd.Name)
	}
	if v.Schema == nil || v.Schema.OpenAPIV3Schema == nil {
		t.Fatalf("%s: no schema", crd.Name)
	}
	return v
}

// checkFields: the object schema has exactly these properties.
func checkFields(t *testing.T, where string, s apiextensionsv1.JSONSchemaProps, want ...string) {
	t.Helper()
	var got []string
	for k := range s.Properties {
		got = append(got, k)
	}
	if s.Type != "object" || !slices.Equal(sorted(got), sorted(want)) {
		t.Errorf("%s: %s with %v, want an object with %v", where, s.Type, sorted(got), sorted(want))
	}
}

func decodeRole(t *testing.T, d render.Doc) *rbacv1.Role {
	t.Helper()
	var r rbacv1.Role
	strict(t, d, &r)
	return &r
}

// poolcsiRules maps each poolcsi.io resource to the verbs the rules grant on it.
func poolcsiRules(rules []rbacv1.PolicyRule) map[string][]string {
	m := map[string][]string{}
	for _, r := range rules {
		if !slices.Equal(r.APIGroups, []string{"poolcsi.io"}) {
			continue
		}
		for _, res := range r.Resources {
			m[res] = append(m[res], r.Verbs...)
		}
	}
	return m
}

func checkBinding(t *testing.T, d render.Doc, kind, role, sa string) {
	t.Helper()
	var b rbacv1.RoleBinding // a ClusterRoleBinding has the same fields
	if err := yaml.Unmarshal([]byte(d.YAML), &b); err != nil {
		t.Fatal(err)
	}
	if b.RoleRef.Kind != kind || b.RoleRef.Name != role || len(b.Subjects) != 1 ||
		b.Subjects[0].Kind != "ServiceAccount" || b.Subjects[0].Name != sa || b.Subjects[0].Namespace != render.Namespace {
		t.Errorf("%s/%s binds %+v to %+v, want %s %s to ServiceAccount %s/%s", d.Kind, d.Name, b.RoleRef, b.Subjects, kind, role, render.Namespace, sa)
	}
}

func daemonSetAccount(t *testing.T, d render.Doc) string {
	t.Helper()
	var ds struct {
		Spec struct {
			Template struct {
				Spec struct {
					ServiceAccountName string `json:"serviceAccountName"`
				}
			}
		}
	}
	if err := yaml.Unmarshal([]byte(d.YAML), &ds); err != nil || ds.Spec.Template.Spec.ServiceAccountName == "" {
		t.Fatalf("the DaemonSet's service account: %v\n%s", err, d.YAML)
	}
	return ds.Spec.Template.Spec.ServiceAccountName
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	sort.Strings(s)
	return s
}

func stringsOf[T ~string](s []T) []string {
	out := make([]string, len(s))
	for i, v := range s {
		out[i] = string(v)
	}
	return out
}
