package fsx

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// BenchmarkWriteLedger times the three ways a small pool file is replaced,
// side by side in every iteration (the order rotating), in the temp directory
// (a pool's filesystem in the tests): a record (WriteFileAtomic durable: the
// temp file's fsync and the directory's), a record whose directory a later
// fsync covers (the temp file's fsync only), and a derived file
// (WriteDerivedFile: none). It reports each one's median in µs: what a
// create's or a delete's ledger write cost before and after it stopped being
// fsynced is the second against the third.
func BenchmarkWriteLedger(b *testing.B) {
	root := b.TempDir()
	if err := os.Mkdir(filepath.Join(root, "d"), 0o700); err != nil {
		b.Fatal(err)
	}
	data := make([]byte, 300) // a ledger's size
	ways := []struct {
		name  string
		write func() error
		times []time.Duration
	}{
		{name: "durable", write: func() error { return WriteFileAtomic(root, "d/ledger.json", data, true) }},
		{name: "file-fsync", write: func() error { return WriteFileAtomic(root, "d/ledger.json", data, false) }},
		{name: "derived", write: func() error { return WriteDerivedFile(root, "d/ledger.json", data) }},
	}
	for i := 0; b.Loop(); i++ {
		for k := range ways {
			w := &ways[(i+k)%len(ways)]
			t0 := time.Now()
			if err := w.write(); err != nil {
				b.Fatal(err)
			}
			w.times = append(w.times, time.Since(t0))
		}
	}
	for _, w := range ways {
		s := slices.Clone(w.times)
		slices.Sort(s)
		b.ReportMetric(float64(s[len(s)/2].Nanoseconds())/1000, w.name+"-µs")
	}
}
