package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/report"
)

// The README's table of serve's flags is generated from serveOptions.AddFlags,
// so that it cannot drift from the binary. To regenerate it:
//
//	go test ./cmd/poolcsi -run TestREADMEFlags -update
var update = flag.Bool("update", false, "rewrite the README's generated parts")

const (
	readmePath      = "../../README.md"
	flagTableBegin  = "<!-- BEGIN serve flags: generated from cmd/poolcsi's serveOptions.AddFlags by `go test ./cmd/poolcsi -run TestREADMEFlags -update`; edit the flags' usage, not this table -->"
	flagTableEnd    = "<!-- END serve flags -->"
	regenerateHint  = "go test ./cmd/poolcsi -run TestREADMEFlags -update"
	flagTableHeader = "| flag | default | meaning |\n|---|---|---|\n"
)

// readmeDefaults are the defaults the README shows where the flag's own is
// computed at run time, empty, or clearer in words.
var readmeDefaults = map[string]string{
	"node-id":                   "host name",
	"pool":                      "`default=/var/lib/poolcsi/pools/default` when no pool is given",
	"kubelet-registration-path": "the `--endpoint` path",
	"metrics-address":           "off",
	"healthz-address":           "off",
	"registration-dir":          "off",
	"pvc-events-interval":       "`0` (off)",
	"leader-election-namespace": "none",
	"kubeconfig":                "the pod's service account",
	"share-key-file":            "none",
	"config":                    "none",
	"max-volumes-per-node":      "`0` (no limit)",
}

// flagTable is the Markdown table of serve's own flags, by name.
func flagTable() string {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	newServeOptions().AddFlags(fs)
	var b strings.Builder
	b.WriteString(flagTableHeader)
	fs.VisitAll(func(f *flag.Flag) {
		arg, usage := flag.UnquoteUsage(f)
		name := "--" + f.Name
		if strings.Contains(f.Usage, "`") {
			name += " " + arg // only an argument name the usage gives, not the type
		}
		def, ok := readmeDefaults[f.Name]
		if !ok {
			def = "`" + f.DefValue + "`"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", name, def, markdown(usage))
	})
	return b.String()
}

// docRef is a reference to a page of docs/ in a flag's usage.
var docRef = regexp.MustCompile(`(docs/[A-Za-z0-9_.-]+\.md)(#[A-Za-z0-9_-]+)?`)

// markdown makes a usage string a table cell: docs/ references become links,
// and what Markdown would take for a tag or a column is escaped.
func markdown(usage string) string {
	usage = strings.NewReplacer("|", `\|`, "<", "&lt;", ">", "&gt;").Replace(usage)
	return docRef.ReplaceAllString(usage, "[$1]($0)")
}

func TestREADMEFlags(t *testing.T) {
	raw, err := os.ReadFile(readmePath)
	if err != nil {
		t.Fatal(err)
	}
	readme := string(raw)
	begin := strings.Index(readme, flagTableBegin)
	end := strings.Index(readme, flagTableEnd)
	if begin < 0 || end < begin {
		t.Fatalf("README.md lacks the markers of the serve flag table:\n%s\n%s", flagTableBegin, flagTableEnd)
	}
	have := readme[begin+len(flagTableBegin) : end]
	want := "\n" + flagTable()
	if have == want {
		return
	}
	if *update {
		out := readme[:begin+len(flagTableBegin)] + want + readme[end:]
		if err := os.WriteFile(readmePath, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
		abs, _ := filepath.Abs(readmePath)
		t.Logf("rewrote the serve flag table of %s", abs)
		return
	}
	t.Errorf("README.md's serve flag table differs from serve's flags; regenerate it with\n\t%s\nhave:\n%s\nwant:\n%s", regenerateHint, have, want)
}

// Every default override names a real flag: a renamed flag fails here.
func TestREADMEDefaultsNameFlags(t *testing.T) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	newServeOptions().AddFlags(fs)
	for name := range readmeDefaults {
		if fs.Lookup(name) == nil {
			t.Errorf("readmeDefaults names --%s, which serve does not have", name)
		}
	}
}

const (
	statusSampleBegin = "<!-- BEGIN status sample: the output of a real driver, made by `go test ./cmd/poolcsi -run TestREADMEStatusSample -update`; do not edit -->"
	statusSampleEnd   = "<!-- END status sample -->"
)

// statusSample is what `poolcsi status` prints for an all-in-one driver after
// make run with two volumes, one of them cut short: gathered from a real
// driver, with what changes from run to run (the socket, the volume IDs, the
// free space, the pool's path, the version) set to fixed example values.
func statusSample(t *testing.T) string {
	t.Helper()
	endpoint := statusDriver(t, driver.ModeAll, "web", "broken-db")
	poolDir := filepath.Join(filepath.Dir(strings.TrimPrefix(endpoint, "unix://")), "pool")
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	r, err := report.Gather(context.Background(), conn, endpoint, report.Options{})
	if err != nil {
		t.Fatal(err)
	}
	r.Endpoint = "unix:///run/poolcsi/csi.sock"
	r.Plugin.Name, r.Plugin.Version = "poolcsi.io", "0.2.0"
	free := int64(55<<30 + 100<<20)
	for i := range r.Controller.Pools {
		r.Controller.Pools[i].AvailableBytes, r.Controller.Pools[i].MaximumVolumeBytes = free, &free
	}
	ids := map[bool]string{false: "local.69bebb91fc059941df09cd61eb8e966d", true: "local.ee3923587a07b739fb5c68258168a1b4"}
	for i := range r.Controller.Volumes {
		v := &r.Controller.Volumes[i]
		// The messages name the volume's directory by the ID's hex part.
		fixed := strings.NewReplacer(poolDir, "/var/lib/poolcsi/pools/local",
			strings.TrimPrefix(v.ID, "local."), strings.TrimPrefix(ids[v.Abnormal], "local."))
		v.ID = ids[v.Abnormal]
		for j := range v.Health {
			v.Health[j].Message = fixed.Replace(v.Health[j].Message)
		}
		v.Condition = fixed.Replace(v.Condition)
	}
	r.Finish()
	var b strings.Builder
	if err := report.WriteText(&b, r); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// The README's status sample is the output of a real driver.
func TestREADMEStatusSample(t *testing.T) {
	raw, err := os.ReadFile(readmePath)
	if err != nil {
		t.Fatal(err)
	}
	readme := string(raw)
	begin := strings.Index(readme, statusSampleBegin)
	end := strings.Index(readme, statusSampleEnd)
	if begin < 0 || end < begin {
		t.Fatalf("README.md lacks the markers of the status sample:\n%s\n%s", statusSampleBegin, statusSampleEnd)
	}
	have := readme[begin+len(statusSampleBegin) : end]
	want := "\n```\n" + statusSample(t) + "```\n"
	if have == want {
		return
	}
	if *update {
		out := readme[:begin+len(statusSampleBegin)] + want + readme[end:]
		if err := os.WriteFile(readmePath, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("rewrote the status sample of README.md")
		return
	}
	t.Errorf("README.md's status sample differs from status's output; regenerate it with\n\tgo test ./cmd/poolcsi -run TestREADMEStatusSample -update\nhave:\n%s\nwant:\n%s", have, want)
}
