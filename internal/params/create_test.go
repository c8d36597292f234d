package params

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
)

func TestParseCreate(t *testing.T) {
	one := Config{Pools: []string{"local"}}
	two := Config{Pools: []string{"fast", "local"}}
	shares := Config{Pools: []string{"local"}, Shares: Shares{Enabled: true, Types: []string{"nfs"}, Keyed: true}}
	nfs := pool.ShareRef{Type: "nfs", Source: "srv:/export"}
	tests := []struct {
		name   string
		in     map[string]string
		cfg    Config
		pool   string
		share  *pool.ShareRef
		layout pool.Layout
		fs     string
		ok     bool
	}{
		{"defaults to the one pool", nil, one, "local", nil, pool.LayoutImage, "", true},
		{"several pools need a name", nil, two, "", nil, "", "", false},
		{"named pool", map[string]string{"pool": "fast", "layout": "dir"}, two, "fast", nil, pool.LayoutDir, "", true},
		{"unknown pool", map[string]string{"pool": "slow"}, two, "", nil, "", "", false},
		{"a share's pool name is no configured pool", map[string]string{"pool": nfs.PoolName()}, one, "", nil, "", "", false},
		{"fsType, any case", map[string]string{"fsType": "XFS"}, one, "local", nil, pool.LayoutImage, "xfs", true},
		{"kubernetes fstype", map[string]string{K8sPrefix + "fstype": "btrfs"}, one, "local", nil, pool.LayoutImage, "btrfs", true},
		{"bad fsType", map[string]string{"fsType": "zfs"}, one, "", nil, "", "", false},
		{"bad layout", map[string]string{"layout": "raw"}, one, "", nil, "", "", false},
		{"typo", map[string]string{"pol": "local"}, one, "", nil, "", "", false},
		{"kubernetes keys pass", map[string]string{K8sPrefix + "pvc/name": "data"}, one, "local", nil, pool.LayoutImage, "", true},
		{"share", map[string]string{"server": "srv", "share": "/export"}, shares, "", &nfs, pool.LayoutDir, "", true},
		{"share and pool", map[string]string{"server": "srv", "share": "/export", "pool": "local"}, shares, "", nil, "", "", false},
		{"share without key", map[string]string{"server": "srv", "share": "/export"}, Config{Pools: []string{"local"}, Shares: Shares{Enabled: true, Types: []string{"nfs"}}}, "", nil, "", "", false},
		{"share type not allowed", map[string]string{"shareType": "ceph", "shareSource": "mon:/"}, shares, "", nil, "", "", false},
		{"no shares here", map[string]string{"server": "srv", "share": "/export"}, one, "", nil, "", "", false},
		{"options alone", map[string]string{"shareOptions": "vers=4"}, shares, "", nil, "", "", false},
		{"server with a path", map[string]string{"server": "srv:/x", "share": "/export"}, shares, "", nil, "", "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := map[string]string{}
			for k, v := range tt.in {
				in[k] = v
			}
			got, err := ParseCreate(in, tt.cfg)
			if len(in) != len(tt.in) {
				t.Fatalf("ParseCreate changed its input: %v", in)
			}
			if tt.ok != (err == nil) {
				t.Fatalf("ParseCreate(%v) = %+v, %v; want ok=%t", tt.in, got, err, tt.ok)
			}
			if err != nil {
				if status.Code(err) != codes.InvalidArgument {
					t.Fatalf("ParseCreate(%v) = %v, want INVALID_ARGUMENT", tt.in, err)
				}
				return
			}
			if got.Pool != tt.pool || got.Layout != tt.layout || got.FSType != tt.fs || (got.Share == nil) != (tt.share == nil) || (got.Share != nil && got.Share.Ref != *tt.share) {
				t.Fatalf("ParseCreate(%v) = %+v", tt.in, got)
			}
		})
	}
}

func TestShareFlags(t *testing.T) {
	got := ShareFlags([]string{"ro", "nfsvers=4.1", "noexec", "hard"})
	if len(got) != 2 || got[0] != "nfsvers=4.1" || got[1] != "hard" {
		t.Fatalf("ShareFlags = %v, want the share's own: nfsvers=4.1, hard", got)
	}
	if SplitOptions("") != nil || len(SplitOptions("a,b")) != 2 {
		t.Fatal("SplitOptions")
	}
}
