package nodecall_test

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/poolcsi/poolcsi/internal/nodecall"
)

// crdTemplate is the chart's template of the channel's CRDs.
const crdTemplate = "../../deploy/helm/poolcsi/templates/nodecall.yaml"

var (
	templateComment = regexp.MustCompile(`(?s)\{\{-? */\*.*?\*/ *-?\}\}`)
	templateLine    = regexp.MustCompile(`(?m)^.*\{\{.*\}\}.*$`)
)

// crdSchemas reads the chart's CRDs (the template's actions dropped: what is left is
// the CRDs as any values render them) and returns each kind's openAPIV3Schema.
func crdSchemas(t *testing.T) map[string]map[string]any {
	t.Helper()
	raw, err := os.ReadFile(crdTemplate)
	if err != nil {
		t.Fatalf("the chart's CRDs, which these types must meet: %v", err)
	}
	text := templateLine.ReplaceAllString(templateComment.ReplaceAllString(string(raw), ""), "")
	out := map[string]map[string]any{}
	for _, doc := range strings.Split(text, "\n---") {
		var crd struct {
			Spec struct {
				Names    struct{ Kind string }
				Versions []struct {
					Name   string
					Schema struct {
						OpenAPIV3Schema map[string]any `json:"openAPIV3Schema"`
					}
				}
			}
		}
		if err := yaml.Unmarshal([]byte(doc), &crd); err != nil {
			t.Fatalf("%s: %v", crdTemplate, err)
		}
		for _, v := range crd.Spec.Versions {
			if v.Name == nodecall.Version {
				out[crd.Spec.Names.Kind] = v.Schema.OpenAPIV3Schema
			}
		}
	}
	return out
}

// checkAgainst walks obj (a fully filled object, as the API server gets it) and fails on
// every field the schema does not declare or types otherwise, and on every field the
// schema requires that obj lacks.
func checkAgainst(t *testing.T, path string, obj any, schema map[string]any) {
	t.Helper()
	typ, _ := schema["type"].(string)
	switch v := obj.(type) {
	case map[string]any:
		if typ != "object" {
			t.Errorf("%s: an object, the schema says %q", path, typ)
			return
		}
		props, _ := schema["properties"].(map[string]any)
		for _, req := range asStrings(schema["required"]) {
			if _, ok := v[req]; !ok {
				t.Errorf("%s.%s: required by the schema, never written", path, req)
			}
		}
		for k, val := range v {
			if path == "" && k == "metadata" {
				continue
			}
			sub, ok := props[k].(map[string]any)
			if !ok {
				t.Errorf("%s.%s: not in the schema", path, k)
				continue
			}
			checkAgainst(t, path+"."+k, val, sub)
		}
	case []any:
		if typ != "array" {
			t.Errorf("%s: an array, the schema says %q", path, typ)
			return
		}
		items, _ := schema["items"].(map[string]any)
		for _, e := range v {
			checkAgainst(t, path+"[]", e, items)
		}
	case string:
		if typ != "string" {
			t.Errorf("%s: a string, the schema says %q", path, typ)
		}
		if enum := asStrings(schema["enum"]); len(enum) > 0 && !slices.Contains(enum, v) {
			t.Errorf("%s: %q not in the schema's enum %v", path, v, enum)
		}
		if p, ok := schema["pattern"].(string); ok && !regexp.MustCompile(p).MatchString(v) {
			t.Errorf("%s: %q does not match the schema's pattern %s", path, v, p)
		}
	case int64, int32, int, float64:
		if typ != "integer" {
			t.Errorf("%s: an integer, the schema says %q", path, typ)
		}
	default:
		t.Errorf("%s: a %T", path, obj)
	}
}

func asStrings(v any) []string {
	l, _ := v.([]any)
	out := make([]string, 0, len(l))
	for _, e := range l {
		s, _ := e.(string)
		out = append(out, s)
	}
	return out
}

