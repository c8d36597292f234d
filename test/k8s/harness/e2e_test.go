package harness

import (
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/chart"
	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

// The registries e2e.test's images come from, mapped (KUBE_TEST_REPO_LIST) to local names:
// no registry is reachable, so the test builds each image it needs and imports it.
const e2eRepoList = `gcRegistry: poolcsi.test
promoterE2eRegistry: poolcsi.test/e2e-test-images
sigStorageRegistry: poolcsi.test/sig-storage
`

// ciFocus is what TestE2EStorage runs when nothing else is asked for: a quick check that
// the suite, its images and the driver definitions work (make test leaves the suite out;
// make e2e and make conformance run more of it).
const ciFocus = `External.Storage.*\[Testpattern: Dynamic PV \(default fs\)\] (provisioning should provision storage with mount options|volumes should store data)`

// e2eNodes is the number of nodes the storage e2e suite runs on.
const e2eNodes = 2

// TestE2EStorage runs the Kubernetes storage e2e suite for external drivers (e2e.test
// v1.36.3) against the chart running as pods, with a definition file per driver in
// test/k8s/e2e. POOLCSI_E2E_FOCUS chooses the specs (a ginkgo regexp; default ciFocus;
// make conformance: every External.Storage spec of both drivers); POOLCSI_E2E_REPORT names
// a file to write the per-spec results to as Markdown (make conformance writes
// docs/conformance.md).
func TestE2EStorage(t *testing.T) {
	focus := os.Getenv("POOLCSI_E2E_FOCUS")
	if focus == "" {
		focus = ciFocus
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
	report := os.Getenv("POOLCSI_E2E_REPORT")
	var opts conformanceOpts
	if report != "" {
		// Read before the cluster starts, so that a bad value fails at once.
		var err error
		if opts, err = conformanceOptsFromEnv(); err != nil {
			t.Fatal(err)
		}
	}
	// Two nodes (TestTwoNodes's, the shared pool on btrfs): the suite's multi-node specs (a
	// volume's pod moved to another node, one volume used from two) and its topology specs
	// need them. Beside the chart's defaults, what the driver definitions claim and a
	// cluster turns on:
	//   - local snapshots (snapshots.local; snapshot-controller runs distributed);
	//   - inline volumes in the shared pool too (ephemeralVolumes.shared and the pool's
	//     ephemeral: true), which shared-image.yaml's InlineVolumes name;
	//   - a volume limit per node and driver (node.maxVolumes), which every definition's
	//     volumeLimits specs fill and then exceed by one: small, as each volume of those
	//     specs is an image of its own, formatted on a 2-core machine;
	//   - CSIStorageCapacity for the shared driver's Immediate classes too.
	env := startEnv(t, cluster.EnvOptions{Nodes: e2eNodes, Extra: images, Values: e2eValues})
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

// e2eValues are the chart values of the storage e2e suite's cluster (see TestE2EStorage).
var e2eValues = map[string]any{
	"snapshots":        map[string]any{"enabled": true, "local": true},
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
	env                                *kubeletEnv
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
func (r e2eRun) run(t *testing.T, focus, name string) *e2eResults {
	t.Helper()
	junit := filepath.Join(r.dir, name+".junit.xml")
	return r.exec(t, r.command(r.e2e, append(r.suiteArgs(), ginkgoArgs("--ginkgo.", focus, "", junit)...)...), name, junit)
}

// runParallel runs the specs matching focus and not skip on procs ginkgo processes at once
// (the ginkgo CLI runs e2e.test as a precompiled suite): the specs mostly wait on pods and
// the API server, so a 2-core machine runs three about as fast as one.
func (r e2eRun) runParallel(t *testing.T, focus, skip, name string, procs int) *e2eResults {
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

func (r e2eRun) exec(t *testing.T, cmd *exec.Cmd, name, junit string) *e2eResults {
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
func (r e2eRun) list(t *testing.T, focus string) []string {
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
func (r e2eRun) conformance(t *testing.T, focus, report string, opts conformanceOpts) {
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
		results.merge(res, time.Now(), e2eNodes)
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

// conformanceOpts are make conformance's knobs: POOLCSI_E2E_BUDGET (stop starting chunks
// after this long; default 5h), POOLCSI_E2E_PROCS (ginkgo processes; default 3),
// POOLCSI_E2E_RERUN (see conformanceResults.due), POOLCSI_E2E_CHUNKS (a regexp: only the
// chunks it matches run, e.g. after a definition claims a capability it did not before) and
// POOLCSI_E2E_SPECS (a regexp: only the specs whose names it matches run, the others keep
// their results, e.g. the multi-node specs after the cluster got its second node).
type conformanceOpts struct {
	budget time.Duration
	procs  int
	rerun  string
	chunks *regexp.Regexp
	specs  *regexp.Regexp
}

// pick is the specs of a chunk this run is for.
func (o conformanceOpts) pick(names []string) []string {
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

// envRegexp is the regexp in the environment variable name; nil when it is unset.
func envRegexp(name string) (*regexp.Regexp, error) {
	v := os.Getenv(name)
	if v == "" {
		return nil, nil
	}
	re, err := regexp.Compile(v)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return re, nil
}

func conformanceOptsFromEnv() (conformanceOpts, error) {
	o := conformanceOpts{budget: 5 * time.Hour, procs: 3, rerun: os.Getenv("POOLCSI_E2E_RERUN")}
	if b := os.Getenv("POOLCSI_E2E_BUDGET"); b != "" {
		d, err := time.ParseDuration(b)
		if err != nil {
			return o, fmt.Errorf("POOLCSI_E2E_BUDGET: %w", err)
		}
		o.budget = d
	}
	var err error
	if o.chunks, err = envRegexp("POOLCSI_E2E_CHUNKS"); err != nil {
		return o, err
	}
	if o.specs, err = envRegexp("POOLCSI_E2E_SPECS"); err != nil {
		return o, err
	}
	if p := os.Getenv("POOLCSI_E2E_PROCS"); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 {
			return o, fmt.Errorf("POOLCSI_E2E_PROCS=%q: want a number of processes", p)
		}
		o.procs = n
	}
	return o, nil
}

// runChunk runs one chunk's specs: those that may share the cluster on procs ginkgo
// processes, then the serial ones alone. A report lists every spec of the suite, the ones
// its focus or skip left out as "skipped": only the specs each run was for are its results.
func (r e2eRun) runChunk(t *testing.T, chunk string, names []string, name string, opts conformanceOpts) *e2eResults {
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

type specResult struct{ name, message string }

type e2eResults struct{ passed, failed, skipped []specResult }

func (r *e2eResults) add(o *e2eResults) {
	r.passed = append(r.passed, o.passed...)
	r.failed = append(r.failed, o.failed...)
	r.skipped = append(r.skipped, o.skipped...)
}

// only keeps the results of the named specs.
func (r *e2eResults) only(names []string) *e2eResults {
	keep := map[string]bool{}
	for _, n := range names {
		keep[n] = true
	}
	filter := func(specs []specResult) []specResult {
		var out []specResult
		for _, s := range specs {
			if keep[s.name] {
				out = append(out, s)
			}
		}
		return out
	}
	return &e2eResults{passed: filter(r.passed), failed: filter(r.failed), skipped: filter(r.skipped)}
}

func readJUnit(path string) (*e2eResults, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var suites struct {
		Suites []struct {
			Cases []struct {
				Name    string `xml:"name,attr"`
				Skipped *struct {
					Message string `xml:"message,attr"`
				} `xml:"skipped"`
				Failure *struct {
					Message string `xml:"message,attr"`
					Text    string `xml:",chardata"`
				} `xml:"failure"`
				Error *struct {
					Message string `xml:"message,attr"`
				} `xml:"error"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	if err := xml.Unmarshal(data, &suites); err != nil {
		return nil, err
	}
	r := &e2eResults{}
	for _, s := range suites.Suites {
		for _, c := range s.Cases {
			if !strings.Contains(c.Name, "External Storage") {
				continue // BeforeSuite/AfterSuite and other suites' specs
			}
			// Ginkgo names a spec in its JUnit report after its node type ("[It] External
			// Storage …"); the chunks and the report use the spec's own text.
			c.Name = strings.TrimPrefix(c.Name, "[It] ")
			switch {
			case c.Failure != nil:
				r.failed = append(r.failed, specResult{c.Name, c.Failure.Message + "\n" + c.Failure.Text})
			case c.Error != nil:
				r.failed = append(r.failed, specResult{c.Name, c.Error.Message})
			case c.Skipped != nil:
				r.skipped = append(r.skipped, specResult{c.Name, c.Skipped.Message})
			default:
				r.passed = append(r.passed, specResult{name: c.Name})
			}
		}
	}
	return r, nil
}

var skipReason = regexp.MustCompile(`(?s)skipped - (.*)`)

// knownCauses explains failures that come from this machine, not from the driver: the report
// names the cause beside the spec.
var knownCauses = []struct {
	spec, reason *regexp.Regexp // either may be nil: then it matches every spec or reason
	cause        string
	where        string // whose the cause is; "" is this machine's
}{
	{nil, regexp.MustCompile(`on node \S+: command terminated with exit code`), "the spec checks the node through " +
		"the suite's host-exec pod, which runs nsenter into PID 1's mount namespace; on this machine " +
		"even root on the host may not open /proc/1/ns/mnt (`nsenter: can't open '/rootfs/proc/1/ns/mnt': " +
		"Permission denied`), so every host-exec command fails", ""},
	{regexp.MustCompile(`any volume data source`), nil, "needs the hello-populator and volume-data-source-validator images; " +
		"their modules (github.com/kubernetes-csi/lib-volume-populator, github.com/kubernetes-csi/volume-data-source-validator) " +
		"are not on the Go module proxy and no registry is reachable here, so the pod waits in ImagePullBackOff", ""},
	{regexp.MustCompile(`\[Layout: dir\]`), regexp.MustCompile(`fs size: \d+ bytes is not larger than origin fs size`),
		"the spec reads a dir volume's size with df in the pod. A dir volume's size is its quota, and this machine's only " +
			"dir quota is btrfs quota groups (its kernel has no XFS or ext4 project quotas), whose limit statfs never shows: " +
			"btrfs reports the whole filesystem. XFS and ext4 project quotas report the quota to statfs, so on such a pool " +
			"df shows the volume's size (kubelet's volume stats show it on any pool: NodeGetVolumeStats reads the quota)", ""},
	// Only the restored pod's wait: a group snapshot that never became ready fails earlier,
	// with another message, and is the driver's.
	{regexp.MustCompile(`VolumeGroupSnapshottable should create snapshots for StatefulSet volumes and verify data consistency after restore`),
		regexp.MustCompile(`Restored pod did not start in expected time`),
		"the spec restores each member into a claim of the test suite's smallest size (1 MiB, the suite's " +
			"SupportedSizeRange, not the driver's), and csi-provisioner refuses a restore smaller than its snapshot " +
			"(`requested volume size 1048576 is less than the size 314572800 for the source snapshot`): the members are " +
			"xfs image volumes of 300 MiB, xfs's smallest. The group snapshot itself became ready; a driver whose " +
			"smallest volume is 1 MiB passes", "the suite"},
}

// outsideCauses are the known causes outside the driver (knownCauses) that explain a failed
// spec's reason, each as the report prints it.
func outsideCauses(name, reason string) []string {
	var out []string
	for _, k := range knownCauses {
		if (k.spec == nil || k.spec.MatchString(name)) && (k.reason == nil || k.reason.MatchString(reason)) {
			where := k.where
			if where == "" {
				where = "this machine"
			}
			out = append(out, "**Cause ("+where+"):** "+k.cause+".")
		}
	}
	return out
}

// specRecord is one spec's latest result.
type specRecord struct {
	Result string `json:"result"` // passed, failed or skipped
	Reason string `json:"reason,omitempty"`
	Date   string `json:"date"`
	// Nodes is the number of nodes of the cluster it ran on; 0 is 1 (the results of before
	// the cluster had two).
	Nodes int `json:"nodes,omitempty"`
}

// nodes is the number of nodes the spec ran on.
func (s specRecord) nodes() int { return max(s.Nodes, 1) }

func nodeCount(n int) string {
	if n == 1 {
		return "1 node"
	}
	return strconv.Itoa(n) + " nodes"
}

type conformanceResults map[string]specRecord

func loadResults(path string) (conformanceResults, error) {
	r := conformanceResults{}
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return r, nil
	}
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return r, nil
}

func (r conformanceResults) save(path string) error {
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}

// due reports whether a chunk of specs is to run: one without a result for every spec;
// with rerun "failed", also one with a failed spec; with any other rerun, every chunk.
func (r conformanceResults) due(names []string, rerun string) bool {
	switch rerun {
	case "":
		return !r.hasAll(names)
	case "failed":
		if !r.hasAll(names) {
			return true
		}
		// A failure explained outside the driver (knownCauses) is not fixed by a change to
		// the driver, so it alone does not bring its chunk back.
		for _, n := range names {
			if r[n].Result == "failed" && len(outsideCauses(n, r[n].Reason)) == 0 {
				return true
			}
		}
		return false
	default:
		return true
	}
}

func (r conformanceResults) hasAll(names []string) bool {
	for _, n := range names {
		if _, ok := r[n]; !ok {
			return false
		}
	}
	return true
}

func (r conformanceResults) merge(res *e2eResults, now time.Time, nodes int) {
	date := now.UTC().Format("2006-01-02")
	add := func(result string, specs []specResult) {
		for _, s := range specs {
			r[s.name] = specRecord{Result: result, Reason: oneLine(s.message), Date: date, Nodes: nodes}
		}
	}
	add("passed", res.passed)
	add("failed", res.failed)
	add("skipped", res.skipped)
}

// driverName is a driver's name as the suite's skip messages quote it.
var driverName = regexp.MustCompile(`(Driver |driver )"?[a-z0-9.-]+\.io"?`)

// skipGist is a skip reason without the driver's name, so that one reason of several
// drivers counts once.
func skipGist(reason string) string {
	return driverName.ReplaceAllString(reason, "${1}…")
}

// oneLine is a skip or failure message cut to what a reader of the report needs.
func oneLine(msg string) string {
	reason := strings.TrimSpace(msg)
	if m := skipReason.FindStringSubmatch(reason); m != nil {
		reason = m[1]
	}
	reason = strings.Join(strings.Fields(reason), " ")
	if len(reason) > 240 {
		reason = reason[:240] + "…"
	}
	return reason
}

// markdown renders docs/conformance.md: every recorded result, and the specs of the
// suite (all) not run yet.
func (r conformanceResults) markdown(all []string) string {
	by := map[string][]string{}
	var notRun []string
	for _, n := range all {
		if rec, ok := r[n]; ok {
			by[rec.Result] = append(by[rec.Result], n)
		} else {
			notRun = append(notRun, n)
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Kubernetes storage e2e suite: results\n\n")
	fmt.Fprintf(&b, "e2e.test %s, every External Storage spec for the driver definitions in `test/k8s/e2e`\n", tools.KubeVersion)
	fmt.Fprintf(&b, "(`local-image.yaml`: local.poolcsi.io, image volumes; `shared-image.yaml`: poolcsi.io, image\n")
	fmt.Fprintf(&b, "volumes; `shared-dir.yaml`: poolcsi.io, dir volumes, named `[Layout: dir]`), against the chart\n")
	fmt.Fprintf(&b, "running as pods on the two-node cluster of `TestTwoNodes` (docs/testing.md, \"Two nodes on\n")
	fmt.Fprintf(&b, "one machine\"; the shared pool on btrfs). Generated by `make conformance` from\n")
	fmt.Fprintf(&b, "`test/k8s/e2e/results.json`, which keeps each spec's latest result and the number of nodes it\n")
	fmt.Fprintf(&b, "ran on (results from before the cluster had two nodes say \"1 node\"): the suite runs one\n")
	fmt.Fprintf(&b, "driver and test pattern at a time (three specs at once, the [Serial] and [Disruptive] ones\n")
	fmt.Fprintf(&b, "alone) and resumes where it stopped, since all of it takes hours on a 2-core machine.\n\n")
	fmt.Fprintf(&b, "%d specs: %d passed, %d failed, %d skipped, %d not run yet.\n\n",
		len(all), len(by["passed"]), len(by["failed"]), len(by["skipped"]), len(notRun))
	nodes := map[int]int{}
	for _, n := range all {
		if rec, ok := r[n]; ok {
			nodes[rec.nodes()]++
		}
	}
	fmt.Fprintf(&b, "Ran on two nodes: %d specs; on one node: %d.\n\n", nodes[2], nodes[1])
	// Why specs were skipped, most common first: the suite skips what a definition does
	// not claim, and each reason covers many specs.
	reasons := map[string]int{}
	for _, n := range by["skipped"] {
		reasons[skipGist(r[n].Reason)]++
	}
	var keys []string
	for k := range reasons {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if reasons[keys[i]] != reasons[keys[j]] {
			return reasons[keys[i]] > reasons[keys[j]]
		}
		return keys[i] < keys[j]
	})
	if len(keys) > 0 {
		fmt.Fprintf(&b, "## Why specs were skipped\n\n| specs | reason (driver names left out) |\n|---|---|\n")
		for _, k := range keys {
			fmt.Fprintf(&b, "| %d | %s |\n", reasons[k], strings.ReplaceAll(k, "|", "\\|"))
		}
		b.WriteString("\n")
	}
	section := func(title string, names []string, withReason bool) {
		fmt.Fprintf(&b, "## %s (%d)\n\n", title, len(names))
		sort.Strings(names)
		for _, n := range names {
			rec := r[n]
			line := "- " + n
			if withReason && rec.Reason != "" {
				line += " — " + rec.Reason
			}
			if rec.Result == "failed" {
				for _, c := range outsideCauses(n, rec.Reason) {
					line += " " + c
				}
			}
			if rec.Date != "" {
				line += " (" + rec.Date + ", " + nodeCount(rec.nodes()) + ")"
			}
			fmt.Fprintln(&b, line)
		}
		b.WriteString("\n")
	}
	section("Failed", by["failed"], true)
	section("Passed", by["passed"], false)
	section("Skipped", by["skipped"], true)
	section("Not run yet", notRun, false)
	return b.String()
}
