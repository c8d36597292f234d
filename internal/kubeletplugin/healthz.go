package kubeletplugin

import (
	"context"
	"net/http"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/status"
)

// Prober is the CSI Identity Probe, called in-process.
type Prober interface {
	Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error)
}

// Healthz answers /healthz as the livenessprobe sidecar does: 200 "ok" when
// Probe answers ready within timeout, 500 with Probe's error (or "not ready")
// otherwise.
func Healthz(p Prober, timeout time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		ctx, cancel := context.WithTimeout(req.Context(), timeout)
		defer cancel()
		resp, err := p.Probe(ctx, &csi.ProbeRequest{})
		switch {
		case err != nil:
			http.Error(w, status.Convert(err).Message(), http.StatusInternalServerError)
		case resp.GetReady() != nil && !resp.GetReady().GetValue():
			http.Error(w, "driver is not ready", http.StatusInternalServerError)
		default:
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("ok"))
		}
	})
}
