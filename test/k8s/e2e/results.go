package e2e

import (
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

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
	// A WaitForFirstConsumer class (the local driver's) only: the shared definitions' classes
	// bind at once and pass it.
	{regexp.MustCompile(`volume-modify-stress .* multiple pods should modify volumes with a different volumeAttributesClass`),
		regexp.MustCompile(`spec is immutable after creation except resources\.requests`),
		"the spec makes its pods' objects but never creates the pods, so the claims of a WaitForFirstConsumer " +
			"class (the local driver's: a local volume is made on its pod's node) are never bound, and the API server " +
			"refuses a class change of an unbound claim (`spec is immutable after creation except resources.requests " +
			"and volumeAttributesClassName for bound claims`). The driver is not called; the other volume-modify " +
			"specs, whose pods run, change the class of a bound local claim", "the suite"},
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
