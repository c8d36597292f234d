package chart

import (
	"testing"

	"sigs.k8s.io/yaml"
)

// TestLocalControllerSnapshotClasses: with localController.central (the default) the local
// driver's VolumeSnapshotClass follows snapshots.enabled (the central csi-snapshotter, on by
// default), not snapshots.local, and groupSnapshotClass.create adds the local
// VolumeGroupSnapshotClass poolcsi-local-group beside the shared one; per node
// (localController.central false) there is no local group class, and the local
// VolumeSnapshotClass still needs snapshots.local.
func TestLocalControllerSnapshotClasses(t *testing.T) {
	classes := map[string]any{
		"snapshotClass":      map[string]any{"create": true},
		"groupSnapshotClass": map[string]any{"create": true, "default": true},
	}
	type class struct {
		Metadata struct {
			Annotations map[string]string
		}
		Driver, DeletionPolicy string
	}
	for _, tc := range []struct {
		name      string
		overrides map[string]any
		want      map[string]string // kind/name: driver
		notWant   []string
	}{
		{"central", withSharedPool(withCentral(classes)), map[string]string{
			"VolumeSnapshotClass/poolcsi-local":             "local.poolcsi.io",
			"VolumeSnapshotClass/poolcsi-shared":            "poolcsi.io",
			"VolumeGroupSnapshotClass/poolcsi-local-group":  "local.poolcsi.io",
			"VolumeGroupSnapshotClass/poolcsi-shared-group": "poolcsi.io",
		}, nil},
		{"central, local pools only", withCentral(classes), map[string]string{
			"VolumeSnapshotClass/poolcsi-local":            "local.poolcsi.io",
			"VolumeGroupSnapshotClass/poolcsi-local-group": "local.poolcsi.io",
		}, []string{"VolumeSnapshotClass/poolcsi-shared", "VolumeGroupSnapshotClass/poolcsi-shared-group"}},
		{"central, snapshots off", withCentral(with(classes, "snapshots", map[string]any{"enabled": false, "local": true})), nil,
			[]string{"VolumeSnapshotClass/poolcsi-local", "VolumeGroupSnapshotClass/poolcsi-local-group"}},
		{"central, the group class named", withCentral(with(classes, "groupSnapshotClass", map[string]any{"create": true, "default": true, "localName": "fast-group"})),
			map[string]string{"VolumeGroupSnapshotClass/fast-group": "local.poolcsi.io"}, []string{"VolumeGroupSnapshotClass/poolcsi-local-group"}},
		{"defaults", classes, map[string]string{
			"VolumeSnapshotClass/poolcsi-local":            "local.poolcsi.io",
			"VolumeGroupSnapshotClass/poolcsi-local-group": "local.poolcsi.io",
		}, nil},
		{"per node", withPerNode(withSharedPool(classes)), map[string]string{
			"VolumeSnapshotClass/poolcsi-shared":            "poolcsi.io",
			"VolumeGroupSnapshotClass/poolcsi-shared-group": "poolcsi.io",
		}, []string{"VolumeSnapshotClass/poolcsi-local", "VolumeGroupSnapshotClass/poolcsi-local-group"}},
		{"per node with snapshots.local", withPerNode(withSharedPool(with(classes, "snapshots", map[string]any{"local": true}))), map[string]string{
			"VolumeSnapshotClass/poolcsi-local": "local.poolcsi.io",
		}, []string{"VolumeGroupSnapshotClass/poolcsi-local-group"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			have := renderMap(t, tc.overrides)
			for k, driver := range tc.want {
				d, ok := have[k]
				if !ok {
					t.Errorf("no %s", k)
					continue
				}
				var c class
				if err := yaml.Unmarshal([]byte(d.YAML), &c); err != nil {
					t.Fatal(err)
				}
				if c.Driver != driver || c.DeletionPolicy != "Delete" {
					t.Errorf("%s: driver %q, deletionPolicy %q; want %s, Delete", k, c.Driver, c.DeletionPolicy, driver)
				}
				if key := "groupsnapshot.storage.kubernetes.io/is-default-class"; d.Kind == "VolumeGroupSnapshotClass" && c.Metadata.Annotations[key] != "true" {
					t.Errorf("%s: groupSnapshotClass.default, but annotations %v", k, c.Metadata.Annotations)
				}
			}
			for _, k := range tc.notWant {
				if _, ok := have[k]; ok {
					t.Errorf("unexpected %s", k)
				}
			}
		})
	}
}

// with is values with key set to v (a copy).
func with(values map[string]any, key string, v any) map[string]any {
	out := map[string]any{key: v}
	for k, x := range values {
		if k != key {
			out[k] = x
		}
	}
	return out
}
