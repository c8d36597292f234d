package fsx

import (
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkReadRecord times a volume.json read below a pool's root (in the
// temp directory, three levels down as a record is) two ways: ReadFile, which
// opens the root for the one read, as every record read of a request does,
// and through a Tree opened once. Their difference is what opening the root
// costs a read: what one Tree per request would save per record read or write.
func BenchmarkReadRecord(b *testing.B) {
	root := filepath.Join(b.TempDir(), "pool")
	rel := "volumes/key/volume.json"
	if err := os.MkdirAll(filepath.Join(root, filepath.Dir(rel)), 0o700); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, rel), make([]byte, 900), 0o600); err != nil {
		b.Fatal(err)
	}
	b.Run("root-per-read", func(b *testing.B) {
		for b.Loop() {
			if _, err := ReadFile(root, rel, 1<<20); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("tree", func(b *testing.B) {
		t, err := OpenTree(root)
		if err != nil {
			b.Fatal(err)
		}
		defer t.Close()
		for b.Loop() {
			if _, err := t.ReadFile(rel, 1<<20); err != nil {
				b.Fatal(err)
			}
		}
	})
}
