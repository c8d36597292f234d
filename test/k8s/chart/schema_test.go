package chart

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	render "github.com/poolcsi/poolcsi/hack/release/chart"

	"helm.sh/helm/v3/pkg/strvals"
	"sigs.k8s.io/yaml"
)

// userValues are values as `helm install` takes them from its flags, merged in the order
// Helm's values.Options.MergeValues merges them: -f files, --set-json, --set, --set-string.
type userValues struct {
	file      string   // the text of a -f values file
	setJSON   []string // --set-json
	set       []string // --set
	setString []string // --set-string
}

func (u userValues) merge(t *testing.T) map[string]any {
	t.Helper()
	base := map[string]any{}
	if u.file != "" {
		if err := yaml.Unmarshal([]byte(u.file), &base); err != nil {
			t.Fatalf("values file: %v", err)
		}
	}
	for _, s := range u.setJSON {
		if err := strvals.ParseJSON(s, base); err != nil {
			t.Fatalf("--set-json %s: %v", s, err)
		}
	}
	for _, s := range u.set {
		if err := strvals.ParseInto(s, base); err != nil {
			t.Fatalf("--set %s: %v", s, err)
		}
	}
	for _, s := range u.setString {
		if err := strvals.ParseIntoString(s, base); err != nil {
			t.Fatalf("--set-string %s: %v", s, err)
		}
	}
	return base
}

// schemaRefusal starts every error Helm gives for values its chart's schema refuses.
const schemaRefusal = "values don't meet the specifications of the schema(s)"

