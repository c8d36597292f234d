// Command livenessprobe is a stand-in for the kubernetes-csi livenessprobe
// sidecar, used by the tests because the module proxy this project builds from
// refuses github.com/kubernetes-csi/livenessprobe ("403 Forbidden: This module
// version is not available"), so the real one cannot be built here.
//
// It does what the real sidecar's /healthz handler does, with the same
// csi-lib-utils call: for every request it dials the CSI socket with the probe
// timeout, calls Probe (rpc.Probe), and answers 500 with the error text when the
// call fails, 500 "driver responded but is not ready" when ready is false, and
// 200 "ok" otherwise. At start-up it asks the driver's name (rpc.GetDriverName)
// and exits if it cannot. Flags: --csi-address, --http-endpoint (or
// --health-port), --probe-timeout, as upstream.
package main

import (
	"context"
	"flag"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
)

var (
	csiAddress   = flag.String("csi-address", "/run/csi/socket", "address of the CSI driver socket")
	healthPort   = flag.String("health-port", "9808", "TCP port for /healthz when --http-endpoint is not set")
	httpEndpoint = flag.String("http-endpoint", "", "host:port for /healthz")
	probeTimeout = flag.Duration("probe-timeout", time.Second, "timeout of one Probe call")
)

func dial() (*grpc.ClientConn, error) {
	addr := *csiAddress
	if !strings.HasPrefix(addr, "unix://") {
		addr = "unix://" + addr
	}
	return grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

func healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), *probeTimeout)
	defer cancel()
	conn, err := dial()
	if err != nil {
		w.WriteHeader(http.StatusInternalServerError)
		w.Write([]byte(err.Error()))
		return
	}
	defer conn.Close()
	ready, err := rpc.Probe(ctx, conn)
	switch {
	case err != nil:
		w.WriteHeader(http.StatusInternalServerError)
		w.Write([]byte(err.Error()))
		klog.ErrorS(err, "Health check failed")
	case !ready:
		w.WriteHeader(http.StatusInternalServerError)
		w.Write([]byte("driver responded but is not ready"))
	default:
		w.WriteHeader(http.StatusOK)
		w.Write([]byte("ok"))
	}
}

func main() {
	klog.InitFlags(nil)
	flag.Parse()
	conn, err := dial()
	if err != nil {
		klog.ErrorS(err, "Cannot connect to the CSI driver")
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	name, err := rpc.GetDriverName(ctx, conn)
	cancel()
	conn.Close()
	if err != nil {
		klog.ErrorS(err, "Cannot get the CSI driver name")
		os.Exit(1)
	}
	klog.InfoS("CSI driver name", "driver", name)
	addr := *httpEndpoint
	if addr == "" {
		addr = net.JoinHostPort("0.0.0.0", *healthPort)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", healthz)
	klog.InfoS("ServeMux listening", "address", addr)
	if err := http.ListenAndServe(addr, mux); err != nil {
		klog.ErrorS(err, "HTTP server failed")
		os.Exit(1)
	}
}
