// Package e2e runs the Kubernetes storage e2e suite (e2e.test) against poolcsi's chart on
// a cluster of package cluster, with the driver definitions of this directory, and keeps
// the conformance run's per-spec results (results.json) and its report
// (docs/conformance.md). TestE2EStorage (package harness) and cmd/conformance (make e2e,
// make conformance) run it.
package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/hack/release/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

// The registries e2e.test's images come from, mapped (KUBE_TEST_REPO_LIST) to local names:
// no registry is reachable, so the test builds each image it needs and imports it.
const e2eRepoList = `gcRegistry: poolcsi.test
promoterE2eRegistry: poolcsi.test/e2e-test-images
sigStorageRegistry: poolcsi.test/sig-storage
`

// CIFocus is what Storage runs when nothing else is asked for: a quick check that
// the suite, its images and the driver definitions work (make test leaves the suite out;
// make e2e and make conformance run more of it).
const CIFocus = `External.Storage.*\[Testpattern: Dynamic PV \(default fs\)\] (provisioning should provision storage with mount options|volumes should store data)`

// Nodes is the number of nodes the storage e2e suite runs on.
const Nodes = 2

// Config is what a run of the suite is for.
type Config struct {
	// Focus chooses the specs (a ginkgo regexp; "" is CIFocus; make conformance: every
	// External.Storage spec of both drivers).
	Focus string
	// Report, if set, makes the run the conformance run: every spec of Focus,
	// chunk by chunk, its per-spec results written to this file as Markdown (make
	// conformance writes docs/conformance.md) and kept in results.json.
	Report string
	// Opts are the conformance run's knobs (with Report).
	Opts Options
}

// ConfigFromEnv is the Config of the environment variables TestE2EStorage has always
// read: POOLCSI_E2E_FOCUS, POOLCSI_E2E_REPORT and, with a report, the knobs of Options.
// A bad value is refused here, before any cluster starts.
func ConfigFromEnv() (Config, error) {
	cfg := Config{Focus: os.Getenv("POOLCSI_E2E_FOCUS"), Report: os.Getenv("POOLCSI_E2E_REPORT")}
	if cfg.Report != "" {
		var err error
		if cfg.Opts, err = conformanceOptsFromEnv(); err != nil {
			return cfg, err
		}
	}
	return cfg, nil
}

// Storage runs the Kubernetes storage e2e suite for external drivers (e2e.test v1.36.3)
// against the chart running as pods on a two-node cluster (cluster.StartEnv), with a
// definition file per driver in test/k8s/e2e: the specs of cfg.Focus once, each failure
// an error of t, or with cfg.Report the conformance run.
func Storage(t testing.TB, cfg Config) {
	focus, report, opts := cfg.Focus, cfg.Report, cfg.Opts
	if focus == "" {
		focus = CIFocus
	}
	e2e, agnhost := tools.E2E.Path(t), tools.Agnhost.Path(t)
	images := func(t testing.TB) []cluster.Image {
		bb := cluster.BusyboxImage(t, "poolcsi.test/e2e-test-images/busybox:1.37.0-1")
		bb136 := bb
		bb136.Ref = "poolcsi.test/e2e-test-images/busybox:1.36.1-1"
		// The storage specs run shell commands in these (multiVolume's concurrent-access pods
		// in glibc-dns-testing, the exec spec's script in nginx): busybox's sh serves both,
		// with GNU dd (coreutils) where the block specs write with oflag=nocache.
		// dash is its /bin/sh: busybox's sh runs its own applets before PATH (dd is busybox's
		// dd under it whatever /usr/bin/dd is).
		glibc := cluster.WithHostBinaries(t, bb, "/usr/bin/dd", "/bin/sh")
		glibc.Ref = "poolcsi.test/e2e-test-images/glibc-dns-testing:2.0.0"
		nginx := bb
		nginx.Ref = "poolcsi.test/e2e-test-images/nginx:1.15-4"
		// agnhost's image has a shell and the usual tools besides the binary.
		ag := bb
		ag.Ref = "poolcsi.test/e2e-test-images/agnhost:2.63.0" // test/utils/image/manifest.go of v1.36.3
		ag.Files = append(append([]cluster.ImageFile{}, bb.Files...), cluster.ImageFile{Path: "/agnhost", Src: agnhost})
		ag.Entrypoint, ag.Cmd = []string{"/agnhost"}, nil
		return []cluster.Image{bb, bb136, glibc, nginx, ag}
	}
	// Two nodes (TestTwoNodes's, the shared pool on btrfs): the suite's multi-node specs (a
	// volume's pod moved to another node, one volume used from two) and its topology specs
	// need them. Beside the chart's defaults, what the driver definitions claim and a
	// cluster turns on:
	//   - snapshots (snapshots.enabled: the local ones through the central local
	//     controller, the chart's default layout; snapshot-controller not distributed);
	//   - inline volumes in the shared pool too (ephemeralVolumes.shared and the pool's
	//     ephemeral: true), which shared-image.yaml's InlineVolumes name;
	//   - a volume limit per node and driver (node.maxVolumes), which every definition's
	//     volumeLimits specs fill and then exceed by one: small, as each volume of those
	//     specs is an image of its own, formatted on a 2-core machine;
	//   - CSIStorageCapacity for the shared driver's Immediate classes too.
	env := cluster.StartEnv(t, cluster.EnvOptions{Nodes: Nodes, Extra: images, Values: e2eValues})
	dir := t.TempDir()
	repoList := filepath.Join(dir, "repo-list.yaml")
	if err := os.WriteFile(repoList, []byte(e2eRepoList), 0o644); err != nil {
		t.Fatal(err)
	}
	k8sDir := filepath.Join(chart.RepoRoot(), "test", "k8s")
	run := e2eRun{env: env, e2e: e2e, repoList: repoList, k8sDir: k8sDir, dir: dir}
	if report != "" {
		run.ginkgo = tools.Ginkgo.Path(t)
		run.conformance(t, focus, report, opts)
		return
	}
	res := run.run(t, focus, "e2e")
	t.Logf("specs: %d passed, %d failed, %d skipped", len(res.passed), len(res.failed), len(res.skipped))
	if len(res.passed)+len(res.failed) == 0 {
		t.Errorf("no spec ran for focus %q", focus)
	}
	for _, f := range res.failed {
		t.Errorf("FAILED: %s\n%s", f.name, cluster.Tail(f.message, 8))
	}
}