func lookupSchema(schema map[string]any, path ...string) map[string]any {
	for _, p := range path {
		props, _ := schema["properties"].(map[string]any)
		schema, _ = props[p].(map[string]any)
	}
	return schema
}

// The Go types meet the chart's CRDs: every field written is declared with its type,
// every required field is written, the enums are the allow-list and the phases and
// conditions, the nonce matches its pattern, and the caps are the schema's.
func TestTypesMatchTheCRDs(t *testing.T) {
	schemas := crdSchemas(t)
	now := time.Now()
	c, err := nodecall.NewCall(nodecall.Ask{Node: "b", NodeUID: "u", Method: "CreateVolume", Target: "local.abc",
		Request: &csi.CreateVolumeRequest{Name: "pvc-1"}, Issued: now, NotAfter: now.Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	started := metav1.NewTime(now)
	c.Status = nodecall.CallStatus{Nonce: c.Spec.Nonce, Phase: nodecall.Done, Code: 5, Message: "m", Response: "{}", Attempts: 2, Started: &started, Finished: &started}
	u, err := c.ToUnstructured()
	if err != nil {
		t.Fatal(err)
	}
	callSchema := schemas[nodecall.CallKind]
	if callSchema == nil {
		t.Fatalf("%s declares no %s %s", crdTemplate, nodecall.CallKind, nodecall.Version)
	}
	checkAgainst(t, "", u.Object, callSchema)

	renew := metav1.NewMicroTime(now)
	n := &nodecall.PoolNode{Status: nodecall.PoolNodeStatus{RenewTime: &renew, Agent: nodecall.AgentInfo{Version: "v", Pod: "p"},
		Pools: []nodecall.PoolCapacity{{Name: "local", AvailableBytes: 1, MaximumVolumeSize: 1, MinimumVolumeSize: 1, Condition: nodecall.PoolUnavailable}}}}
	n.Name = "b"
	un, err := n.ToUnstructured()
	if err != nil {
		t.Fatal(err)
	}
	nodeSchema := schemas[nodecall.NodeKind]
	if nodeSchema == nil {
		t.Fatalf("%s declares no %s %s", crdTemplate, nodecall.NodeKind, nodecall.Version)
	}
	checkAgainst(t, "", un.Object, nodeSchema)

	for _, e := range []struct {
		path []string
		want []string
	}{
		{[]string{"spec", "method"}, nodecall.Methods()},
		{[]string{"status", "phase"}, []string{string(nodecall.Done), string(nodecall.Running)}},
	} {
		got := asStrings(lookupSchema(callSchema, e.path...)["enum"])
		slices.Sort(got)
		if !slices.Equal(got, e.want) {
			t.Errorf("%v enum %v, want %v", e.path, got, e.want)
		}
	}
	conds := lookupSchema(nodeSchema, "status", "pools")["items"].(map[string]any)
	if got := asStrings(lookupSchema(conds, "condition")["enum"]); !slices.Equal(got, []string{string(nodecall.PoolOk), string(nodecall.PoolUnavailable)}) {
		t.Errorf("condition enum %v", got)
	}
	for _, m := range []struct {
		path []string
		cap  int
		same bool // the schema's maxLength is the cap (else at least it)
	}{
		{[]string{"spec", "request"}, nodecall.MaxRequest, true},
		{[]string{"status", "response"}, nodecall.MaxResponse, true},
		{[]string{"spec", "target"}, nodecall.MaxTarget, true},
		{[]string{"status", "message"}, nodecall.MaxMessage, false},
		{[]string{"status", "agent", "version"}, nodecall.MaxVersion, true},
		{[]string{"status", "agent", "pod"}, nodecall.MaxPod, true},
	} {
		schema := callSchema
		if m.path[1] == "agent" {
			schema = nodeSchema
		}
		got, _ := lookupSchema(schema, m.path...)["maxLength"].(float64)
		if (m.same && int(got) != m.cap) || int(got) < m.cap {
			t.Errorf("%v maxLength %v, the Go cap %d", m.path, got, m.cap)
		}
	}
}
