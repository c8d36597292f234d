package mount

import (
	"os"
	"path/filepath"
	"testing"
)

// TestExt4Errors reads a fake sysfs: ext4 errors cannot be caused on demand
// without corrupting a filesystem.
func TestExt4Errors(t *testing.T) {
	old := sysFSExt4
	sysFSExt4 = t.TempDir()
	t.Cleanup(func() { sysFSExt4 = old })
	dir := filepath.Join(sysFSExt4, "loop7")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, count, first string
		want               int64
		wantFirst          string
		wantErr            bool
	}{
		{"no errors", "0\n", "", 0, "", false},
		{"errors", "3\n", "ext4_lookup\n", 3, "ext4_lookup", false},
		{"errors, first unknown", "3\n", "", 3, "", false},
		{"garbage", "x\n", "", 0, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := os.WriteFile(filepath.Join(dir, "errors_count"), []byte(tc.count), 0o644); err != nil {
				t.Fatal(err)
			}
			os.Remove(filepath.Join(dir, "first_error_func"))
			if tc.first != "" {
				if err := os.WriteFile(filepath.Join(dir, "first_error_func"), []byte(tc.first), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			n, first, err := Filesystems{}.Ext4Errors("/dev/loop7")
			if (err != nil) != tc.wantErr || n != tc.want || first != tc.wantFirst {
				t.Errorf("got %d %q %v, want %d %q error=%v", n, first, err, tc.want, tc.wantFirst, tc.wantErr)
			}
		})
	}
	if _, _, err := (Filesystems{}).Ext4Errors("/dev/loop8"); err == nil {
		t.Error("a device without ext4 attributes reported errors")
	}
}
