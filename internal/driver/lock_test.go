package driver

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/csierr"
)

func TestVolumeLocks(t *testing.T) {
	l := newVolumeLocks()
	release, err := l.acquire("v1", "NodeStageVolume")
	if err != nil {
		t.Fatal(err)
	}
	_, err = l.acquire("v1", "NodePublishVolume")
	err = csierr.GRPCError(err) // what the handler answers
	if status.Code(err) != codes.Aborted {
		t.Fatalf("second call on a busy volume = %v, want Aborted", err)
	}
	if msg := status.Convert(err).Message(); msg == "" || !strings.Contains(msg, "NodeStageVolume") {
		t.Errorf("message %q does not name the holder", msg)
	}
	other, err := l.acquire("v2", "NodeStageVolume")
	if err != nil {
		t.Fatalf("another volume must not wait: %v", err)
	}
	other()
	release()
	again, err := l.acquire("v1", "NodePublishVolume")
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	again()
}
