// Command bench runs the benchmarks behind docs/performance.md's headline
// figures and writes their table (make bench), or compares a run with the
// committed table and names every figure that moved past its noise band
// (make bench-check). Needs root (loop devices, mounts), like the benchmarks.
//
// The cluster's row (a claim → its pod Running, poolcsi against
// local-path-provisioner, test/k8s's BenchmarkSideBySide) is optional: it runs
// once, in the first run, when test/k8s's build cache holds the cluster's
// components (cd test/k8s && go run ./cmd/prebuild -sidebyside), and is
// written as "not run" with the reason otherwise (not built, skipped for a
// missing prerequisite, failed); a check names it and does not fail for it.
//
//	go run ./hack/bench -write -runs 3   # measure 3 times: medians and noise bands
//	go run ./hack/bench -check           # one run against the committed table
//	go run ./hack/bench -only SideBySide # some benchmarks only: their figures, printed
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

var (
	// rawDir keeps the benchmarks' outputs (-raw).
	rawDir string
	// partial: -only ran some of the benchmarks; a figure without a result
	// is left out of the table printed.
	partial bool
)

// bench is one `go test -bench` command.
type bench struct {
	pkg, pattern, benchtime, timeout string
	env                              []string
	dir                              string // the module to run in ("": the repository's)
	// optional: when built returns an error, or the benchmark skips or
	// fails, its figures are "not run" with the reason, and the rest of the
	// table is written as usual.
	optional bool
	built    func() error
	once     bool // measured in the first run only (it takes its own rounds)
}

// sideBySide is the cluster benchmark: poolcsi against local-path-provisioner
// on the one-node kubelet cluster of test/k8s.
var sideBySide = bench{dir: "test/k8s", pkg: "./harness", pattern: "^BenchmarkSideBySide$", benchtime: "1x", timeout: "60m",
	optional: true, once: true, built: clusterBuilt}

// clusterBuilt tells whether the cluster's components (kubelet, apiserver,
// sidecars, local-path-provisioner) are in test/k8s's build cache: the
// benchmark would otherwise build Kubernetes first, which is not a benchmark.
// hack/test.sh's prebuild builds them.
func clusterBuilt() error {
	cmd := exec.Command("go", "run", "./cmd/prebuild", "-check", "-sidebyside")
	cmd.Dir = "test/k8s"
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("cluster components not built (cd test/k8s && go run ./cmd/prebuild -sidebyside): %s", prebuildSays(string(out), err))
	}
	return nil
}

// prebuildSays is prebuild's own last line (go run adds its exit status after it).
func prebuildSays(out string, err error) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], "prebuild:") {
			return strings.TrimPrefix(lines[i], "prebuild: ")
		}
	}
	return err.Error()
}

var benches = []bench{
	{pkg: "./test/e2e", pattern: "^BenchmarkLifecycle$/^xfs$", benchtime: "10x", timeout: "20m"},
	{pkg: "./internal/driver", pattern: "^BenchmarkListVolumes10k$/^per-page-(100|0)$", benchtime: "3x", timeout: "20m"},
	{pkg: "./internal/driver", pattern: "^BenchmarkGetCapacity10k$", benchtime: "400x", timeout: "20m"},
	{pkg: "./internal/driver", pattern: "^BenchmarkCreateDelete$/^existing=(0|10000)/layout=image/callers=1/drivers=1$", benchtime: "1x", timeout: "40m"},
	{pkg: "./test/observe", pattern: "^BenchmarkServeStart10k$", benchtime: "3x", timeout: "20m"},
	sideBySide,
}

// figure is how one row is read from the results.
type figure struct {
	name, budget, from string
	value              func(Results) (float64, bool)
	// of is the optional benchmark the figure comes from (nil: a required one).
	of      *bench
	minBand float64
}

func metric(bench, unit string, scale float64) func(Results) (float64, bool) {
	return func(r Results) (float64, bool) {
		v, ok := r[bench][unit]
		return v * scale, ok
	}
}

func ratio(benchA, benchB, unit string) func(Results) (float64, bool) {
	return func(r Results) (float64, bool) {
		a, ok1 := r[benchA][unit]
		b, ok2 := r[benchB][unit]
		return a / b, ok1 && ok2 && b != 0
	}
}

// quotient is one benchmark's metric a over its metric b (two ratios of one run).
func quotient(bench, a, b string) func(Results) (float64, bool) {
	return func(r Results) (float64, bool) {
		x, ok1 := r[bench][a]
		y, ok2 := r[bench][b]
		return x / y, ok1 && ok2 && y != 0
	}
}

const createBench = "BenchmarkCreateDelete/existing=%d/layout=image/callers=1/drivers=1"

