package poolmount

import (
	"strings"
	"testing"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestShareCommandLines: the mount(8) command lines of the share types this
// machine cannot mount (no NFS or CephFS kernel client here), as mount-utils
// builds them, and what the log shows of them.
func TestShareCommandLines(t *testing.T) {
	s, err := NewShares("/var/lib/poolcsi/shares", 0)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		share      Share
		args, logs string
	}{
		{
			Share{Ref: pool.ShareRef{Type: "nfs", Source: "nfs.example.com:/export/poolcsi"}, Options: []string{"nfsvers=4.1", "hard"}},
			"-t nfs -o nfsvers=4.1,hard nfs.example.com:/export/poolcsi /var/lib/poolcsi/shares/s-",
			"-t nfs -o nfsvers=4.1,hard nfs.example.com:/export/poolcsi /var/lib/poolcsi/shares/s-",
		},
		{
			Share{Ref: pool.ShareRef{Type: "ceph", Source: "10.0.0.1,10.0.0.2:/volumes/csi"}, Options: []string{"name=csi"}, Sensitive: []string{"secret=AQDkey=="}},
			"-t ceph -o name=csi,secret=AQDkey== 10.0.0.1,10.0.0.2:/volumes/csi /var/lib/poolcsi/shares/s-",
			"-t ceph -o name=csi,<masked> 10.0.0.1,10.0.0.2:/volumes/csi /var/lib/poolcsi/shares/s-",
		},
		{
			Share{Ref: pool.ShareRef{Type: "fuse.ceph", Source: "id=csi,client_mountpoint=/csi"}},
			"-t fuse.ceph id=csi,client_mountpoint=/csi /var/lib/poolcsi/shares/s-",
			"-t fuse.ceph id=csi,client_mountpoint=/csi /var/lib/poolcsi/shares/s-",
		},
		{
			Share{Ref: pool.ShareRef{Type: BindType, Source: "/srv/export"}, Options: []string{"nodev"}},
			"-o bind,nodev /srv/export /var/lib/poolcsi/shares/s-",
			"-o bind,nodev /srv/export /var/lib/poolcsi/shares/s-",
		},
	}
	for _, tt := range tests {
		t.Run(tt.share.Ref.Type, func(t *testing.T) {
			spec := s.spec(tt.share)
			if err := spec.Validate(); err != nil {
				t.Fatal(err)
			}
			args, logs := spec.args(s.Path(tt.share.Ref))
			want := tt.args + tt.share.Ref.PoolName()[2:]
			if got := strings.Join(args, " "); got != want {
				t.Errorf("args\n got %s\nwant %s", got, want)
			}
			if got := strings.TrimSpace(logs); got != tt.logs+tt.share.Ref.PoolName()[2:] {
				t.Errorf("logged %s", got)
			}
		})
	}
}