// e2eValues are the chart values of the storage e2e suite's cluster (see Storage).
var e2eValues = map[string]any{
	"snapshots":        map[string]any{"enabled": true},
	"ephemeralVolumes": map[string]any{"shared": true},
	"pools": map[string]any{"shared": []any{
		map[string]any{"name": "shared", "path": cluster.SharedPoolPath, "ephemeral": true},
	}},
	"node": map[string]any{"maxVolumes": map[string]any{"shared": e2eMaxVolumes, "local": e2eMaxVolumes}},
	// The shared definitions' classes bind at once (Immediate), for which csi-provisioner
	// publishes no CSIStorageCapacity unless told to (the scheduler reads them only for
	// WaitForFirstConsumer classes): the capacity specs then see GetCapacity of the shared
	// pool through the released sidecar.
	"controller": map[string]any{"provisionerExtraArgs": []any{"--capacity-for-immediate-binding"}},
}

// e2eMaxVolumes is the volume limit of each node and driver in the e2e cluster: above what
// three specs at once put on one node (the modify stress spec's four pods beside two
// specs of two), small enough that the volumeLimits specs fill a node quickly.
const e2eMaxVolumes = 10

// e2eRun runs e2e.test against one kubelet environment.
type e2eRun struct {
	env                                *cluster.Env
	e2e, ginkgo, repoList, k8sDir, dir string
}

// suiteArgs are e2e.test's own flags: the cluster, the driver definitions and the reports.
func (r e2eRun) suiteArgs() []string {
	return []string{
		"--kubeconfig=" + r.env.Cluster.AdminKube, "--provider=skeleton", "--repo-root=" + r.k8sDir,
		"--storage.testdriver=" + filepath.Join(r.k8sDir, "e2e", "local-image.yaml"),
		"--storage.testdriver=" + filepath.Join(r.k8sDir, "e2e", "shared-image.yaml"),
		"--storage.testdriver=" + filepath.Join(r.k8sDir, "e2e", "shared-dir.yaml"),
		"--report-dir=" + r.dir,
	}
}

// ginkgoArgs are the flags of ginkgo itself: prefix is "--ginkgo." when e2e.test is run
// directly and "--" for the ginkgo CLI.
func ginkgoArgs(prefix, focus, skip, junit string) []string {
	if env := os.Getenv("POOLCSI_E2E_SKIP"); env != "" {
		if skip != "" {
			skip += "|"
		}
		skip += env
	}
	args := []string{prefix + "focus=" + focus, prefix + "junit-report=" + junit, prefix + "no-color", prefix + "timeout=4h"}
	if skip != "" {
		args = append(args, prefix+"skip="+skip)
	}
	return args
}

// run runs the specs matching focus and returns their results; name tells this run's log
// and report apart from the others of the test.
func (r e2eRun) run(t testing.TB, focus, name string) *e2eResults {
	t.Helper()
	junit := filepath.Join(r.dir, name+".junit.xml")
	return r.exec(t, r.command(r.e2e, append(r.suiteArgs(), ginkgoArgs("--ginkgo.", focus, "", junit)...)...), name, junit)
}

