package main

import (
	"strings"
	"testing"
)

const sample = `goos: linux
BenchmarkListVolumes10k/per-page-100-2         	       3	 415375679 ns/op	28247962 B/op	  334710 allocs/op
BenchmarkGetCapacity10k-2   	I1127 08:40:54.909162    3684 image.go:144] "Created volume" volume="local.x"
     400	    138629 ns/op	        59.51 10k-µs	         1.026 10k/empty	        58.01 empty-µs
BenchmarkLifecycle/xfs-2         	      10	 1 ns/op	0.6100 poolcsi/raw	0.5300 rpc-durable/raw
    bench_test.go:160: a log line
PASS
`

func TestParseBench(t *testing.T) {
	r := ParseBench(sample)
	for _, tt := range []struct {
		bench, unit string
		want        float64
	}{
		{"BenchmarkListVolumes10k/per-page-100", "ns/op", 415375679},
		{"BenchmarkListVolumes10k/per-page-100", "allocs/op", 334710},
		{"BenchmarkGetCapacity10k", "10k/empty", 1.026},
		{"BenchmarkGetCapacity10k", "empty-µs", 58.01},
		{"BenchmarkLifecycle/xfs", "poolcsi/raw", 0.61},
	} {
		if got, ok := r[tt.bench][tt.unit]; !ok || got != tt.want {
			t.Errorf("%s %s = %v (%v), want %v", tt.bench, tt.unit, got, ok, tt.want)
		}
	}
}

func TestTableRoundTrip(t *testing.T) {
	rows := []Row{
		{Name: "life, poolcsi / raw", Value: 0.5234, Budget: "≤ 0.55", Band: 0.12, From: "Lifecycle/xfs"},
		{Name: "RSS, MiB", Value: 47.25, Band: 0.1, From: "ServeStart10k"},
		{Name: "calls", Value: 1234, Budget: "< 2000", Band: 0.3, From: "x | y"},
	}
	doc := "# Perf\n\nbefore\n\n" + Render("old", nil) + "\n\nafter\n"
	doc = Splice(doc, Render("Generated now.", rows))
	if !strings.Contains(doc, "before") || !strings.Contains(doc, "after") || strings.Contains(doc, "old") {
		t.Fatalf("splice lost the text around the table:\n%s", doc)
	}
	got, err := ParseTable(doc)
	if err != nil {
		t.Fatal(err)
	}
	want := []Row{
		{Name: "life, poolcsi / raw", Value: 0.52, Budget: "≤ 0.55", Band: 0.12, From: "Lifecycle/xfs"},
		{Name: "RSS, MiB", Value: 47.2, Band: 0.1, From: "ServeStart10k"},
	}
	if len(got) < 2 || got[0] != want[0] || got[1].Value != want[1].Value || got[1].Budget != "" {
		t.Fatalf("ParseTable = %+v, want %+v", got, want)
	}
	if _, err := ParseTable("no table"); err == nil {
		t.Fatal("ParseTable of a document without the markers succeeded")
	}
}

func TestMoved(t *testing.T) {
	base := []Row{{Name: "a", Value: 1, Band: 0.1}, {Name: "b", Value: 10, Band: 0.2}, {Name: "c", Value: 2, Band: 0.1}}
	now := []Row{{Name: "a", Value: 1.09}, {Name: "b", Value: 12.5}}
	got := strings.Join(Moved(base, now), "\n")
	if strings.Contains(got, "a:") || !strings.Contains(got, "b: 12.5, was 10.0 (+25 %, band ±20 %)") || !strings.Contains(got, "c: not measured") {
		t.Fatalf("Moved = %q", got)
	}
}

func TestCombine(t *testing.T) {
	runs := [][]Row{
		{{Name: "a", Value: 1.0}, {Name: "b", Value: 5}},
		{{Name: "a", Value: 1.2}, {Name: "b", Value: 5}},
		{{Name: "a", Value: 0.9}, {Name: "b", Value: 5}},
	}
	got := Combine(runs, 0.05)
	if got[0].Value != 1.0 || got[0].Band < 0.399 || got[0].Band > 0.401 {
		t.Errorf("a: %+v, want median 1.0 and band 0.4 (twice the 20 %% deviation)", got[0])
	}
	if got[1].Value != 5 || got[1].Band != 0.05 {
		t.Errorf("b: %+v, want 5 with the least band", got[1])
	}
}

func TestNotRunRows(t *testing.T) {
	rows := []Row{
		{Name: "life", Value: 0.5, Band: 0.1, From: "Lifecycle/xfs"},
		{Name: "claim", Budget: "< 1", From: "SideBySide", NotRun: "cluster | not built\nyet", Optional: true},
	}
	doc := Splice("# Perf\n", Render("Generated now.", rows))
	if !strings.Contains(doc, "| claim | not run | < 1 | — | SideBySide: cluster / not built yet |") {
		t.Fatalf("the not-run row is not in the table:\n%s", doc)
	}
	base, err := ParseTable(doc)
	if err != nil || len(base) != 2 || base[1].NotRun == "" || base[1].Budget != "< 1" {
		t.Fatalf("ParseTable = %+v, %v: want the not-run row back", base, err)
	}
	// Not run in the committed table: nothing to compare with. Not run now,
	// optional: named by NotRunRows, no failure. Not run now, required: a failure.
	if got := Moved(base, []Row{{Name: "life", Value: 0.5}, {Name: "claim", Value: 0.4}}); len(got) != 0 {
		t.Errorf("Moved against a not-run figure = %q", got)
	}
	measured := []Row{{Name: "life", Value: 0.5, Band: 0.1}, {Name: "claim", Value: 0.4, Band: 0.5}}
	now := []Row{{Name: "life", NotRun: "failed"}, {Name: "claim", NotRun: "not built", Optional: true}}
	got := strings.Join(Moved(measured, now), "\n")
	if !strings.Contains(got, "life: not run (failed)") || strings.Contains(got, "claim") {
		t.Errorf("Moved = %q, want the required figure named and the optional one not", got)
	}
	if n := NotRunRows(now); len(n) != 2 || !strings.Contains(n[1], "claim: not run (not built)") {
		t.Errorf("NotRunRows = %q", n)
	}
	// Combine: a figure measured in one run of three is that run's value, at its least band.
	c := Combine([][]Row{
		{{Name: "claim", Value: 0.4, MinBand: 0.5}},
		{{Name: "claim", NotRun: "measured in the first run only"}},
		{{Name: "claim", NotRun: "measured in the first run only"}},
	}, 0.1)
	if c[0].NotRun != "" || c[0].Value != 0.4 || c[0].Band != 0.5 {
		t.Errorf("Combine = %+v, want 0.4 at ±50 %%", c[0])
	}
	if c := Combine([][]Row{{{Name: "claim", NotRun: "not built"}}}, 0.1); c[0].NotRun != "not built" {
		t.Errorf("Combine of a figure never measured = %+v, want not run", c[0])
	}
}
