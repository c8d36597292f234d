package mount

import (
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkSysAttr reads a loop device's sysfs attribute with os.ReadFile and
// with readSys side by side: every loop scan reads two for each bound device,
// and a stage and an unstage a few more.
//
//	POOLCSI_UNIT_ONLY=1 go test ./internal/mount -run '^$' -bench SysAttr -benchtime 2000x -count 3
func BenchmarkSysAttr(b *testing.B) {
	p := filepath.Join(sysBlock, "loop0", "size")
	if _, err := os.Stat(p); err != nil {
		b.Fatalf("this benchmark reads %s: %v", p, err)
	}
	b.Run("os.ReadFile", func(b *testing.B) {
		for b.Loop() {
			if _, err := os.ReadFile(p); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("readSys", func(b *testing.B) {
		for b.Loop() {
			if _, err := readSys(p); err != nil {
				b.Fatal(err)
			}
		}
	})
}
