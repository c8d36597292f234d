package poolmount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// TestShareCommandLines: the command lines of the share types this machine
// cannot mount (no NFS or CephFS kernel client here), as mount-utils builds
// them for mount(8), and ceph-fuse's, which the driver builds itself, and what
// the log shows of them.
func TestShareCommandLines(t *testing.T) {
	s, err := NewShares("/var/lib/poolcsi/shares", 0)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		share      Share
		keyfile    string
		args, logs string
	}{
		{
			share: Share{Ref: pool.ShareRef{Type: "nfs", Source: "nfs.example.com:/export/poolcsi"}, Options: []string{"nfsvers=4.1", "hard"}},
			args:  "-t nfs -o nfsvers=4.1,hard nfs.example.com:/export/poolcsi /var/lib/poolcsi/shares/s-",
			logs:  "-t nfs -o nfsvers=4.1,hard nfs.example.com:/export/poolcsi /var/lib/poolcsi/shares/s-",
		},
		{
			share: Share{Ref: pool.ShareRef{Type: "ceph", Source: "10.0.0.1,10.0.0.2:/volumes/csi"}, Options: []string{"name=csi"}, Sensitive: []string{"secret=AQDkeykeykeykeykey=="}},
			args:  "-t ceph -o name=csi,secret=AQDkeykeykeykeykey== 10.0.0.1,10.0.0.2:/volumes/csi /var/lib/poolcsi/shares/s-",
			logs:  "-t ceph -o name=csi,<masked> 10.0.0.1,10.0.0.2:/volumes/csi /var/lib/poolcsi/shares/s-",
		},
		{
			share:   Share{Ref: pool.ShareRef{Type: "fuse.ceph", Source: "v2:10.0.0.1:3300,10.0.0.2:/csi"}, Options: []string{"name=csi", "fs=cephfs", "allow_other"}, Sensitive: []string{"secret=AQDkeykeykeykeykey=="}},
			keyfile: "/var/lib/poolcsi/shares/.key",
			args:    "-c /dev/null -m v2:10.0.0.1:3300,10.0.0.2 -r /csi --id csi --client_fs cephfs --keyfile /var/lib/poolcsi/shares/.key -o allow_other /var/lib/poolcsi/shares/s-",
			logs:    "-c /dev/null -m v2:10.0.0.1:3300,10.0.0.2 -r /csi --id csi --client_fs cephfs --keyfile /var/lib/poolcsi/shares/.key -o allow_other /var/lib/poolcsi/shares/s-",
		},
		{
			share: Share{Ref: pool.ShareRef{Type: BindType, Source: "/srv/export"}, Options: []string{"nodev"}},
			args:  "-o bind,nodev /srv/export /var/lib/poolcsi/shares/s-",
			logs:  "-o bind,nodev /srv/export /var/lib/poolcsi/shares/s-",
		},
	}
	for _, tt := range tests {
		t.Run(tt.share.Ref.Type, func(t *testing.T) {
			if err := Check(tt.share); err != nil {
				t.Fatal(err)
			}
			spec := s.spec(tt.share, tt.keyfile)
			if err := spec.Validate(); err != nil {
				t.Fatal(err)
			}
			args, logs := spec.args(s.Path(tt.share.Ref))
			if spec.command != nil {
				var prog string
				prog, args, logs = spec.command(s.Path(tt.share.Ref))
				if prog != "ceph-fuse" {
					t.Errorf("runs %s", prog)
				}
			}
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

// TestShareGrammar: each type's source grammar takes what its helper reads as
// a source and nothing that it would read as a flag or a path of its own.
func TestShareGrammar(t *testing.T) {
	tests := []struct {
		typ, source string
		ok          bool
	}{
		{"nfs", "nfs.example.com:/export/poolcsi", true},
		{"nfs", "10.0.0.1:/", true},
		{"nfs4", "[fd00::1]:/e", true},
		{"nfs", "s:/e:/f", false},
		{"nfs", "-o:/e", false},
		{"nfs", "s:/e/../x", false},
		{"nfs", "s:e", false},
		{"nfs", "a=b,c=d", false},
		{"nfs", "[10.0.0.1]:/e", false},
		{"ceph", "10.0.0.1,10.0.0.2:6789:/volumes", true},
		{"ceph", "mon-a.example.com:/", true},
		{"ceph", "csi@.cephfs=/volumes", true},
		{"ceph", "conf=/etc/ceph/x.conf", false},
		{"ceph", "a,b:/x,y", false},
		{"fuse.ceph", "v2:127.0.0.1:40123:/", true},
		{"fuse.ceph", "id=admin,conf=/etc/ceph/ceph.conf", false},
		{"fuse.ceph", "no_mon_config,admin_socket=/etc/passwd", false},
		{"fuse.ceph", "csi@.cephfs=/", false},
		{"bind", "/srv/export", true},
		{"bind", "/", false},
		{"bind", "relative", false},
		{"cifs", "//server/share", false},
	}
	for _, tt := range tests {
		err := CheckShare(pool.ShareRef{Type: tt.typ, Source: tt.source})
		if (err == nil) != tt.ok {
			t.Errorf("%s %q: %v, want ok=%t", tt.typ, tt.source, err, tt.ok)
		}
	}
}

// TestShareOptions: each type's allow-list, matched exactly in lowercase.
func TestShareOptions(t *testing.T) {
	tests := []struct {
		typ, option string
		sensitive   bool
		ok          bool
	}{
		{"nfs", "nfsvers=4.1", false, true},
		{"nfs", "hard", false, true},
		{"nfs", "nodev", false, true},
		{"nfs", "sec=krb5p", true, true},
		{"nfs", "bg", false, false},
		{"nfs", "Hard", false, false},
		{"nfs", "X-mount.mkdir", false, false},
		{"nfs", "x-mount.mkdir=0700", false, false},
		{"nfs", "helper=ceph", false, false},
		{"nfs", "loop", false, false},
		{"nfs", "bind", false, false},
		{"nfs", "remount", false, false},
		{"nfs", "nfsvers=4.9", false, false},
		{"nfs", "clientaddr=10.0.0.9", false, true},
		{"nfs", "clientaddr=evil", false, false},
		{"nfs", "hard=1", false, false},
		{"ceph", "name=csi", false, true},
		{"ceph", "ms_mode=secure", false, true},
		{"ceph", "secret=AQDkeykeykeykeykey==", true, true},
		{"ceph", "secret=AQDkeykeykeykeykey==", false, false},
		{"ceph", "secretfile=/etc/ceph/secret", true, false},
		{"ceph", "conf=/etc/ceph/ceph.conf", false, false},
		{"ceph", "mon_addr=10.0.0.1:3300/10.0.0.2", false, true},
		{"ceph", "name=../x", false, false},
		{"fuse.ceph", "name=csi", false, true},
		{"fuse.ceph", "allow_other", false, true},
		{"fuse.ceph", "admin_socket=/etc/passwd", false, false},
		{"fuse.ceph", "log_file=/etc/passwd", false, false},
		{"fuse.ceph", "ceph.admin_socket=/etc/passwd", false, false},
		{"fuse.ceph", "no_mon_config", false, false},
		{"fuse.ceph", "keyring=/etc/shadow", true, false},
		{"bind", "nodev", false, true},
		{"bind", "rbind", false, false},
	}
	for _, tt := range tests {
		err := CheckOption(tt.typ, tt.option, tt.sensitive)
		if (err == nil) != tt.ok {
			t.Errorf("%s %q (sensitive %t): %v, want ok=%t", tt.typ, tt.option, tt.sensitive, err, tt.ok)
		}
		if err != nil && tt.sensitive {
			if _, v, _ := strings.Cut(tt.option, "="); v != "" && strings.Contains(err.Error(), v) {
				t.Errorf("the refusal shows a secret value: %v", err)
			}
		}
	}
}

// recorder is a program that appends its argv to a file: it stands for a
// mount helper, so a test sees exactly what the driver would run.
func recorder(t *testing.T, dir, name, log string) {
	t.Helper()
	script := "#!/bin/sh\nprintf '%s\\n' \"" + name + " $*\" >> " + log + "\nexit 32\n"
	if err := os.WriteFile(filepath.Join(dir, name), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestCephFuseNeverThroughMountHelper: a fuse.ceph share is mounted by running
// ceph-fuse with the argv the driver built, never mount(8) and
// mount.fuse.ceph (which runs a shell); a hostile share is refused before
// anything runs; a failed mount leaves no record and no mount point.
func TestCephFuseNeverThroughMountHelper(t *testing.T) {
	bin := t.TempDir()
	log := filepath.Join(bin, "argv.log")
	for _, n := range []string{"mount", "mount.fuse.ceph", "ceph-fuse"} {
		recorder(t, bin, n, log)
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
	dir := filepath.Join(t.TempDir(), "shares")
	s, err := NewShares(dir, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	canary := filepath.Join(t.TempDir(), "canary")
	if err := os.WriteFile(canary, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	hostile := []Share{
		{Ref: pool.ShareRef{Type: "fuse.ceph", Source: "no_mon_config,admin_socket=" + canary}},
		{Ref: pool.ShareRef{Type: "fuse.ceph", Source: "10.0.0.1:/"}, Options: []string{"ceph.admin_socket=" + canary}},
		{Ref: pool.ShareRef{Type: "fuse.ceph", Source: "10.0.0.1:/"}, Options: []string{"log_file=" + canary}},
		{Ref: pool.ShareRef{Type: "fuse.ceph", Source: "10.0.0.1:/"}, Sensitive: []string{"conf=" + canary}},
		{Ref: pool.ShareRef{Type: "ceph", Source: "10.0.0.1:/"}, Options: []string{"secretfile=" + canary}},
		{Ref: pool.ShareRef{Type: "nfs", Source: "s:/e"}, Options: []string{"X-mount.mkdir"}},
	}
	for _, sh := range hostile {
		if _, _, err := s.Ensure(ctx, sh); !errors.Is(err, ErrShareRefused) && !errors.Is(err, pool.ErrInvalidID) {
			t.Errorf("%+v: %v, want a refusal", sh, err)
		}
	}
	if b, err := os.ReadFile(log); err == nil {
		t.Fatalf("a refused share ran a program:\n%s", b)
	}
	good := Share{Ref: pool.ShareRef{Type: "fuse.ceph", Source: "10.0.0.1:/csi"}, Options: []string{"name=csi"}, Sensitive: []string{"secret=AQDkeykeykeykeykey=="}}
	if _, _, err := s.Ensure(ctx, good); err == nil {
		t.Fatal("the recorder mounted nothing, yet Ensure succeeded")
	}
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.TrimSpace(string(b))
	want := "ceph-fuse -c /dev/null -m 10.0.0.1 -r /csi --id csi --keyfile " + filepath.Join(dir, "."+good.Ref.PoolName()+".key") + " " + s.Path(good.Ref)
	if got != want {
		t.Fatalf("ran\n%s\nwant\n%s", got, want)
	}
	if b, _ := os.ReadFile(canary); string(b) != "keep" {
		t.Fatalf("the canary changed: %q", b)
	}
	// Nothing of the failed mount stays: no record, no mount point, no key.
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Name() != dirLock {
			t.Errorf("left in the share directory: %s", e.Name())
		}
	}
	if s.Recorded(good.Ref) {
		t.Error("a share whose mount failed is recorded")
	}
}
