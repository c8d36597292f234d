package params

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func wantCode(t *testing.T, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v (%v), want %v", status.Code(err), err, code)
	}
}

func TestParseMutableParams(t *testing.T) {
	i := func(n int64) *int64 { return &n }
	yes, no := true, false
	tests := []struct {
		in   map[string]string
		want Mutable
		ok   bool
	}{
		{map[string]string{}, Mutable{}, true},
		{map[string]string{"readBytesPerSecond": "20Mi"}, Mutable{ReadBPS: i(20 << 20)}, true},
		{map[string]string{"writeBytesPerSecond": "1048576"}, Mutable{WriteBPS: i(1 << 20)}, true},
		{map[string]string{"writeBytesPerSecond": "1G"}, Mutable{WriteBPS: i(1e9)}, true},
		{map[string]string{"readBytesPerSecond": "0"}, Mutable{ReadBPS: i(0)}, true},
		{map[string]string{"readIOPS": "500", "writeIOPS": "0"}, Mutable{ReadIOPS: i(500), WriteIOPS: i(0)}, true},
		{map[string]string{"preallocate": "true"}, Mutable{Preallocate: &yes}, true},
		{map[string]string{"preallocate": "false"}, Mutable{Preallocate: &no}, true},
		{map[string]string{"XXX_FakeKey": "x"}, Mutable{}, false},
		{map[string]string{"readbytespersecond": "1"}, Mutable{}, false},
		{map[string]string{"readBytesPerSecond": "-1"}, Mutable{}, false},
		{map[string]string{"readBytesPerSecond": "1.5"}, Mutable{}, false},
		{map[string]string{"readBytesPerSecond": "100m"}, Mutable{}, false},
		{map[string]string{"readBytesPerSecond": "2Ei"}, Mutable{}, false},
		{map[string]string{"readBytesPerSecond": ""}, Mutable{}, false},
		{map[string]string{"readBytesPerSecond": "1\n2:3 4"}, Mutable{}, false},
		{map[string]string{"readIOPS": "20Mi"}, Mutable{}, false},
		{map[string]string{"readIOPS": "+5"}, Mutable{}, false},
		{map[string]string{"readIOPS": "1e3"}, Mutable{}, false},
		{map[string]string{"writeIOPS": "99999999999999999"}, Mutable{}, false},
		{map[string]string{"preallocate": "yes"}, Mutable{}, false},
		{map[string]string{"preallocate": "True"}, Mutable{}, false},
	}
	for _, tt := range tests {
		got, err := ParseMutable(tt.in)
		if tt.ok != (err == nil) {
			t.Errorf("%v: err %v, want ok=%t", tt.in, err, tt.ok)
			continue
		}
		if !tt.ok {
			wantCode(t, err, codes.InvalidArgument)
			continue
		}
		var a, b pool.Volume
		got.Apply(&a)
		tt.want.Apply(&b)
		if a.IOLimits != b.IOLimits || a.Preallocate != b.Preallocate {
			t.Errorf("%v: got %+v/%t, want %+v/%t", tt.in, a.IOLimits, a.Preallocate, b.IOLimits, b.Preallocate)
		}
	}
}
