package driver

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// tree fingerprints everything under root (names, types, sizes, contents of
// small files), so a test can prove a refused call changed nothing on disk.
func tree(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(root, func(path string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(path)
		if err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s %v %d", strings.TrimPrefix(path, root), fi.Mode().Type(), fi.Size())
		if fi.Mode().IsRegular() && fi.Size() < 1<<16 && filepath.Base(path) != "lock" {
			raw, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			fmt.Fprintf(&b, " %x", sha256.Sum256(raw))
		}
		b.WriteByte('\n')
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestDeleteRefusesUnreadableMetadata(t *testing.T) {
	for _, tc := range []struct {
		name string
		meta func(old []byte) []byte
	}{
		{"garbage", func([]byte) []byte { return []byte("{not json") }},
		{"newer schema", func(old []byte) []byte {
			return []byte(strings.Replace(string(old), `"schemaVersion": 1`, `"schemaVersion": 99`, 1))
		}},
		{"negative capacity", func(old []byte) []byte {
			return []byte(strings.Replace(string(old), `"capacityBytes": 67108864`, `"capacityBytes": -16777216`, 1))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
			vid, _ := pool.ParseVolumeID(id)
			meta := td.pool.MetadataPath(vid)
			old, err := os.ReadFile(meta)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(meta, tc.meta(old), 0o600); err != nil {
				t.Fatal(err)
			}
			before := tree(t, td.pool.Path)
			_, err = td.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id})
			wantCode(t, err, codes.FailedPrecondition)
			if after := tree(t, td.pool.Path); after != before {
				t.Errorf("a refused delete changed the pool:\n%s\n---\n%s", before, after)
			}
			scan, err := td.ControllerGetVolumeHealth(context.Background(), &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
			if err != nil || len(scan.GetVolumeHealth().GetHealthStatuses()) == 0 {
				t.Errorf("damaged metadata is not reported abnormal: %v %v", scan, err)
			}
		})
	}
}

func TestHugeSizesAreOutOfRange(t *testing.T) {
	td := newTestDriver(t, testOpts{})
	before := tree(t, td.pool.Path)
	for _, size := range []int64{math.MaxInt64, math.MaxInt64 - 1<<20 + 2, pool.MaxCapacity + 1} {
		_, err := td.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
			Name: "huge", VolumeCapabilities: []*csi.VolumeCapability{mountCap(rwo, "ext4")},
			CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		})
		wantCode(t, err, codes.OutOfRange)
	}
	if after := tree(t, td.pool.Path); after != before {
		t.Errorf("a refused create changed the pool:\n%s\n---\n%s", before, after)
	}
	id := td.create(t, "v", mountCap(rwo, "ext4"), nil)
	before = tree(t, td.pool.Path)
	for _, size := range []int64{math.MaxInt64, pool.MaxCapacity + 1} {
		_, err := td.ControllerExpandVolume(context.Background(), &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: size}})
		wantCode(t, err, codes.OutOfRange)
	}
	if after := tree(t, td.pool.Path); after != before {
		t.Errorf("a refused expand changed the pool:\n%s\n---\n%s", before, after)
	}
}
