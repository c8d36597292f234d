package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/poolcsi/poolcsi/internal/report"
)

const statusSynopsis = `status [--endpoint unix:///path/csi.sock] [--timeout D] [-o text|json]

Shows what the driver on a CSI socket answers, for an operator on a node: the
plugin (GetPluginInfo, its capabilities, Probe), the node (NodeGetInfo, its
capabilities, the pools' health as the node sees them), each pool's capacity
(GetCapacity) and every volume (ListVolumes, all pages: size, pool and layout,
where it can be used and whom it is published to, its health), abnormal volumes
last, then the problems and a summary line. It makes only calls that change
nothing, through the socket alone, so it works on a controller's socket, a node
plugin's or an all-in-one one, and says what a socket does not serve.

Exit status: 0 all is well; 1 the socket cannot be reached (or a flag is wrong);
2 the driver answers and something is abnormal (listed under "problems").`

// errAbnormal makes `status` exit 2 without a second message: what is
// abnormal was printed.
var errAbnormal = errors.New("something is abnormal")

// The listing caps and page size status passes to report.Gather
// (report.Options). Variables for the tests.
var (
	statusPageSize   int32 = report.DefaultPageSize
	statusMaxPages         = report.DefaultMaxPages
	statusMaxEntries       = report.DefaultMaxEntries
	statusMaxBytes         = report.DefaultMaxBytes
)

func statusCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", statusSynopsis, stderr)
	endpoint := fs.String("endpoint", "unix:///csi/csi.sock", "the driver's CSI socket")
	timeout := fs.Duration("timeout", report.DefaultTimeout, "how long each call may take")
	output := fs.String("o", "text", "output format: text or json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *output != "text" && *output != "json" {
		return fmt.Errorf("status: -o %q: want text or json", *output)
	}
	conn, err := grpc.NewClient(*endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	defer func() { _ = conn.Close() }()
	r, err := report.Gather(ctx, conn, *endpoint, report.Options{Timeout: *timeout, PageSize: statusPageSize,
		MaxPages: statusMaxPages, MaxEntries: statusMaxEntries, MaxBytes: statusMaxBytes})
	if err != nil {
		return fmt.Errorf("status: %w (is the driver running, and is this its --endpoint? The chart's containers serve unix:///csi/csi.sock)", err)
	}
	if *output == "json" {
		err = report.WriteJSON(stdout, r)
	} else {
		err = report.WriteText(stdout, r)
	}
	if err != nil {
		return err
	}
	if len(r.Problems) > 0 {
		return errAbnormal
	}
	return nil
}
