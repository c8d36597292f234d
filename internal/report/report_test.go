package report

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

func TestFinish(t *testing.T) {
	tests := []struct {
		name     string
		change   func(r *Report)
		order    []string // the volumes' IDs after Finish
		problems []string
		summary  Summary
	}{
		{"healthy: by ID, no problems", func(*Report) {}, []string{"fast.b", "slow.a"}, []string{},
			Summary{Volumes: 2, ProvisionedBytes: 11<<30 + 100<<20, Pools: 2}},
		{"abnormal last, by ID; each v1.13 entry a problem", func(r *Report) {
			r.Controller.Volumes = append(r.Controller.Volumes,
				Volume{ID: "z", Abnormal: true, Condition: "ignored when there is v1.13 health",
					Health: []HealthEntry{{"DATA_LOSS", "ImageMissing", "gone"}, {"DEGRADED", "PoolNearlyFull", ""}}},
				Volume{ID: "a", CapacityBytes: 1 << 30, Abnormal: true, Condition: "ImageTruncated: cut"},
				Volume{ID: "m", Abnormal: true})
		}, []string{"fast.b", "slow.a", "a", "m", "z"}, []string{
			"volume a: ImageTruncated: cut", "volume m: abnormal",
			"volume z: DATA_LOSS ImageMissing: gone", "volume z: DEGRADED PoolNearlyFull",
		}, Summary{Volumes: 5, Abnormal: 3, ProvisionedBytes: 12<<30 + 100<<20, Pools: 2, Problems: 4}},
		{"errors first, then probe, storage, pools, volumes", func(r *Report) {
			r.Errors = []string{"ListVolumes: Internal: boom"}
			r.Plugin.ProbeError = "Unavailable: no"
			r.Node.StorageHealth = []HealthEntry{{"STORAGE_UNREACHABLE", "PoolUnavailable", "pool slow"}}
			r.Controller.Pools[0].Error = "Unavailable: not mounted"
			r.Controller.Volumes[1].Abnormal = true
		}, []string{"fast.b", "slow.a"}, []string{
			"ListVolumes: Internal: boom", "Probe: Unavailable: no", "storage STORAGE_UNREACHABLE PoolUnavailable: pool slow",
			"pool fast: GetCapacity: Unavailable: not mounted", "volume slow.a: abnormal",
		}, Summary{Volumes: 2, Abnormal: 1, ProvisionedBytes: 11<<30 + 100<<20, Pools: 1, Problems: 5}},
		{"not ready", func(r *Report) { r.Plugin.Ready = false }, []string{"fast.b", "slow.a"},
			[]string{"Probe: the plugin says it is not ready"}, Summary{Volumes: 2, ProvisionedBytes: 11<<30 + 100<<20, Pools: 2, Problems: 1}},
		{"nothing served", func(r *Report) { r.Controller = Controller{NotServed: "no"} }, nil, []string{}, Summary{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := fixture()
			tt.change(r)
			r.Finish()
			var order []string
			for _, v := range r.Controller.Volumes {
				order = append(order, v.ID)
			}
			if !slices.Equal(order, tt.order) {
				t.Errorf("volumes %q, want %q", order, tt.order)
			}
			if r.Problems == nil || !slices.Equal(r.Problems, tt.problems) {
				t.Errorf("problems %#v, want %#v", r.Problems, tt.problems)
			}
			if r.Summary != tt.summary {
				t.Errorf("summary %+v, want %+v", r.Summary, tt.summary)
			}
		})
	}
}

// The JSON is the same facts, decoding back to the report, with what a
// terminal would act on escaped.
func TestWriteJSON(t *testing.T) {
	r := fixture()
	r.Plugin.Version = "v1\u202e\x1b[2K"
	r.Finish()
	var b bytes.Buffer
	if err := WriteJSON(&b, r); err != nil {
		t.Fatal(err)
	}
	if strings.ContainsAny(b.String(), "\u202e\x1b") || !strings.Contains(b.String(), `"problems": []`) {
		t.Fatalf("JSON:\n%s", b.String())
	}
	var back Report
	if err := json.Unmarshal(b.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if back.Plugin.Version != r.Plugin.Version || back.Summary != r.Summary || len(back.Controller.Volumes) != 2 ||
		*back.Controller.Pools[0].MaximumVolumeBytes != 20<<30 {
		t.Fatalf("decoded %+v, want %+v", back, r)
	}
}
