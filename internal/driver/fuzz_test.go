package driver

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FuzzListTokens: any starting_token gets a page or ABORTED (or, for a
// negative max_entries, INVALID_ARGUMENT), never another error or a panic, and
// a page never repeats the token's own predecessor.
func FuzzListTokens(f *testing.F) {
	for _, s := range []string{"", "local.0123456789abcdef0123456789abcdef", "local@0123456789abcdef0123456789abcdef", "../x", "\x00", "zzz"} {
		f.Add(s, int32(1))
	}
	td := newTestDriver(f, testOpts{})
	for _, n := range []string{"a", "b", "c"} {
		if _, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
			Name: n, VolumeCapabilities: []*csi.VolumeCapability{blockCap(rwo)}, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		}); err != nil {
			f.Fatal(err)
		}
	}
	f.Fuzz(func(t *testing.T, token string, max int32) {
		ok := func(err error) bool {
			c := status.Code(err)
			return c == codes.OK || c == codes.Aborted || (max < 0 && c == codes.InvalidArgument)
		}
		resp, err := td.ListVolumes(context.Background(), &csi.ListVolumesRequest{StartingToken: token, MaxEntries: max})
		if !ok(err) {
			t.Fatalf("ListVolumes(%q, %d): %v", token, max, err)
		}
		for _, e := range resp.GetEntries() {
			if token != "" && e.GetVolume().GetVolumeId() < token {
				t.Fatalf("token %q: entry %s before it", token, e.GetVolume().GetVolumeId())
			}
		}
		if _, err := td.ListSnapshots(context.Background(), &csi.ListSnapshotsRequest{StartingToken: token, MaxEntries: max}); !ok(err) {
			t.Fatalf("ListSnapshots(%q, %d): %v", token, max, err)
		}
	})
}
