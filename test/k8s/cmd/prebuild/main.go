// Command prebuild builds the Kubernetes components the harness's tests run (tools.All)
// into the harness's cache, so that hack/test.sh can build them in the background while
// the driver's own suites run; the tests then find them built. What it has not built when
// the tests ask for a tool, the tests build (or wait for, by the cache's lock).
//
// With -e2e it also builds the storage e2e suite's binaries (tools.ForE2E).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

func main() {
	e2e := flag.Bool("e2e", false, "also build e2e.test, agnhost and ginkgo")
	sideBySide := flag.Bool("sidebyside", false, "also build local-path-provisioner (BenchmarkSideBySide)")
	check := flag.Bool("check", false, "build nothing: exit 1 naming the tools that are not built (hack/bench asks before it runs the cluster benchmark)")
	flag.Parse()
	list := tools.All
	if *e2e {
		list = append(append([]tools.Tool(nil), list...), tools.ForE2E...)
	}
	if *sideBySide {
		list = append(append([]tools.Tool(nil), list...), tools.LocalPath)
	}
	if *check {
		var missing []string
		for _, tl := range list {
			if !tl.Built() {
				missing = append(missing, tl.Name+" "+tl.Version)
			}
		}
		if len(missing) > 0 {
			fmt.Printf("prebuild: not built in %s: %s\n", tools.CacheDir(), strings.Join(missing, ", "))
			os.Exit(1)
		}
		fmt.Printf("prebuild: %d tools built (cache %s)\n", len(list), tools.CacheDir())
		return
	}
	// Stopped (hack/test.sh stops it when the suite ends early), it stops the build it is
	// running and removes that build's work directory.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	for _, tl := range list {
		bin, took, err := tl.Build(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, "prebuild:", err)
			stop()
			os.Exit(1)
		}
		if took > 0 {
			fmt.Printf("prebuild: built %-24s %-8s in %s\n", tl.Name, tl.Version, took.Round(time.Second))
		} else {
			fmt.Printf("prebuild: cached %-23s %-8s %s\n", tl.Name, tl.Version, bin)
		}
	}
	fmt.Printf("prebuild: %d tools ready in %s (cache %s)\n", len(list), time.Since(start).Round(time.Second), tools.CacheDir())
}
