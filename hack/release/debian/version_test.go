package debian

import "testing"

func TestCompareVersions(t *testing.T) {
	for _, c := range []struct {
		a, b string
		want int
	}{
		{"2.36-9+deb12u14", "2.36-9+deb12u7", 1}, // a point release past the security suite
		{"2.36-9+deb12u7", "2.36-9+deb12u7", 0},
		{"1:2.5.1-4", "2.6-1", 1},            // the epoch first
		{"1.0~rc1-1", "1.0-1", -1},           // ~ before the end
		{"252.38-1~deb12u1", "252.38-1", -1}, // and in the revision
		{"1.47.0-2+b2", "1.47.0-2", 1},       // a binNMU
		{"6.2-1+deb12u2", "6.2-1+deb12u10", -1},
		{"1.02.185-2", "1.02.185-2", 0},
		{"10", "9", 1},
		{"1.0a", "1.0", 1},
		{"1.0", "1.0+", -1},
	} {
		if got := CompareVersions(c.a, c.b); got != c.want {
			t.Errorf("CompareVersions(%q, %q) = %d, want %d", c.a, c.b, got, c.want)
		}
		if got := CompareVersions(c.b, c.a); got != -c.want {
			t.Errorf("CompareVersions(%q, %q) = %d, want %d", c.b, c.a, got, -c.want)
		}
	}
}