var figures = []figure{
	// The life-cycle goal is against the CSI floor, the arm that does what any driver with
	// crash-safe records must (one gRPC call a step, the same fsyncs): issue 38 set it as
	// "≤ 0.55× the raw commands" when the floor measured 0.49–0.54× them, i.e. within a
	// tenth of the floor; the raw commands have since become twice as fast on this
	// machine and the floor measures 0.65–0.69×, so the raw ratio is reported, and the
	// goal is judged on poolcsi / floor, both from the same rounds.
	{"life of a 1 GiB xfs volume: poolcsi / CSI floor (rpc-durable)", "≤ 1.1", "Lifecycle/xfs poolcsi/raw ÷ rpc-durable/raw", quotient("BenchmarkLifecycle/xfs", "poolcsi/raw", "rpc-durable/raw"), nil, 0},
	{"life of a 1 GiB xfs volume: poolcsi / raw commands", "", "Lifecycle/xfs poolcsi/raw", metric("BenchmarkLifecycle/xfs", "poolcsi/raw", 1), nil, 0},
	{"life of a 1 GiB xfs volume: CSI floor (rpc-durable) / raw commands", "", "Lifecycle/xfs rpc-durable/raw", metric("BenchmarkLifecycle/xfs", "rpc-durable/raw", 1), nil, 0},
	{"ListVolumes walk of 10,000 at 100 a page, s", "< 0.5", "ListVolumes10k/per-page-100", metric("BenchmarkListVolumes10k/per-page-100", "ns/op", 1e-9), nil, 0},
	{"ListVolumes of 10,000 unpaged, s", "< 0.5", "ListVolumes10k/per-page-0", metric("BenchmarkListVolumes10k/per-page-0", "ns/op", 1e-9), nil, 0},
	{"GetCapacity at 10,000 volumes / empty pool", "≤ 1.5", "GetCapacity10k 10k/empty", metric("BenchmarkGetCapacity10k", "10k/empty", 1), nil, 0},
	{"image creates/s at 10,000 volumes / at 0 (1 caller)", "≥ 0.67", "CreateDelete creates/s", ratio(fmt.Sprintf(createBench, 10000), fmt.Sprintf(createBench, 0), "creates/s"), nil, 0},
	{"image deletes/s at 10,000 volumes / at 0 (1 caller)", "≥ 0.67", "CreateDelete deletes/s", ratio(fmt.Sprintf(createBench, 10000), fmt.Sprintf(createBench, 0), "deletes/s"), nil, 0},
	{"start at 10,000 volumes: VmRSS after an unpaged ListVolumes, MiB", "< 50", "ServeStart10k MiB-RSS", metric("BenchmarkServeStart10k", "MiB-RSS", 1), nil, 0},
	{"start at 10,000 volumes: unpaged ListVolumes over gRPC, s", "< 1", "ServeStart10k ms-list-max", metric("BenchmarkServeStart10k", "ms-list-max", 1e-3), nil, 0},
	{"start at 10,000 volumes: exec → ready Probe, s", "< 1", "ServeStart10k ms-to-ready", metric("BenchmarkServeStart10k", "ms-to-ready", 1e-3), nil, 0},
	// The cluster's figures: a pod's start on a one-node cluster moves by
	// a factor of two between rounds on this machine (docs/performance.md,
	// "poolcsi against local-path-provisioner"), hence the wide least band.
	{"1 claim → pod Running on a one-node cluster: poolcsi / local-path-provisioner", "< 1", "SideBySide 1-claim-poolcsi/localpath",
		metric("BenchmarkSideBySide", "1-claim-poolcsi/localpath", 1), &sideBySide, 0.5},
	{"20 claims at once → all 20 pods Running: poolcsi / local-path-provisioner", "< 1", "SideBySide 20-claims-poolcsi/localpath",
		metric("BenchmarkSideBySide", "20-claims-poolcsi/localpath", 1), &sideBySide, 0.5},
}

