// Command conformance runs the Kubernetes storage e2e suite (e2e.test) against poolcsi's
// chart on a two-node cluster of this machine (package e2e): make e2e runs the specs of
// -focus once; make conformance, with -report, runs every spec chunk by chunk, keeping
// each result in test/k8s/e2e/results.json and rewriting the report after each chunk.
// Needs root, as the cluster tests do. Each flag defaults to the environment variable
// TestE2EStorage reads (POOLCSI_E2E_FOCUS, _REPORT, _BUDGET, _PROCS, _RERUN, _CHUNKS,
// _SPECS); POOLCSI_E2E_SKIP adds a ginkgo skip regexp. Exit status 1 when a spec failed
// or a prerequisite is missing, 2 on a bad flag or the timeout.
package main

import (
	"flag"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/cluster"
	"github.com/poolcsi/poolcsi/test/k8s/e2e"
)

func main() {
	env := os.Getenv
	focus := flag.String("focus", env("POOLCSI_E2E_FOCUS"), "ginkgo regexp of the specs to run (\"\": a quick check of the suite, e2e.CIFocus)")
	report := flag.String("report", env("POOLCSI_E2E_REPORT"), "the conformance run: write the per-spec results to this Markdown file (make conformance: docs/conformance.md)")
	budget := flag.String("budget", env("POOLCSI_E2E_BUDGET"), "with -report: start no chunk after this long (default 5h)")
	procs := flag.String("procs", env("POOLCSI_E2E_PROCS"), "with -report: ginkgo processes per chunk (default 3)")
	rerun := flag.String("rerun", env("POOLCSI_E2E_RERUN"), "with -report: run chunks that have results again (\"failed\": those with a failure)")
	chunks := flag.String("chunks", env("POOLCSI_E2E_CHUNKS"), "with -report: a regexp; only the chunks it matches run")
	specs := flag.String("specs", env("POOLCSI_E2E_SPECS"), "with -report: a regexp; only the specs it matches run")
	timeout := flag.Duration("timeout", 0, "stop the program after this long, as go test -timeout does (0: none)")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "conformance: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	cfg := e2e.Config{Focus: *focus, Report: *report}
	if cfg.Report != "" {
		// Checked before any cluster starts.
		var err error
		if cfg.Opts, err = e2e.ParseOptions(*budget, *procs, *rerun, *chunks, *specs); err != nil {
			fmt.Fprintf(os.Stderr, "conformance: %v\n", err)
			os.Exit(2)
		}
	}
	if *timeout > 0 {
		// go test's -timeout ends the process as this does: no cleanup runs, and the next
		// environment reclaims what this one left (cluster.LockKubeletEnv).
		time.AfterFunc(*timeout, func() {
			fmt.Fprintf(os.Stderr, "conformance: timed out after %s\n", *timeout)
			os.Exit(2)
		})
	}
	failed, skipped := cluster.RunProgram("conformance", os.Stdout, func(t testing.TB) { e2e.Storage(t, cfg) })
	switch {
	case failed:
		fmt.Println("conformance: FAIL")
		os.Exit(1)
	case skipped:
		fmt.Println("conformance: nothing ran: a prerequisite is missing (above)")
		os.Exit(1)
	}
	fmt.Println("conformance: ok")
}
