package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The conformance bookkeeping needs no cluster: results merge by spec name, a chunk is
// done only when each of its specs has a result, and the report lists what has not run.
func TestConformanceResults(t *testing.T) {
	const (
		a = "External Storage [Driver: d] [Testpattern: p] volumes should store data"
		b = "External Storage [Driver: d] [Testpattern: p] provisioning should provision storage with any volume data source [Serial]"
		c = "External Storage [Driver: d] [Testpattern: q] volumes should allow exec"
		d = "External Storage [Driver: d] [Testpattern: p] volume-expand should resize volume"
	)
	if got := chunkOf.FindString(a); got != "External Storage [Driver: d] [Testpattern: p]" {
		t.Fatalf("chunk of %q = %q", a, got)
	}
	r := conformanceResults{}
	r.merge(&e2eResults{
		passed: []specResult{{name: a}},
		failed: []specResult{{name: b, message: "timed out\nwaiting"}},
	}, time.Date(2026, 11, 23, 0, 0, 0, 0, time.UTC), 2)
	if !r.hasAll([]string{a, b}) || r.hasAll([]string{a, c}) {
		t.Fatalf("hasAll wrong: %v", r)
	}
	md := r.markdown([]string{a, b, c})
	for _, want := range []string{
		"3 specs: 1 passed, 1 failed, 0 skipped, 1 not run yet.",
		"- " + b + " — timed out waiting **Cause (this machine):**",
		"## Not run yet (1)\n\n- " + c,
		"(2026-11-23, 2 nodes)",
		"Ran on two nodes: 2 specs; on one node: 0.",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	r[d] = specRecord{Result: "failed", Reason: "pool has no room"}
	for _, tc := range []struct {
		names []string
		rerun string
		want  bool
	}{
		{[]string{a}, "", false},
		{[]string{a, c}, "", true},
		{[]string{a}, "failed", false},
		{[]string{a, b}, "failed", false}, // b's failure is this machine's
		{[]string{a, b, d}, "failed", true},
		{[]string{a}, "1", true},
	} {
		if got := r.due(tc.names, tc.rerun); got != tc.want {
			t.Errorf("due(%v, %q) = %t, want %t", tc.names, tc.rerun, got, tc.want)
		}
	}
	hostExec := "External Storage [Driver: d] [Testpattern: p] volumeMode should not mount / map unused volumes in a pod [LinuxOnly]"
	r.merge(&e2eResults{failed: []specResult{{name: hostExec, message: "error checking directory /var/lib/kubelet/pods/x/volumes on node vm: command terminated with exit code 1"}}}, time.Now(), 2)
	if md := r.markdown([]string{hostExec}); !strings.Contains(md, "**Cause (this machine):** the spec checks the node through the suite's host-exec pod") {
		t.Errorf("a host-exec failure is not explained:\n%s", md)
	}
	dirRestore := "External Storage [Driver: poolcsi.io] [Layout: dir] [Testpattern: Dynamic PV (default fs)] provisioning should provision correct filesystem size when restoring snapshot to larger size pvc"
	if c := outsideCauses(dirRestore, "Filesystem resize failed when restoring from snapshot to PVC with larger size. Restored fs size: 4294967296 bytes is not larger than origin fs size: 4294967296 bytes."); len(c) != 1 {
		t.Errorf("the dir volume restore spec has causes %q, want btrfs's statfs", c)
	}
	preSnap := "External Storage [Driver: local.poolcsi.io] [Testpattern: Pre-provisioned Snapshot (delete policy)] snapshottable [Feature:VolumeSnapshotDataSource] volume snapshot controller should check snapshot fields"
	// poolcsi labels pre-provisioned local contents for their node (--claim-local-snapshots):
	// such a failure is the driver's again.
	if c := outsideCauses(preSnap, "VolumeSnapshot pre-provisioned-snapshot-x is not ready within 5m0s"); len(c) != 0 {
		t.Errorf("a local pre-provisioned snapshot's failure is put down to %q", c)
	}
	if c := outsideCauses(strings.Replace(dirRestore, " [Layout: dir]", "", 1), "Restored fs size: 1 bytes is not larger than origin fs size: 1 bytes."); len(c) != 0 {
		t.Errorf("an image volume's restore failure is put down to this machine: %q", c)
	}
	// A result of before the nodes were counted ran on one.
	r[c] = specRecord{Result: "passed", Date: "2026-11-20"}
	if md := r.markdown([]string{a, c}); !strings.Contains(md, c+" (2026-11-20, 1 node)") || !strings.Contains(md, "Ran on two nodes: 1 specs; on one node: 1.") {
		t.Errorf("an old result is not marked as one node's:\n%s", md)
	}
	delete(r, c)
	delete(r, hostExec)
	r.merge(&e2eResults{passed: []specResult{{name: b}}}, time.Now(), 2)
	if r[b].Result != "passed" {
		t.Errorf("a later result does not replace an earlier one: %v", r[b])
	}
}

// junitSample has the shape of e2e.test v1.36.3's JUnit report (ginkgo v2): every spec of
// the suite is listed, with its node type in front and its labels behind; the specs the
// focus left out are "skipped" without a reason, a spec skipped at run time says why.
const junitSample = `<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="4" disabled="0" errors="0" failures="1" time="90">
  <testsuite name="Kubernetes e2e suite" package="/" tests="4" disabled="0" skipped="2" errors="0" failures="1" time="90">
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="1"></testcase>
    <testcase name="[It] External Storage [Driver: d] [Testpattern: p] volumes should store data" classname="Kubernetes e2e suite" status="passed" time="40"></testcase>
    <testcase name="[It] External Storage [Driver: d] [Testpattern: p] provisioning should provision storage with mount options" classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped - Driver &#34;d&#34; does not define supported mount option"></skipped>
    </testcase>
    <testcase name="[It] External Storage [Driver: d] [Testpattern: p] volumes should allow exec of files on the volume [Serial] [Serial]" classname="Kubernetes e2e suite" status="failed" time="50">
      <failure message="timed out" type="failed">pod not running</failure>
    </testcase>
    <testcase name="[It] External Storage [Driver: d] [Testpattern: q] volumes should store data" classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped"></skipped>
    </testcase>
  </testsuite>
</testsuites>`

func TestReadJUnitChunk(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j.xml")
	if err := os.WriteFile(path, []byte(junitSample), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := readJUnit(path)
	if err != nil {
		t.Fatal(err)
	}
	const (
		store = "External Storage [Driver: d] [Testpattern: p] volumes should store data"
		opts  = "External Storage [Driver: d] [Testpattern: p] provisioning should provision storage with mount options"
		exec  = "External Storage [Driver: d] [Testpattern: p] volumes should allow exec of files on the volume [Serial] [Serial]"
	)
	if c := chunkOf.FindString(store); c != "External Storage [Driver: d] [Testpattern: p]" {
		t.Fatalf("chunk of %q = %q", store, c)
	}
	// A driver definition's TestTags follow its name (shared-dir.yaml: "[Layout: dir]").
	tagged := "External Storage [Driver: d] [Layout: dir] [Testpattern: p] volumes should store data"
	if c := chunkOf.FindString(tagged); c != "External Storage [Driver: d] [Layout: dir] [Testpattern: p]" {
		t.Fatalf("chunk of %q = %q", tagged, c)
	}
	for _, reason := range []string{
		`Driver "local.poolcsi.io" does not support volume expansion - skipping`,
		`Driver "poolcsi.io" does not support volume expansion - skipping`,
	} {
		if g := skipGist(reason); g != `Driver … does not support volume expansion - skipping` {
			t.Errorf("skipGist(%q) = %q", reason, g)
		}
	}
	if !serialSpec.MatchString(exec) || serialSpec.MatchString(store) {
		t.Fatal("serialSpec does not tell [Serial] specs apart")
	}
	// The chunk's specs (the names a dry run listed) are what a chunk's run records: the
	// pattern-q spec the focus left out must not count as run.
	got := res.only([]string{store, opts, exec})
	if len(got.passed) != 1 || got.passed[0].name != store ||
		len(got.skipped) != 1 || got.skipped[0].name != opts ||
		len(got.failed) != 1 || got.failed[0].name != exec {
		t.Fatalf("chunk results = %+v", got)
	}
	r := conformanceResults{}
	r.merge(got, time.Date(2026, 11, 23, 0, 0, 0, 0, time.UTC), 2)
	if reason := r[opts].Reason; reason != `Driver "d" does not define supported mount option` {
		t.Errorf("skip reason = %q", reason)
	}
	if r.hasAll([]string{"External Storage [Driver: d] [Testpattern: q] volumes should store data"}) {
		t.Error("a spec the focus left out is recorded as run")
	}
}

// make conformance's knobs are read, and refused, before any cluster starts.
func TestConformanceOpts(t *testing.T) {
	for _, tc := range []struct {
		budget, procs, chunks string
		ok                    bool
	}{
		{"", "", "", true}, {"2h", "1", "", true}, {"soon", "", "", false}, {"", "0", "", false}, {"", "three", "", false},
		{"", "", `local\.poolcsi\.io.*Snapshot`, true}, {"", "", "Snapshot(", false},
	} {
		t.Setenv("POOLCSI_E2E_BUDGET", tc.budget)
		t.Setenv("POOLCSI_E2E_PROCS", tc.procs)
		t.Setenv("POOLCSI_E2E_CHUNKS", tc.chunks)
		o, err := conformanceOptsFromEnv()
		if (err == nil) != tc.ok {
			t.Errorf("budget %q procs %q chunks %q: %+v, %v", tc.budget, tc.procs, tc.chunks, o, err)
		}
	}
	t.Setenv("POOLCSI_E2E_BUDGET", "")
	t.Setenv("POOLCSI_E2E_PROCS", "")
	t.Setenv("POOLCSI_E2E_CHUNKS", "")
	if o, _ := conformanceOptsFromEnv(); o.budget != 5*time.Hour || o.procs != 3 || o.chunks != nil || o.specs != nil {
		t.Errorf("defaults = %+v", o)
	}
	t.Setenv("POOLCSI_E2E_SPECS", "on different node(")
	if _, err := conformanceOptsFromEnv(); err == nil {
		t.Error("a bad POOLCSI_E2E_SPECS is accepted")
	}
	t.Setenv("POOLCSI_E2E_SPECS", "different node|topology")
	o, err := conformanceOptsFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	const (
		moved = "External Storage [Driver: d] [Testpattern: p] multiVolume [Slow] should access to two volumes with the same volume mode and retain data across pod recreation on different node [Slow]"
		same  = "External Storage [Driver: d] [Testpattern: p] multiVolume [Slow] should access to two volumes with the same volume mode and retain data across pod recreation on the same node [Slow]"
	)
	if got := o.pick([]string{moved, same}); len(got) != 1 || got[0] != moved {
		t.Errorf("POOLCSI_E2E_SPECS picked %q", got)
	}
}