// TestValuesSchema: the chart's values.schema.json accepts the default values, the plain
// YAML's values, every variant the chart and harness tests render, and the ways to change
// a value the chart documents; it refuses a misspelt key, at the top and nested, a wrong
// type, a value outside its set, and a pool of the wrong shape, before any template runs,
// with an error that names the value (its JSON pointer) as `helm install` prints it.
func TestValuesSchema(t *testing.T) {
	if _, err := os.Stat(filepath.Join(render.ChartDir(), "values.schema.json")); err != nil {
		t.Fatal(err)
	}
	type tc struct {
		name   string
		file   string // values file (as deploy/kubernetes/values.yaml), "" for none
		values userValues
		// overrides, if set, are the values instead (a TestChartVariants variant's).
		overrides map[string]any
		// wantErr: "" for values the schema accepts, else every string the error must hold.
		wantErr []string
	}
	cases := []tc{
		{name: "defaults"},
		{name: "the plain YAML's values", file: render.RenderedValues()},
		// What test/k8s/harness renders (kubelet_test.go, harness_test.go, snapshot_test.go).
		{name: "harness: kubelet overrides", values: userValues{file: `
image: {repository: poolcsi.test/poolcsi, tag: test}
sidecars:
  provisioner: {image: "poolcsi.test/csi-provisioner:v6.3.0"}
  attacher: {image: "poolcsi.test/csi-attacher:v4.13.0"}
  resizer: {image: "poolcsi.test/csi-resizer:v2.3.0"}
  snapshotter: {image: "poolcsi.test/csi-snapshotter:v8.7.0"}
snapshots: {enabled: true, local: true}
shares: {enabled: true, hostDir: /var/lib/poolcsi/shares, types: [bind, nfs, nfs4, ceph, fuse.ceph]}
pools: {shared: [{name: shared, path: /mnt/poolcsi-shared}]}
shareKey: {existingSecret: poolcsi-share-key}
`}},
		{name: "harness: StorageClasses", file: render.RenderedValues(), values: userValues{file: `
pools: {shared: [{name: shared, path: /mnt/poolcsi-shared}]}
shareKey: {existingSecret: poolcsi-share-key}
storageClasses:
  - {name: sc-local, pool: local, fsType: xfs, default: true}
  - {name: sc-shared-dir, pool: shared, layout: dir, shared: true, mountOptions: [noatime]}
`}},
		{name: "harness: snapshots", file: render.RenderedValues(), values: userValues{file: `
snapshots: {enabled: true, local: true}
snapshotClass: {create: true}
`}},
		{name: "docs: a shared pool, its share key from an existing Secret", values: userValues{
			setJSON: []string{`pools.shared=[{"name":"shared","path":"/mnt/poolcsi-shared"}]`},
			set:     []string{"shareKey.existingSecret=poolcsi-share-key"}}},
		{name: "Helm's global values, as a parent chart gives them", values: userValues{file: "global: {imageRegistry: registry.example.com, storageClass: x}"}},
		{name: "a share key Secret name that is not a name", values: userValues{set: []string{"shareKey.existingSecret=My_Key"}},
			wantErr: []string{"at '/shareKey/existingSecret'"}},
		{name: "docs: disable the shared half with an empty list", values: userValues{setJSON: []string{"pools.shared=[]"}}},
		{name: "disable the shared half with null", values: userValues{set: []string{"pools.shared=null"}}},
		{name: "everything else an operator sets", values: userValues{
			file: `
pools:
  shared:
    - {name: nfs, path: /mnt/nfs, mount: {type: nfs, source: "server:/export", options: [nfsvers=4.1], timeout: 1m30s}}
    - {name: bound, path: /mnt/bound, mount: {source: /srv/pool, options: [bind]}}
controller:
  resources:
    poolcsi: {requests: {cpu: 1, memory: 64Mi}, limits: {memory: 1Gi}}
  tolerations: [{key: dedicated, operator: Equal, value: storage, effect: NoSchedule}]
  affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: []}}}
  nodeSelector: {kubernetes.io/os: linux}
imagePullSecrets: [{name: regcred}]
storageClasses:
  - name: poolcsi-nfs-image
    pool: nfs
    shared: true
    volumeBindingMode: WaitForFirstConsumer
    reclaimPolicy: Retain
    parameters: {csi.storage.k8s.io/provisioner-secret-name: x}
volumeAttributesClasses:
  - {name: fast, shared: true, parameters: {readBytesPerSecond: 100Mi, writeIOPS: "3000"}}
  - {name: guaranteed, parameters: {preallocate: "true"}}
groupSnapshotClass: {create: true, name: db-group, deletionPolicy: Retain, default: true}
`,
			set: []string{"image.tag=2", "controller.healthEvents=sidecar", "controller.builtinLivenessProbe=false",
				"node.builtinRegistration=false", "logLevel=5", "controller.replicas=1", "controller.provisionerExtraArgs={--extra-create-metadata}",
				"shares.keySecret=my-key", "priorityClassName="},
			setString: []string{"image.tag=1.10"},
		}},

		{name: "a VolumeAttributesClass parameter the driver does not know", values: userValues{file: `
volumeAttributesClasses: [{name: x, parameters: {readBPS: 1Mi}}]
`}, wantErr: []string{"invalid propertyName 'readBPS'"}},
		{name: "misspelt top-level key", values: userValues{set: []string{"imge.tag=v1"}},
			wantErr: []string{"at '': additional properties 'imge' not allowed"}},
		{name: "misspelt nested key", values: userValues{set: []string{"node.kubeletDirr=/var/lib/k8s/kubelet"}},
			wantErr: []string{"at '/node': additional properties 'kubeletDirr' not allowed"}},
		{name: "kubeletDir under controller", values: userValues{set: []string{"controller.kubeletDir=/x"}},
			wantErr: []string{"at '/controller': additional properties 'kubeletDir' not allowed"}},
		{name: "misspelt sidecar key", values: userValues{set: []string{"sidecars.provisioner.imag=x"}},
			wantErr: []string{"at '/sidecars/provisioner': additional properties 'imag' not allowed"}},
		{name: "misspelt resource key", values: userValues{set: []string{"node.resources.poolcsi.limit.memory=1Gi"}},
			wantErr: []string{"at '/node/resources/poolcsi': additional properties 'limit' not allowed"}},
		{name: "misspelt toleration key", values: userValues{set: []string{"node.tolerations[0].operater=Exists"}},
			wantErr: []string{"at '/node/tolerations/0': additional properties 'operater' not allowed"}},
		{name: "a string where a number is wanted", values: userValues{set: []string{"controller.replicas=two"}},
			wantErr: []string{"at '/controller/replicas': got string, want integer"}},
		{name: "--set-string of a number", values: userValues{setString: []string{"node.metricsPort=9822"}},
			wantErr: []string{"at '/node/metricsPort': got string, want integer"}},
		{name: "a string where a boolean is wanted", values: userValues{setString: []string{"snapshots.local=true"}},
			wantErr: []string{"at '/snapshots/local': got string, want boolean"}},
		{name: "negative log level", values: userValues{set: []string{"logLevel=-1"}},
			wantErr: []string{"at '/logLevel': minimum: got -1, want 0"}},
		{name: "port out of range", values: userValues{set: []string{"controller.metricsPort=0", "node.localHealthPort=70000"}},
			wantErr: []string{"at '/controller/metricsPort'", "at '/node/localHealthPort'"}},
		{name: "negative memory", values: userValues{set: []string{"controller.resources.poolcsi.limits.memory=-1Gi"}},
			wantErr: []string{"at '/controller/resources/poolcsi/limits/memory'"}},
		{name: "health events from neither", values: userValues{set: []string{"controller.healthEvents=both"}},
			wantErr: []string{"at '/controller/healthEvents': value must be one of 'poolcsi', 'sidecar'"}},
		{name: "pull policy in the wrong case", values: userValues{set: []string{"image.pullPolicy=always"}},
			wantErr: []string{"at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"}},
		{name: "a tag in the repository", values: userValues{set: []string{"image.repository=poolcsi/poolcsi:v1"}},
			wantErr: []string{"at '/image/repository'"}},
		{name: "unknown share type", values: userValues{set: []string{"shares.types={nfs,cifs}"}},
			wantErr: []string{"at '/shares/types/1': value must be one of"}},
		{name: "lease timing an operator tunes", values: userValues{set: []string{"fencing.leaseDuration=2m", "fencing.renewInterval=2500ms", "fencing.margin=1m30s"}}},
		{name: "a lease duration without its unit", values: userValues{set: []string{"fencing.leaseDuration=60"}},
			wantErr: []string{"at '/fencing/leaseDuration': got number, want string"}},
		{name: "a lease margin that is not a duration", values: userValues{set: []string{"fencing.margin=half a minute"}},
			wantErr: []string{"at '/fencing/margin'"}},
		{name: "localController.central as a string", values: userValues{setString: []string{"localController.central=true"}},
			wantErr: []string{"at '/localController/central': got string, want boolean"}},
		{name: "misspelt localController key", values: userValues{set: []string{"localController.centrl=true"}},
			wantErr: []string{"at '/localController': additional properties 'centrl' not allowed"}},
		{name: "image needed", values: userValues{set: []string{"image=null"}},
			wantErr: []string{"at '': missing property 'image'"}},

		// Pools are lists of {name, path[, mount]}.
		{name: "--set pools.shared={} (a list of one empty string)", values: userValues{set: []string{"pools.shared={}"}},
			wantErr: []string{"at '/pools/shared/0': got string, want object"}},
		{name: "pools.shared: {} in a values file", values: userValues{file: "pools: {shared: {}}"},
			wantErr: []string{"at '/pools/shared': got object, want array"}},
		{name: "pools keyed by name", values: userValues{file: "pools: {local: {fast: {path: /mnt/fast}}}"},
			wantErr: []string{"at '/pools/local': got object, want array"}},
		{name: "a shared pool without its path", values: userValues{set: []string{"pools.shared[0].name=nfs"}},
			wantErr: []string{"at '/pools/shared/0': missing property 'path'"}},
		{name: "a local pool without its path", values: userValues{file: "pools: {local: [{name: fast}]}"},
			wantErr: []string{"at '/pools/local/0': missing property 'path'"}},
		{name: "a pool without its name", values: userValues{file: "pools: {local: [{path: /mnt/fast}]}"},
			wantErr: []string{"at '/pools/local/0': missing property 'name'"}},
		{name: "a relative pool path", values: userValues{file: "pools: {local: [{name: fast, path: mnt/fast}]}"},
			wantErr: []string{"at '/pools/local/0/path': 'mnt/fast' does not match pattern"}},
		{name: "a pool name the driver refuses", values: userValues{file: "pools: {shared: [{name: Fast_Pool, path: /mnt/fast}]}"},
			wantErr: []string{"at '/pools/shared/0/name'"}},
		{name: "a share's pool name", values: userValues{file: "pools: {shared: [{name: s-0123456789abcdef, path: /mnt/s}]}"},
			wantErr: []string{"at '/pools/shared/0/name'"}},
		{name: "a mount stanza on a local pool (never used)", values: userValues{file: "pools: {local: [{name: l, path: /l, mount: {type: nfs, source: 's:/e'}}]}"},
			wantErr: []string{"at '/pools/local/0': additional properties 'mount' not allowed"}},
		{name: "a mount stanza without its type", values: userValues{file: "pools: {shared: [{name: n, path: /n, mount: {source: 's:/e'}}]}"},
			wantErr: []string{"at '/pools/shared/0/mount': missing property 'type'"}},
		{name: "a mount stanza with a misspelt key", values: userValues{file: "pools: {shared: [{name: n, path: /n, mount: {type: nfs, source: 's:/e', option: [ro]}}]}"},
			wantErr: []string{"at '/pools/shared/0/mount': additional properties 'option' not allowed"}},
		{name: "mount options in one string", values: userValues{file: "pools: {shared: [{name: n, path: /n, mount: {type: nfs, source: 's:/e', options: ['ro,noatime']}}]}"},
			wantErr: []string{"at '/pools/shared/0/mount/options/0'"}},

		// StorageClasses.
		{name: "a StorageClass key misspelt", values: userValues{file: "storageClasses: [{name: a, pool: local, fstype: xfs}]"},
			wantErr: []string{"at '/storageClasses/0': additional properties 'fstype' not allowed"}},
		{name: "a StorageClass without its pool", values: userValues{file: "storageClasses: [{name: a}]"},
			wantErr: []string{"at '/storageClasses/0': missing property 'pool'"}},
		{name: "an unknown layout", values: userValues{file: "storageClasses: [{name: a, pool: local, layout: block}]"},
			wantErr: []string{"at '/storageClasses/0/layout': value must be one of 'image', 'dir'"}},
		{name: "Immediate on a local class (ignored by the chart)", values: userValues{file: "storageClasses: [{name: a, pool: local, volumeBindingMode: Immediate}]"},
			wantErr: []string{"at '/storageClasses/0/volumeBindingMode': value must be 'WaitForFirstConsumer'"}},
		{name: "a parameter that has its own field", values: userValues{file: "storageClasses: [{name: a, pool: local, parameters: {layout: dir}}]"},
			wantErr: []string{"at '/storageClasses/0/parameters/layout': false schema"}},
		{name: "snapshot class deletion policy", values: userValues{set: []string{"snapshotClass.deletionPolicy=delete"}},
			wantErr: []string{"at '/snapshotClass/deletionPolicy'"}},
	}
	for _, v := range chartVariants {
		cases = append(cases, tc{name: "TestChartVariants: " + v.name, overrides: v.overrides})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			vals := c.values.merge(t)
			if c.overrides != nil {
				vals = c.overrides
			}
			_, err := render.Render(render.ChartDir(), c.file, vals)
			if len(c.wantErr) == 0 {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				if _, err := render.RenderNotes(render.ChartDir(), c.file, vals); err != nil {
					t.Fatalf("NOTES.txt: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted; want an error with %q", c.wantErr)
			}
			msg := err.Error()
			if !strings.Contains(msg, schemaRefusal) {
				t.Errorf("not refused by the schema (a template error?):\n%s", msg)
			}
			for _, w := range c.wantErr {
				if !strings.Contains(msg, w) {
					t.Errorf("error lacks %q:\n%s", w, msg)
				}
			}
		})
	}
}

