package driver

import (
	"context"
	"time"

	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// logCalls logs every RPC with secrets stripped: requests carry StorageClass and
// node-stage secrets, which must never reach a log.
func logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	logger := klog.FromContext(ctx).WithValues("method", info.FullMethod)
	if klog.V(4).Enabled() || info.FullMethod != "/csi.v1.Identity/Probe" {
		logger.V(3).Info("GRPC call", "request", protosanitizer.StripSecrets(req))
	}
	resp, err := handler(klog.NewContext(ctx, logger), req)
	if err != nil {
		logger.Error(err, "GRPC error", "code", status.Code(err).String(), "duration", time.Since(start))
	} else {
		logger.V(5).Info("GRPC response", "response", protosanitizer.StripSecrets(resp), "duration", time.Since(start))
	}
	return resp, err
}
