package pool

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestGrow(t *testing.T) {
	const size = 64 * MiB
	for _, tc := range []struct {
		name      string
		fileSize  int64 // image size before Grow; 0 means as recorded
		grow      int64
		limit     int64
		want      int64 // recorded (and file) size after
		wantErr   error
		wantImage int64
	}{
		{name: "grows", grow: 2 * size, want: 2 * size, wantImage: 2 * size},
		{name: "same size", grow: size, want: size, wantImage: size},
		{name: "never shrinks", grow: size / 2, want: size, wantImage: size},
		// A crash after the truncate and before the record: the larger file is
		// adopted, never cut back.
		{name: "adopts interrupted growth", fileSize: 3 * size, grow: 2 * size, want: 3 * size, wantImage: 3 * size},
		{name: "interrupted growth above limit", fileSize: 3 * size, grow: 2 * size, limit: 2 * size, want: size, wantErr: ErrOutOfRange, wantImage: 3 * size},
		{name: "truncated image", fileSize: size / 2, grow: 2 * size, want: size, wantErr: ErrCorrupt, wantImage: size / 2},
		{name: "pool too small", grow: MaxCapacity, want: size, wantErr: ErrNoSpace, wantImage: size},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Open(Config{Name: "test", Path: filepath.Join(t.TempDir(), "pool")})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			v, err := p.Reserve(ctx, Spec{Name: "v", Layout: LayoutImage, AccessType: AccessBlock, CapacityBytes: size})
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Images().Prepare(v); err != nil {
				t.Fatal(err)
			}
			if err := p.MarkReady(v); err != nil {
				t.Fatal(err)
			}
			id, _ := ParseVolumeID(v.ID)
			if tc.fileSize != 0 {
				if err := os.Truncate(p.ImagePath(id), tc.fileSize); err != nil {
					t.Fatal(err)
				}
			}
			got, err := p.Grow(ctx, id, tc.grow, tc.limit, nil)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Grow = %v, want %v", err, tc.wantErr)
			}
			if err == nil && got.CapacityBytes != tc.want {
				t.Errorf("Grow returned capacity %d, want %d", got.CapacityBytes, tc.want)
			}
			loaded, err := p.Load(id)
			if err != nil || loaded.CapacityBytes != tc.want {
				t.Errorf("recorded capacity %v (%v), want %d", loaded, err, tc.want)
			}
			if fi, err := os.Stat(p.ImagePath(id)); err != nil || fi.Size() != tc.wantImage {
				t.Errorf("image %v (%v), want %d bytes", fi, err, tc.wantImage)
			}
		})
	}
}
