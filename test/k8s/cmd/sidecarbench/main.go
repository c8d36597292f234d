// Command sidecarbench measures what building the released CSI sidecars of one group
// (tools.SidecarGroup) together saves: it builds them from an empty Go build cache once
// each on its own, with the dependency versions its release pins, and once as the group,
// and prints both times and their ratio. The module cache is left as it is (downloads are
// not what it measures). It takes about as long as the two builds: tens of minutes on 2
// cores. Not part of make test.
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
	order := flag.String("order", "alone,group", "which builds to run, comma-separated, in order: alone (each sidecar on its own) and group")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var members []tools.Tool
	for _, tl := range tools.All {
		if tl.Group == tools.SidecarGroup {
			members = append(members, tl)
		}
	}
	took := map[string]time.Duration{}
	for _, mode := range strings.Split(*order, ",") {
		d, err := run(ctx, mode, members)
		if err != nil {
			fmt.Fprintln(os.Stderr, "sidecarbench:", err)
			os.Exit(1)
		}
		took[mode] = d
		fmt.Printf("sidecarbench: %-5s %d sidecars from an empty build cache: %s\n", mode, len(members), d.Round(time.Second))
	}
	if a, g := took["alone"], took["group"]; a > 0 && g > 0 {
		fmt.Printf("sidecarbench: group/alone = %.2f\n", g.Seconds()/a.Seconds())
	}
}

// run builds members in a fresh build cache and a fresh binary cache, each on its own
// (mode alone) or as their group (mode group).
func run(ctx context.Context, mode string, members []tools.Tool) (time.Duration, error) {
	dir, err := os.MkdirTemp("", "sidecarbench-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	for k, v := range map[string]string{"GOCACHE": dir + "/gocache", "POOLCSI_K8S_CACHE": dir + "/bin"} {
		if err := os.Setenv(k, v); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	for _, tl := range members {
		switch mode {
		case "alone":
			tl.Group = ""
		case "group":
		default:
			return 0, fmt.Errorf("unknown mode %q (alone or group)", mode)
		}
		if _, _, err := tl.Build(ctx); err != nil {
			return 0, err
		}
	}
	return time.Since(start), nil
}