// runParallel runs the specs matching focus and not skip on procs ginkgo processes at once
// (the ginkgo CLI runs e2e.test as a precompiled suite): the specs mostly wait on pods and
// the API server, so a 2-core machine runs three about as fast as one.
func (r e2eRun) runParallel(t testing.TB, focus, skip, name string, procs int) *e2eResults {
	t.Helper()
	junit := filepath.Join(r.dir, name+".junit.xml")
	args := append([]string{"--procs=" + strconv.Itoa(procs)}, ginkgoArgs("--", focus, skip, junit)...)
	args = append(append(args, r.e2e, "--"), r.suiteArgs()...)
	return r.exec(t, r.command(r.ginkgo, args...), name, junit)
}

// command runs bin (e2e.test, or the ginkgo CLI running it) with the image names mapped to
// the images built here.
func (r e2eRun) command(bin string, args ...string) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+r.repoList)
	return cmd
}

func (r e2eRun) exec(t testing.TB, cmd *exec.Cmd, name, junit string) *e2eResults {
	t.Helper()
	logPath := filepath.Join(r.env.Cluster.Dir, "logs", name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	start := time.Now()
	runErr := cmd.Run()
	logf.Close()
	t.Logf("%s ran in %s (log %s): %v", filepath.Base(cmd.Path), time.Since(start).Round(time.Second), logPath, runErr)
	res, err := readJUnit(junit)
	if err != nil {
		b, _ := os.ReadFile(logPath)
		t.Fatalf("%s left no report (%v):\n%s", filepath.Base(cmd.Path), err, cluster.Tail(string(b), 60))
	}
	return res
}

// list returns the names of the specs matching focus, from a dry run (nothing runs).
func (r e2eRun) list(t testing.TB, focus string) []string {
	t.Helper()
	junit := filepath.Join(r.dir, "list.junit.xml")
	cmd := r.command(r.e2e, append(append(r.suiteArgs(), ginkgoArgs("--ginkgo.", focus, "", junit)...), "--ginkgo.dry-run")...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("e2e.test --ginkgo.dry-run: %v\n%s", err, cluster.Tail(string(out), 40))
	}
	res, err := readJUnit(junit)
	if err != nil {
		t.Fatal(err)
	}
	// A dry run reports the focused specs as passed and every other spec as skipped.
	var names []string
	for _, s := range res.passed {
		names = append(names, s.name)
	}
	return names
}

// chunkOf is the driver and test pattern a spec belongs to: the unit the conformance run
// runs, records and resumes from.
var chunkOf = regexp.MustCompile(`^External Storage \[Driver: [^\]]+\](?: \[[^\]]+\])*? \[Testpattern: [^\]]+\]`)

// conformance runs every spec matching focus, one driver and test pattern at a time, and
// after each one merges its results into test/k8s/e2e/results.json and rewrites report
// (docs/conformance.md) from every result recorded so far. A chunk whose specs all have a
// result is not run again unless POOLCSI_E2E_RERUN is set (to "failed": only chunks with a
// failed spec, after a fix), so an interrupted run resumes
// where it stopped; POOLCSI_E2E_BUDGET (a duration) stops starting chunks after that long.
// The whole suite takes hours on a 2-core machine, more than one sitting.
func (r e2eRun) conformance(t testing.TB, focus, report string, opts Options) {
	resultsPath := filepath.Join(r.k8sDir, "e2e", "results.json")
	results, err := loadResults(resultsPath)
	if err != nil {
		t.Fatal(err)
	}
	all := r.list(t, focus)
	if len(all) == 0 {
		t.Fatalf("no spec matches %q", focus)
	}
	chunks := map[string][]string{}
	var order []string
	for _, name := range all {
		c := chunkOf.FindString(name)
		if c == "" {
			c = name
		}
		if chunks[c] == nil {
			order = append(order, c)
		}
		chunks[c] = append(chunks[c], name)
	}
	sort.Strings(order)
	// A stop asked for before this run is not for it.
	if err := os.Remove(conformanceStop); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	start := time.Now()
	save := func() {
		if err := results.save(resultsPath); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(report, []byte(results.markdown(all)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range order {
		names := opts.pick(chunks[c])
		if len(names) == 0 || (opts.chunks != nil && !opts.chunks.MatchString(c)) || !results.due(names, opts.rerun) {
			continue
		}
		if time.Since(start) > opts.budget {
			t.Logf("budget %s spent: chunks from %q on are left for the next run", opts.budget, c)
			break
		}
		if os.Remove(conformanceStop) == nil {
			t.Logf("%s asked to stop: chunks from %q on are left for the next run", conformanceStop, c)
			break
		}
		res := r.runChunk(t, c, names, fmt.Sprintf("chunk-%03d", i), opts)
		t.Logf("%s: %d passed, %d failed, %d skipped", c, len(res.passed), len(res.failed), len(res.skipped))
		for _, f := range res.failed {
			t.Errorf("FAILED: %s\n%s", f.name, cluster.Tail(f.message, 8))
		}
		results.merge(res, time.Now(), len(r.env.Nodes))
		save()
	}
	save()
}

// conformanceStop, once created (make conformance-stop), stops a conformance run after the
// chunk it is running, with that chunk's results kept and the cluster torn down: ginkgo's
// workers ignore signals while a spec waits, and a killed run loses its chunk.
const conformanceStop = "/run/lock/poolcsi-conformance.stop"

// serialSpec marks the specs that must run alone: the suite's [Serial] and [Disruptive]
// specs (a label only, not ginkgo's Serial decorator, so ginkgo would run them beside others).
var serialSpec = regexp.MustCompile(`\[(Serial|Disruptive)\]`)

// Options are make conformance's knobs: POOLCSI_E2E_BUDGET (stop starting chunks
// after this long; default 5h), POOLCSI_E2E_PROCS (ginkgo processes; default 3),
// POOLCSI_E2E_RERUN (see conformanceResults.due), POOLCSI_E2E_CHUNKS (a regexp: only the
// chunks it matches run, e.g. after a definition claims a capability it did not before) and
// POOLCSI_E2E_SPECS (a regexp: only the specs whose names it matches run, the others keep
// their results, e.g. the multi-node specs after the cluster got its second node).
type Options struct {
	budget time.Duration
	procs  int
	rerun  string
	chunks *regexp.Regexp
	specs  *regexp.Regexp
}

// pick is the specs of a chunk this run is for.
func (o Options) pick(names []string) []string {
	if o.specs == nil {
		return names
	}
	var out []string
	for _, n := range names {
		if o.specs.MatchString(n) {
			out = append(out, n)
		}
	}
	return out
}

// namedRegexp is the regexp v, named for its errors; nil when v is "".
func namedRegexp(name, v string) (*regexp.Regexp, error) {
	if v == "" {
		return nil, nil
	}
	re, err := regexp.Compile(v)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return re, nil
}

// conformanceOptsFromEnv reads the Options of make conformance's environment variables.
func conformanceOptsFromEnv() (Options, error) {
	return ParseOptions(os.Getenv("POOLCSI_E2E_BUDGET"), os.Getenv("POOLCSI_E2E_PROCS"), os.Getenv("POOLCSI_E2E_RERUN"),
		os.Getenv("POOLCSI_E2E_CHUNKS"), os.Getenv("POOLCSI_E2E_SPECS"))
}

// ParseOptions checks and returns the conformance run's knobs, each "" for its default;
// an error names the environment variable of the knob (cmd/conformance's flags default
// to them).
func ParseOptions(budget, procs, rerun, chunks, specs string) (Options, error) {
	o := Options{budget: 5 * time.Hour, procs: 3, rerun: rerun}
	if budget != "" {
		d, err := time.ParseDuration(budget)
		if err != nil {
			return o, fmt.Errorf("POOLCSI_E2E_BUDGET: %w", err)
		}
		o.budget = d
	}
	var err error
	if o.chunks, err = namedRegexp("POOLCSI_E2E_CHUNKS", chunks); err != nil {
		return o, err
	}
	if o.specs, err = namedRegexp("POOLCSI_E2E_SPECS", specs); err != nil {
		return o, err
	}
	if procs != "" {
		n, err := strconv.Atoi(procs)
		if err != nil || n < 1 {
			return o, fmt.Errorf("POOLCSI_E2E_PROCS=%q: want a number of processes", procs)
		}
		o.procs = n
	}
	return o, nil
}

// runChunk runs one chunk's specs: those that may share the cluster on procs ginkgo
// processes, then the serial ones alone. A report lists every spec of the suite, the ones
// its focus or skip left out as "skipped": only the specs each run was for are its results.
func (r e2eRun) runChunk(t testing.TB, chunk string, names []string, name string, opts Options) *e2eResults {
	var parallel, serial []string
	for _, n := range names {
		if serialSpec.MatchString(n) {
			serial = append(serial, n)
		} else {
			parallel = append(parallel, n)
		}
	}
	focus := regexp.QuoteMeta(chunk) + " "
	// A SPECS regexp that matches the chunk's own name (a test pattern) picked all of
	// it: the focus is the chunk. Else it matches in what follows the chunk's name.
	if opts.specs != nil && !opts.specs.MatchString(chunk) {
		focus += ".*(?:" + opts.specs.String() + ")"
	}
	res := &e2eResults{}
	if len(parallel) > 0 {
		res.add(r.runParallel(t, focus, serialSpec.String(), name+"-parallel", opts.procs).only(parallel))
	}
	if len(serial) > 0 {
		res.add(r.run(t, focus+".*"+serialSpec.String(), name+"-serial").only(serial))
	}
	return res
}
