package rpc

import (
	"context"
	"runtime/debug"
	"time"

	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// logCalls logs every RPC with secrets stripped: requests carry StorageClass and
// node-stage secrets, which must never reach a log. The context logger it hands
// on carries the method and what the request names (requestIDs), so every line
// of the call says which volume it is about.
func logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	logger := klog.FromContext(ctx).WithValues(append([]any{"method", info.FullMethod}, requestIDs(req)...)...)
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

// maxLoggedID bounds an ID on a log line: IDs come from the caller, and one
// the handler will refuse may be of any length.
const maxLoggedID = 256

// requestIDs are the key/value pairs of what req names, for every log line of
// its call: the volume ("volume", as the handlers log it), the snapshot, the
// group snapshot, and for the calls that create one, its name. The keys are
// those the handlers use, so a handler's own value replaces the same one
// rather than repeating it. Only these fields are read: a request's secrets
// and parameters never reach a log through here.
func requestIDs(req any) []any {
	var kv []any
	add := func(key, id string) {
		if id == "" {
			return
		}
		if len(id) > maxLoggedID {
			id = id[:maxLoggedID] + "…"
		}
		kv = append(kv, key, id)
	}
	if r, ok := req.(interface{ GetVolumeId() string }); ok {
		add("volume", r.GetVolumeId())
	}
	if r, ok := req.(interface{ GetSourceVolumeId() string }); ok { // CreateSnapshot
		add("volume", r.GetSourceVolumeId())
	}
	if r, ok := req.(interface{ GetSnapshotId() string }); ok {
		add("snapshot", r.GetSnapshotId())
	}
	if r, ok := req.(interface{ GetGroupSnapshotId() string }); ok {
		add("groupSnapshot", r.GetGroupSnapshotId())
	}
	if r, ok := req.(interface{ GetName() string }); ok { // CreateVolume, CreateSnapshot, CreateVolumeGroupSnapshot
		add("name", r.GetName())
	}
	return kv
}

// recoverPanics turns a handler's panic into an Internal error for that call
// alone, logged with its stack, instead of the end of the process and of every
// call under way. What the handler held (a volume's guard) stays as the panic
// left it: a later call on that volume may be told it is busy, which the log
// explains.
func recoverPanics(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			klog.FromContext(ctx).Error(nil, "GRPC handler panicked: a bug; the call fails, the server goes on", "panic", p, "stack", string(debug.Stack()))
			resp, err = nil, status.Errorf(codes.Internal, "%s: internal error: the driver panicked (a bug; its log has the stack)", info.FullMethod)
		}
	}()
	return handler(ctx, req)
}
