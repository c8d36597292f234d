package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// leaseFile is node's lease file in the shared pool dir.
func leaseFile(dir, node string) string { return filepath.Join(dir, "leases", node) }

// plantLease writes raw where node's lease belongs, as anyone who can write
// the pool can.
func plantLease(t *testing.T, dir, node, raw string) {
	t.Helper()
	if err := os.RemoveAll(leaseFile(dir, node)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(leaseFile(dir, node), []byte(raw), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestPlantedLeaseRecordsNeverShortenTheWait: node A has an image staged
// read-write and is alive (it renewed). A record planted in its lease file
// (released, a duration that overflows, a negative or zero one, garbage,
// another node's name, a directory) must not let a controller force-detach
// the volume before A's own lease could have expired: before, "released"
// and durationSeconds 9223372036 let it go at once, and garbage refused it
// for good.
func TestPlantedLeaseRecordsNeverShortenTheWait(t *testing.T) {
	tests := []struct {
		name  string
		plant func(t *testing.T, dir string)
	}{
		{"released", func(t *testing.T, dir string) {
			plantLease(t, dir, "node-a", `{"node":"node-a","instance":"x","counter":99,"durationSeconds":60,"released":true}`)
		}},
		{"duration overflows", func(t *testing.T, dir string) {
			plantLease(t, dir, "node-a", `{"node":"node-a","instance":"x","counter":99,"durationSeconds":9223372036}`)
		}},
		{"duration largest", func(t *testing.T, dir string) {
			plantLease(t, dir, "node-a", `{"node":"node-a","instance":"x","counter":99,"durationSeconds":9223372036854775807}`)
		}},
		{"duration negative", func(t *testing.T, dir string) {
			plantLease(t, dir, "node-a", `{"node":"node-a","instance":"x","counter":99,"durationSeconds":-9223372036854775808}`)
		}},
		{"duration zero", func(t *testing.T, dir string) {
			plantLease(t, dir, "node-a", `{"node":"node-a","instance":"x","counter":99,"durationSeconds":0}`)
		}},
		{"released by another node's name", func(t *testing.T, dir string) {
			plantLease(t, dir, "node-a", `{"node":"node-b","instance":"x","counter":99,"released":true}`)
		}},
		{"garbage", func(t *testing.T, dir string) { plantLease(t, dir, "node-a", "{{{{") }},
		{"directory", func(t *testing.T, dir string) {
			if err := os.Remove(leaseFile(dir, "node-a")); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(leaseFile(dir, "node-a"), 0o755); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir, _, b, _, id, _ := stagedOnA(t)
			unpublish := func() error {
				_, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
				return err
			}
			wantCode(t, unpublish(), codes.Unavailable) // B sees A's live record
			b.clock.add(lease.Default.Duration)         // A's last renewal is 60 s old
			tt.plant(t, dir)
			// Right after the plant, and until A's own lease plus the margin
			// could have run out since the plant, the volume stays.
			for _, step := range []time.Duration{0, lease.Default.Margin, lease.Default.Duration - time.Second} {
				b.clock.add(step)
				if err := unpublish(); grpcstatus.Code(err) != codes.Unavailable {
					t.Fatalf("force-detach %s after the planted record: %v; want UNAVAILABLE (node A may be writing)", step, err)
				}
			}
		})
	}
}

// TestPlantedLeaseRecordsBoundTheWait: node A staged an image read-write and
// died (no renewals). A record planted in its lease file (a billion-second
// duration, garbage, a directory) delays the force-detach by at most
// lease.MaxDuration plus the margin from when the controller saw it: before,
// the billion seconds made it wait 277,777 hours, and garbage refused it for
// good.
func TestPlantedLeaseRecordsBoundTheWait(t *testing.T) {
	tests := []struct {
		name string
		raw  string // planted content; "" plants a directory
	}{
		{"a billion seconds", `{"node":"node-a","instance":"x","counter":99,"durationSeconds":1000000000}`},
		{"garbage", "\x00\x01garbage"},
		{"directory", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir, _, b, _, id, _ := stagedOnA(t)
			if tt.raw == "" {
				if err := os.Remove(leaseFile(dir, "node-a")); err != nil {
					t.Fatal(err)
				}
				if err := os.Mkdir(leaseFile(dir, "node-a"), 0o755); err != nil {
					t.Fatal(err)
				}
			} else {
				plantLease(t, dir, "node-a", tt.raw)
			}
			unpublish := func() error {
				_, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
				return err
			}
			if err := unpublish(); grpcstatus.Code(err) != codes.Unavailable {
				t.Fatalf("first sight of the planted record: %v; want UNAVAILABLE", err)
			}
			b.clock.add(10*time.Minute + lease.Default.Margin)
			if err := unpublish(); err != nil {
				t.Fatalf("force-detach of a dead node's volume 10.5 min after a planted record: %v", err)
			}
		})
	}
}

// TestDamagedLeaseFileIsRepaired: node A's own lease file replaced by a
// directory, a link or a FIFO while the pool answers: A repairs it and keeps
// renewing, and never fences (before, it fenced itself for good at the
// lease's duration). A reader sees it renew.
func TestDamagedLeaseFileIsRepaired(t *testing.T) {
	tests := []struct {
		name  string
		plant func(t *testing.T, dir string)
	}{
		{"directory", func(t *testing.T, dir string) {
			must(t, os.MkdirAll(filepath.Join(leaseFile(dir, "node-a"), "x", "y"), 0o755))
		}},
		{"symlink", func(t *testing.T, dir string) {
			must(t, os.Symlink("/etc/hostname", leaseFile(dir, "node-a")))
		}},
		{"fifo", func(t *testing.T, dir string) {
			must(t, syscall.Mkfifo(leaseFile(dir, "node-a"), 0o644))
		}},
		{"hard link to another node's lease", func(t *testing.T, dir string) {
			must(t, os.WriteFile(leaseFile(dir, "node-z"), []byte(`{"node":"node-z","instance":"z","counter":1}`), 0o644))
			must(t, os.Link(leaseFile(dir, "node-z"), leaseFile(dir, "node-a")))
		}},
		{"garbage with a tail", func(t *testing.T, dir string) {
			must(t, os.WriteFile(leaseFile(dir, "node-a"), []byte(strings.Repeat("garbage ", 200)), 0o644))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir, a, b, _, _, _ := stagedOnA(t)
			dev := mustFind(t, a.host, dir)
			must(t, os.Remove(leaseFile(dir, "node-a")))
			tt.plant(t, dir)
			for elapsed := time.Duration(0); elapsed <= 2*lease.Default.Duration; elapsed += lease.Default.Interval {
				if err := a.renew(t); err != nil {
					t.Fatalf("renewing %s after the damage: %v", elapsed, err)
				}
				a.clock.add(lease.Default.Interval)
				a.leases.FenceExpired(ctx)
			}
			if f, _ := a.host.Fenced(dev); f {
				t.Fatal("node A fenced itself although the pool answered")
			}
			rec, ok, err := b.pools.Pool("shared").Leases().Read("node-a")
			if err != nil || !ok || rec.Node != "node-a" || rec.Counter == 0 {
				t.Fatalf("node A's lease as another node reads it: %+v %t %v", rec, ok, err)
			}
			if _, err := os.Stat("/etc/hostname"); err != nil {
				t.Fatalf("the link's target: %v", err)
			}
			if z, err := os.ReadFile(leaseFile(dir, "node-z")); err == nil && !strings.Contains(string(z), `"node-z"`) {
				t.Fatalf("node A renewed through a hard link into node-z's lease: %q", z)
			}
		})
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestFenceSaysWhy: a node that cannot renew fences at the lease's duration
// whatever the cause (other nodes take its volumes then), a damaged lease
// file it cannot repair included, and its volumes' health says which cause.
func TestFenceSaysWhy(t *testing.T) {
	tests := []struct {
		name  string
		write func(*pool.Pool, pool.Lease) error // nil: blocks (a hung pool)
		// repairFails makes the repair fail (a damage it cannot remove).
		want string
	}{
		{"EIO", func(*pool.Pool, pool.Lease) error { return fmt.Errorf("write: %w", syscall.EIO) }, "cut off from the pool"},
		{"ESTALE", func(*pool.Pool, pool.Lease) error { return fmt.Errorf("write: %w", syscall.ESTALE) }, "cut off from the pool"},
		{"root not the pool", func(*pool.Pool, pool.Lease) error {
			return fmt.Errorf("%w: pool.json missing", pool.ErrUnavailable)
		}, "cut off from the pool"},
		{"hung", nil, "renewal timed out"},
		{"damaged beyond repair", func(*pool.Pool, pool.Lease) error {
			return fmt.Errorf("%w: a directory", pool.ErrLeaseDamaged)
		}, "lease file damaged"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			dir, a, _, _, id, staging := stagedOnA(t)
			dev := mustFind(t, a.host, dir)
			hang := make(chan struct{})
			t.Cleanup(func() { close(hang) })
			write := tt.write
			if tt.write == nil {
				write = func(*pool.Pool, pool.Lease) error { <-hang; return errors.New("hung") }
			}
			a.leases.SetRenewal(write, func(*pool.Pool, string) error { return errors.New("cannot remove it") })
			if tt.write == nil {
				for _, p := range a.leases.SharedPools() {
					a.leases.RenewAsync(ctx, p, nil) // never returns
				}
			} else if err := a.renew(t); err == nil {
				t.Fatal("the renewal worked")
			}
			a.clock.add(lease.Default.Duration)
			a.leases.FenceExpired(ctx)
			waitFenced(t, a.host, dev)
			vid, _ := pool.ParseVolumeID(id)
			issues, err := a.nodeIssues(a.pools.Pool("shared"), vid, staging, "")
			if err != nil || len(issues) != 1 || issues[0].Reason != health.ReasonNodeFenced || !strings.Contains(issues[0].Message, tt.want) {
				t.Fatalf("health after the fence: %+v %v; want NodeFenced saying %q", issues, err, tt.want)
			}
		})
	}
}

// TestOverwrittenLeaseStillRenews: someone rewrites node A's lease with one
// constant record right after each of A's renewals, so that a reader never
// sees A's own records. A's writes succeed, so A does not fence; the reader
// must therefore count every write to the file as a renewal (its change
// time), or it would take the volume from a live writer after the expiry.
func TestOverwrittenLeaseStillRenews(t *testing.T) {
	ctx := context.Background()
	dir, a, b, _, id, _ := stagedOnA(t)
	forged := []byte(`{"node":"node-a","instance":"forged","counter":1,"durationSeconds":60}`)
	for elapsed := time.Duration(0); elapsed < 3*(lease.Default.Duration+lease.Default.Margin); elapsed += 20 * time.Second {
		if err := a.renew(t); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond) // past the filesystem's change-time granularity
		if err := os.WriteFile(leaseFile(dir, "node-a"), forged, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := b.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"})
		if grpcstatus.Code(err) != codes.Unavailable {
			t.Fatalf("force-detach %s into the overwriting of a live node's lease: %v; want UNAVAILABLE", elapsed, err)
		}
		b.clock.add(20 * time.Second)
		a.clock.add(20 * time.Second)
	}
}
