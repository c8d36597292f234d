package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"

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

Without --endpoint it asks unix:///csi/csi.sock (the chart's containers), then
unix:///run/poolcsi/csi.sock (make run), and shows the first that answers.

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

// statusEndpoints are the sockets status asks, in order, without --endpoint:
// the chart's containers' and make run's. A variable for the tests.
var statusEndpoints = []string{"unix:///csi/csi.sock", "unix:///run/poolcsi/csi.sock"}

func statusCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", statusSynopsis, stderr)
	endpoint := fs.String("endpoint", "", "the driver's CSI socket (default: the first of "+strings.Join(statusEndpoints, ", ")+" that answers)")
	timeout := fs.Duration("timeout", report.DefaultTimeout, "how long each call may take")
	output := fs.String("o", "text", "output format: text or json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *output != "text" && *output != "json" {
		return fmt.Errorf("status: -o %q: want text or json", *output)
	}
	opts := report.Options{Timeout: *timeout, PageSize: statusPageSize, MaxPages: statusMaxPages, MaxEntries: statusMaxEntries, MaxBytes: statusMaxBytes}
	var r *report.Report
	var err error
	if *endpoint != "" {
		r, err = gatherAt(ctx, *endpoint, opts)
		if err != nil {
			return fmt.Errorf("status: %w (is the driver running, and is this its --endpoint? The chart's containers serve unix:///csi/csi.sock)", err)
		}
	} else if r, err = gatherDefault(ctx, opts); err != nil {
		return err
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

// gatherAt asks the driver at endpoint.
func gatherAt(ctx context.Context, endpoint string, opts report.Options) (*report.Report, error) {
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer func() { _ = conn.Close() }()
	return report.Gather(ctx, conn, endpoint, opts)
}

// gatherDefault asks the first of statusEndpoints that answers, skipping the
// sockets that are not there; when none answers, the error says what each
// one did.
func gatherDefault(ctx context.Context, opts report.Options) (*report.Report, error) {
	var tried []string
	for _, ep := range statusEndpoints {
		if path, ok := strings.CutPrefix(ep, "unix://"); ok {
			if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
				tried = append(tried, ep+": no socket there")
				continue
			}
		}
		r, err := gatherAt(ctx, ep, opts)
		var unreachable *report.UnreachableError
		switch {
		case errors.As(err, &unreachable):
			tried = append(tried, ep+": "+unreachable.Reason)
		case err != nil:
			tried = append(tried, ep+": "+report.Printable(err.Error()))
		default:
			return r, nil
		}
	}
	return nil, fmt.Errorf("status: no driver answers on the default sockets (is the driver running? Name its socket with --endpoint):\n  %s",
		strings.Join(tried, "\n  "))
}
