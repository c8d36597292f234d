package health

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func TestOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		o  Options
		ok bool
	}{
		{DefaultOptions, true},
		{Options{PoolFullThreshold: 1, VolumeFullThreshold: 0.5}, true},
		{Options{PoolFullThreshold: 0, VolumeFullThreshold: 0.5}, false},
		{Options{PoolFullThreshold: 0.9, VolumeFullThreshold: 1.5}, false},
	} {
		if err := tc.o.Validate(); (err == nil) != tc.ok {
			t.Errorf("%+v: err %v, want ok=%v", tc.o, err, tc.ok)
		}
	}
}

func TestCheckVolume(t *testing.T) {
	p, err := pool.Open(pool.Config{Name: "t", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	v, err := p.Reserve(context.Background(), pool.Spec{Name: "v", Layout: pool.LayoutImage, AccessType: pool.AccessBlock, CapacityBytes: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Images().Prepare(v); err != nil {
		t.Fatal(err)
	}
	if err := p.MarkReady(v); err != nil {
		t.Fatal(err)
	}
	id, _ := pool.ParseVolumeID(v.ID)
	image := p.ImagePath(id)
	reasons := func() string {
		scan, err := ScanPool(p, Options{PoolFullThreshold: 1, VolumeFullThreshold: 1})
		if err != nil || len(scan.Volumes) != 1 {
			t.Fatalf("scan: %v %v", scan, err)
		}
		var r []string
		for _, i := range scan.Volumes[0].Issues {
			r = append(r, i.Reason)
		}
		return strings.Join(r, ",")
	}
	steps := []struct {
		name  string
		do    func() error
		wants string
	}{
		{"healthy", func() error { return nil }, ""},
		{"truncated", func() error { return os.Truncate(image, 4<<20) }, ReasonImageTruncated},
		{"regrown", func() error { return os.Truncate(image, 8<<20) }, ""},
		{"missing", func() error { return os.Rename(image, image+".x") }, ReasonImageMissing},
		{"restored", func() error { return os.Rename(image+".x", image) }, ""},
		{"damaged", func() error { return os.WriteFile(filepath.Join(p.Dir(id), "volume.json"), []byte("{"), 0o640) }, ReasonMetadataUnreadable},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if got := reasons(); got != s.wants {
			t.Errorf("%s: issues %q, want %q", s.name, got, s.wants)
		}
	}
}

// TestCheckVolumeDeletedMeanwhile: a volume read, and then deleted (its
// directory renamed away, as DeleteVolume does, maybe on another node) before
// its image is looked at, is gone, not data loss.
func TestCheckVolumeDeletedMeanwhile(t *testing.T) {
	p, err := pool.Open(pool.Config{Name: "t", Path: filepath.Join(t.TempDir(), "pool")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	v, err := p.Reserve(ctx, pool.Spec{Name: "v", Layout: pool.LayoutImage, AccessType: pool.AccessBlock, CapacityBytes: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Images().Prepare(v); err != nil {
		t.Fatal(err)
	}
	if err := p.MarkReady(v); err != nil {
		t.Fatal(err)
	}
	entries, err := p.List()
	if err != nil || len(entries) != 1 {
		t.Fatalf("List: %v %v", entries, err)
	}
	id, _ := pool.ParseVolumeID(v.ID)
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	r := CheckVolume(p, entries[0], StatPool(p), DefaultOptions)
	if !r.Gone || len(r.Issues) != 0 {
		t.Fatalf("a volume deleted while checked: %+v, want gone without issues", r)
	}
}