// TestNotes: NOTES.txt, what `helm install` prints, names this release's objects in the
// commands to check first, and only commands the README documents.
func TestNotes(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join(render.RepoRoot(), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name      string
		overrides map[string]any
		want      []string
		notWant   []string
	}{
		{"defaults: the local pool only", nil, []string{
			"kubectl -n poolcsi get daemonset poolcsi-node",
			"kubectl -n poolcsi get pods -l app.kubernetes.io/instance=poolcsi -o wide",
			"kubectl get csidriver local.poolcsi.io\n",
			"kubectl get csinodes",
			"exec POD -c poolcsi-local -- poolcsi status\n",
			"-c poolcsi-local -- poolcsi pool list --path /var/lib/poolcsi/pools/local",
			"kubectl get storageclass",
			"This release made none",
			"Served by the central local controller (deployment/poolcsi-local-controller)",
			"kubectl -n poolcsi rollout status deployment/poolcsi-local-controller",
		}, []string{"poolcsi-controller", "poolcsi.io local", "pool init", "being built", "Per-node layout"}},
		{"the per-node layout", perNodeValues(),
			[]string{"Per-node layout (localController.central false)", "exec POD -c poolcsi-local -- poolcsi status\n"},
			[]string{"local-controller", "poolcsi-controller"}},
		{"a shared pool mounted by the admin", withSharedPool(nil), []string{
			"kubectl -n poolcsi get daemonset poolcsi-node",
			"kubectl -n poolcsi rollout status deployment/poolcsi-controller",
			"kubectl get csidriver poolcsi.io local.poolcsi.io",
			"exec deploy/poolcsi-controller -c poolcsi -- poolcsi pool init --path /mnt/poolcsi-shared --name shared",
			"exec deploy/poolcsi-controller -c poolcsi -- poolcsi status\n",
			"exec deploy/poolcsi-controller -c poolcsi -- poolcsi pool check --path /mnt/poolcsi-shared",
			"exec POD -c poolcsi -- poolcsi status\n",
			"exec POD -c poolcsi-local -- poolcsi status\n",
		}, nil},
		{"local pools only, a StorageClass", map[string]any{"pools": map[string]any{"shared": []any{}},
			"storageClasses": []any{map[string]any{"name": "fast", "pool": "local"}}},
			[]string{"kubectl get csidriver local.poolcsi.io\n", "This release made: fast"},
			[]string{"poolcsi-controller", "poolcsi.io local", "pool init"}},
		{"shared pools only, mounted by poolcsi", map[string]any{"pools": map[string]any{"local": []any{},
			"shared": []any{map[string]any{"name": "nfs", "path": "/mnt/nfs", "mount": map[string]any{"type": "nfs", "source": "s:/e"}}}},
			"shareKey": map[string]any{"existingSecret": "k"}},
			[]string{"kubectl get csidriver poolcsi.io\n", "poolcsi pool check --path /mnt/nfs"},
			[]string{"poolcsi-local", "pool init"}},
		{"the central local controller", map[string]any{"localController": map[string]any{"central": true},
			"node": map[string]any{"localResizer": false}},
			[]string{"kubectl -n poolcsi rollout status deployment/poolcsi-local-controller",
				"node.localResizer is not used with localController.central"},
			[]string{"deployment/poolcsi-controller"}},
	}
	cmd := regexp.MustCompile(`-- (poolcsi [a-z]+(?: [a-z]+)?)`)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			notes, err := render.RenderNotes(render.ChartDir(), "", tc.overrides)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.want {
				if !strings.Contains(notes, w) {
					t.Errorf("NOTES.txt lacks %q:\n%s", w, notes)
				}
			}
			for _, nw := range tc.notWant {
				if strings.Contains(notes, nw) {
					t.Errorf("NOTES.txt has %q:\n%s", nw, notes)
				}
			}
			for _, m := range cmd.FindAllStringSubmatch(notes, -1) {
				if !strings.Contains(string(readme), "\n"+m[1]+" ") {
					t.Errorf("NOTES.txt runs %q, which README.md's commands do not list", m[1])
				}
			}
		})
	}
}