func main() {
	write := flag.Bool("write", false, "write the table into -doc")
	check := flag.Bool("check", false, "compare with the table in -doc; exit 1 if a figure moved past its band")
	runs := flag.Int("runs", 1, "runs to take medians and noise bands of (-write)")
	doc := flag.String("doc", "docs/performance.md", "the document holding the table")
	minBand := flag.Float64("min-band", 0.10, "the least noise band written, as a fraction")
	flag.StringVar(&rawDir, "raw", "", "keep each go test's output in this directory")
	only := flag.String("only", "", "run only the benchmarks whose pattern matches this regexp and print their figures (not with -write or -check)")
	flag.Parse()
	if *only != "" {
		if *write || *check {
			fmt.Fprintln(os.Stderr, "bench: -only prints a partial table: not with -write or -check")
			os.Exit(2)
		}
		re, err := regexp.Compile(*only)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench: -only:", err)
			os.Exit(2)
		}
		benches = slices.DeleteFunc(benches, func(b bench) bool { return !re.MatchString(b.pattern) })
		ran := map[string]bool{}
		for _, b := range benches {
			ran[b.pattern] = true
		}
		figures = slices.DeleteFunc(figures, func(f figure) bool { return f.of != nil && !ran[f.of.pattern] })
		partial = true
	}
	if err := run(*write, *check, *runs, *doc, *minBand); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(write, check bool, runs int, doc string, minBand float64) error {
	load := loadAverage()
	var all [][]Row
	for i := range max(runs, 1) {
		fmt.Fprintf(os.Stderr, "bench: run %d of %d (load %s)\n", i+1, max(runs, 1), loadAverage())
		res := Results{}
		notRun := map[string]string{} // pattern of an optional benchmark → why it was not run
		for _, b := range benches {
			if b.optional && b.once && i > 0 {
				notRun[b.pattern] = "measured in the first run only"
				continue
			}
			if b.optional && b.built != nil {
				if err := b.built(); err != nil {
					notRun[b.pattern] = err.Error()
					fmt.Fprintf(os.Stderr, "bench: %s not run: %v\n", b.pattern, err)
					continue
				}
			}
			out, err := runBench(b)
			if err != nil && b.optional {
				notRun[b.pattern] = err.Error()
				fmt.Fprintf(os.Stderr, "bench: %s not run: %v\n", b.pattern, err)
				continue
			}
			if err != nil {
				return err
			}
			for k, v := range ParseBench(out) {
				res[k] = v
			}
		}
		rows, err := rowsOf(res, notRun)
		if err != nil {
			return err
		}
		for _, r := range rows {
			if r.NotRun != "" {
				fmt.Fprintf(os.Stderr, "bench: run %d: %s: not run\n", i+1, r.Name)
				continue
			}
			fmt.Fprintf(os.Stderr, "bench: run %d: %s = %s\n", i+1, r.Name, formatValue(r.Value))
		}
		all = append(all, rows)
	}
	rows := Combine(all, minBand)
	header := fmt.Sprintf("Generated by `make bench` on %s at commit %s: %d run(s) on this machine, load average %s at the start; the value is the median of the runs and the noise band twice the largest deviation of a run from it (at least ±%.0f %%).",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), commit(), len(all), load, minBand*100)
	table := Render(header, rows)
	fmt.Println(table)
	raw, err := os.ReadFile(doc)
	if err != nil {
		return err
	}
	if check {
		base, err := ParseTable(string(raw))
		if err != nil {
			return err
		}
		for _, n := range NotRunRows(rows) {
			fmt.Fprintf(os.Stderr, "bench: %s\n", n)
		}
		if moved := Moved(base, rows); len(moved) > 0 {
			return fmt.Errorf("moved past the noise band of the committed table:\n  %s", strings.Join(moved, "\n  "))
		}
		fmt.Fprintln(os.Stderr, "bench: every figure is within its noise band of the committed table")
	}
	if write {
		return os.WriteFile(doc, []byte(Splice(string(raw), table)), 0o644) //nolint:gosec // the developer names the document (-doc)
	}
	return nil
}

func rowsOf(res Results, notRun map[string]string) ([]Row, error) {
	var rows []Row
	for _, f := range figures {
		row := Row{Name: f.name, Budget: f.budget, From: f.from, Optional: f.of != nil, MinBand: f.minBand}
		if f.of != nil && notRun[f.of.pattern] != "" {
			row.NotRun = notRun[f.of.pattern]
			rows = append(rows, row)
			continue
		}
		v, ok := f.value(res)
		switch {
		case !ok && f.of == nil && partial:
			continue
		case !ok && f.of != nil:
			row.NotRun = "its benchmark reported no " + f.from
		case !ok:
			return nil, fmt.Errorf("%s: no result (from %s)", f.name, f.from)
		}
		row.Value = v
		rows = append(rows, row)
	}
	return rows, nil
}

func runBench(b bench) (string, error) {
	ctx := context.Background()
	args := []string{"test", b.pkg, "-run", "^$", "-bench", b.pattern, "-benchtime", b.benchtime, "-timeout", b.timeout, "-count", "1"}
	fmt.Fprintf(os.Stderr, "bench: go %s\n", strings.Join(args, " "))
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = b.dir
	cmd.Env = append(os.Environ(), b.env...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go test %s -bench %s: %w\n%s", b.pkg, b.pattern, err, tail(out.String(), 4000))
	}
	if rawDir != "" {
		name := fmt.Sprintf("%s-%s.txt", time.Now().UTC().Format("150405"), strings.NewReplacer("/", "_", ".", "").Replace(b.pkg))
		_ = os.WriteFile(filepath.Join(rawDir, name), out.Bytes(), 0o644)
	}
	// A benchmark that skips (a missing mkfs, no root) must not pass as a
	// figure: its prerequisite is missing.
	for _, line := range strings.Split(out.String(), "\n") {
		if strings.Contains(line, "--- SKIP") || strings.Contains(line, "prerequisite missing") {
			return "", fmt.Errorf("go test %s -bench %s skipped: %s", b.pkg, b.pattern, strings.TrimSpace(line))
		}
	}
	return out.String(), nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func commit() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, _ := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); len(bytes.TrimSpace(st)) > 0 {
		c += " (with uncommitted changes)"
	}
	return c
}

func loadAverage() string {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(raw))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
