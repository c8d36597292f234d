package ephemeral

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestSizeAttribute: the size attribute is a positive Kubernetes quantity no
// larger than the largest volume; anything else is refused before anything
// is made.
func TestSizeAttribute(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want int64
		code codes.Code
	}{
		{"1Gi", pool.GiB, codes.OK},
		{"500Mi", 500 * pool.MiB, codes.OK},
		{"1G", 1e9, codes.OK},
		{"0", 0, codes.InvalidArgument},
		{"-1Gi", 0, codes.InvalidArgument},
		{"lots", 0, codes.InvalidArgument},
		{"1Ei", 0, codes.OutOfRange},
		{string(make([]byte, 65)), 0, codes.InvalidArgument},
	} {
		got, err := parseEphemeralSize(tt.in)
		if code := status.Code(csierr.GRPCError(err)); got != tt.want || code != tt.code {
			t.Errorf("size=%q: %d, %v; want %d, %s", tt.in, got, err, tt.want, tt.code)
		}
	}
}

// TestRequested: only kubelet's marker makes a publish an inline volume's.
func TestRequested(t *testing.T) {
	if !Requested(map[string]string{ContextKey: "true"}) || Requested(map[string]string{ContextKey: "false"}) || Requested(nil) {
		t.Fatal("Requested does not follow the context key")
	}
}
