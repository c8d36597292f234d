package harness

import (
	"encoding/xml"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/chart"
)

// The registries e2e.test's images come from, mapped (KUBE_TEST_REPO_LIST) to local names:
// no registry is reachable, so the test builds each image it needs and imports it.
const e2eRepoList = `gcRegistry: poolcsi.test
promoterE2eRegistry: poolcsi.test/e2e-test-images
sigStorageRegistry: poolcsi.test/sig-storage
`

// ciFocus is the part of the suite `make test` runs: a spec takes about a minute on this
// 2-core machine, so the whole suite (make conformance) does not fit in CI.
const ciFocus = `External.Storage.*\[Testpattern: Dynamic PV \(default fs\)\] (provisioning should provision storage with mount options|volumes should store data)`

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
	e2e, agnhost := e2eTool.Path(t), agnhostTool.Path(t)
	images := func(t testing.TB) []Image {
		bb := BusyboxImage(t, "poolcsi.test/e2e-test-images/busybox:1.37.0-1")
		bb136 := bb
		bb136.Ref = "poolcsi.test/e2e-test-images/busybox:1.36.1-1"
		// agnhost's image has a shell and the usual tools besides the binary.
		ag := bb
		ag.Ref = "poolcsi.test/e2e-test-images/agnhost:2.55"
		ag.Files = append(append([]ImageFile{}, bb.Files...), ImageFile{Path: "/agnhost", Src: agnhost})
		ag.Entrypoint, ag.Cmd = []string{"/agnhost"}, nil
		return []Image{bb, bb136, ag}
	}
	env := startKubeletEnvWith(t, images)
	dir := t.TempDir()
	repoList := filepath.Join(dir, "repo-list.yaml")
	if err := os.WriteFile(repoList, []byte(e2eRepoList), 0o644); err != nil {
		t.Fatal(err)
	}
	k8sDir := filepath.Join(chart.RepoRoot(), "test", "k8s")
	junit := filepath.Join(dir, "junit.xml")
	args := []string{
		"--kubeconfig=" + env.c.AdminKube, "--provider=skeleton", "--repo-root=" + k8sDir,
		"--storage.testdriver=" + filepath.Join(k8sDir, "e2e", "local-image.yaml"),
		"--storage.testdriver=" + filepath.Join(k8sDir, "e2e", "shared-image.yaml"),
		"--ginkgo.focus=" + focus,
		"--ginkgo.junit-report=" + junit,
		"--ginkgo.no-color", "--ginkgo.timeout=4h",
		"--report-dir=" + dir,
	}
	if skip := os.Getenv("POOLCSI_E2E_SKIP"); skip != "" {
		args = append(args, "--ginkgo.skip="+skip)
	}
	cmd := exec.Command(e2e, args...)
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+repoList)
	logPath := filepath.Join(env.c.Dir, "logs", "e2e.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	start := time.Now()
	runErr := cmd.Run()
	logf.Close()
	t.Logf("e2e.test ran in %s (log %s): %v", time.Since(start).Round(time.Second), logPath, runErr)
	res, err := readJUnit(junit)
	if err != nil {
		b, _ := os.ReadFile(logPath)
		t.Fatalf("e2e.test left no report (%v):\n%s", err, tail(string(b), 60))
	}
	t.Logf("specs: %d passed, %d failed, %d skipped", len(res.passed), len(res.failed), len(res.skipped))
	if len(res.passed)+len(res.failed) == 0 {
		t.Errorf("no spec ran for focus %q", focus)
	}
	for _, f := range res.failed {
		t.Errorf("FAILED: %s\n%s", f.name, tail(f.message, 8))
	}
	if out := os.Getenv("POOLCSI_E2E_REPORT"); out != "" {
		if err := os.WriteFile(out, []byte(res.markdown(focus)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

type specResult struct{ name, message string }

type e2eResults struct{ passed, failed, skipped []specResult }

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

func (r *e2eResults) markdown(focus string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Kubernetes storage e2e suite: results\n\n")
	fmt.Fprintf(&b, "e2e.test %s, the External Storage specs (`--ginkgo.focus=%s`) for the driver definitions in\n", KubeVersion, focus)
	fmt.Fprintf(&b, "`test/k8s/e2e`, against the chart running as pods on the one-node cluster of `TestKubelet`.\n")
	fmt.Fprintf(&b, "Regenerate with `make conformance`. %d passed, %d failed, %d skipped.\n\n", len(r.passed), len(r.failed), len(r.skipped))
	section := func(title string, specs []specResult, withReason bool) {
		fmt.Fprintf(&b, "## %s (%d)\n\n", title, len(specs))
		sort.Slice(specs, func(i, j int) bool { return specs[i].name < specs[j].name })
		for _, s := range specs {
			if withReason {
				reason := strings.TrimSpace(s.message)
				if m := skipReason.FindStringSubmatch(reason); m != nil {
					reason = m[1]
				}
				reason = strings.Join(strings.Fields(reason), " ")
				if len(reason) > 240 {
					reason = reason[:240] + "…"
				}
				fmt.Fprintf(&b, "- %s — %s\n", s.name, reason)
			} else {
				fmt.Fprintf(&b, "- %s\n", s.name)
			}
		}
		b.WriteString("\n")
	}
	section("Failed", r.failed, true)
	section("Passed", r.passed, false)
	section("Skipped", r.skipped, true)
	return b.String()
}
