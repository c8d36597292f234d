package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// plant is what someone who can write a shared pool (anyone, on any node) may
// put in place of one of the pool's own files.
type plant struct {
	name string
	make func(path string) error
}

var plants = []plant{
	{"link to /dev/zero", func(p string) error { return os.Symlink("/dev/zero", p) }},
	{"FIFO", func(p string) error { return unix.Mkfifo(p, 0o600) }},
	{"100 MB file", func(p string) error {
		f, err := os.Create(p)
		if err != nil {
			return err
		}
		defer f.Close()
		return f.Truncate(100 << 20)
	}},
	{"directory", func(p string) error { return os.Mkdir(p, 0o700) }},
}

// TestHostilePoolFiles: whatever is planted in place of any of a shared pool's
// own files, the driver starts (Probe ready), answers every call within its
// deadline, never grows past a small heap, and each operator command finishes
// within its time limit and answers SIGTERM; pool check names the damage.
// Before the pool's files were read through one bounded, non-blocking reader,
// a link to /dev/zero made the driver die of OOM at start and a FIFO made it,
// and the CLI, hang for ever.
func TestHostilePoolFiles(t *testing.T) {
	testutil.RequireRoot(t)
	bin := csiproc.Binary(t)
	root := t.TempDir()
	csiproc.CheckNoLeaks(t, root)
	pristine := filepath.Join(root, "pristine")
	cli := func(ctx context.Context, args ...string) ([]byte, error) {
		return exec.CommandContext(ctx, bin, args...).CombinedOutput()
	}
	if out, err := cli(context.Background(), "pool", "init", "--path", pristine, "--name", "shared", "--not-a-mount-point-ok"); err != nil {
		t.Fatalf("pool init: %v\n%s", err, out)
	}
	// A volume, a snapshot of it, a publish record and the node registry: every
	// kind of file a shared pool holds.
	var volID, snapID string
	func() {
		d := csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"shared=" + pristine + ",shared"}})
		defer d.Stop()
		ctx := ctx(t)
		vc := csiproc.MountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
		v, err := d.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-dir", VolumeCapabilities: []*csi.VolumeCapability{vc},
			Parameters: map[string]string{"layout": "dir"}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
		if err != nil {
			t.Fatalf("CreateVolume: %v", err)
		}
		volID = v.GetVolume().GetVolumeId()
		s, err := d.Controller().CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: volID})
		if err != nil {
			t.Fatalf("CreateSnapshot: %v", err)
		}
		snapID = s.GetSnapshot().GetSnapshotId()
		if _, err := d.Controller().ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: volID, NodeId: "node-1", VolumeCapability: vc}); err != nil {
			t.Fatalf("ControllerPublishVolume: %v", err)
		}
	}()
	vid, err := pool.ParseVolumeID(volID)
	if err != nil {
		t.Fatal(err)
	}
	sid, err := pool.ParseSnapshotID(snapID)
	if err != nil {
		t.Fatal(err)
	}
	vdir := filepath.Join("volumes", vid.Key)
	files := []string{
		"pool.json",
		".lock",
		filepath.Join(vdir, "volume.json"),
		filepath.Join(vdir, "lock"),
		filepath.Join(vdir, "frozen"),
		filepath.Join("snapshots", sid.Key, "snapshot.json"),
		filepath.Join("nodes", "node-1.json"),
		filepath.Join("nodes", "node-1.lock"),
	}
	for _, rel := range files {
		for _, pl := range plants {
			t.Run(rel+"/"+pl.name, func(t *testing.T) {
				dir := filepath.Join(root, strconv.Itoa(len(t.Name()))+"-"+fmt.Sprint(time.Now().UnixNano()))
				if out, err := exec.Command("cp", "-a", pristine, dir).CombinedOutput(); err != nil {
					t.Fatalf("copy the pool: %v %s", err, out)
				}
				t.Cleanup(func() { os.RemoveAll(dir) })
				target := filepath.Join(dir, rel)
				if err := os.RemoveAll(target); err != nil {
					t.Fatal(err)
				}
				if err := pl.make(target); err != nil {
					t.Fatal(err)
				}
				// Each operator command, bounded: a hang is a failure, not a
				// test timeout.
				for _, args := range [][]string{
					{"pool", "list", "--path", dir},
					{"pool", "check", "--path", dir},
					{"pool", "unfence", "--path", dir, "--volume", volID},
				} {
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					out, err := cli(ctx, args...)
					hung := ctx.Err() != nil
					cancel()
					if hung {
						t.Errorf("poolcsi %s did not finish within 20 s", strings.Join(args[:2], " "))
					}
					if args[1] == "check" && err == nil {
						t.Errorf("pool check found no problem with %s planted at %s:\n%s", pl.name, rel, out)
					}
				}
				// The driver: starts, answers within the sidecars' deadlines.
				d := csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"shared=" + dir + ",shared"}, SidecarDeadlines: true})
				ctx := context.Background()
				c := d.Controller()
				vc := csiproc.MountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
				calls := []struct {
					name string
					call func() error
				}{
					{"ListVolumes", func() error { _, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{}); return err }},
					{"ControllerGetVolume", func() error {
						_, err := c.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: volID})
						return err
					}},
					{"ListSnapshots", func() error { _, err := c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{}); return err }},
					{"ControllerPublishVolume", func() error {
						_, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: volID, NodeId: "node-1", VolumeCapability: vc})
						return err
					}},
					{"CreateVolume", func() error {
						_, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-new", VolumeCapabilities: []*csi.VolumeCapability{vc},
							Parameters: map[string]string{"layout": "dir"}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
						return err
					}},
					{"GetCapacity", func() error { _, err := c.GetCapacity(ctx, &csi.GetCapacityRequest{}); return err }},
					{"Probe", func() error { _, err := d.Identity().Probe(ctx, &csi.ProbeRequest{}); return err }},
				}
				for _, cl := range calls {
					err := cl.call()
					if code := status.Code(err); code == codes.DeadlineExceeded || code == codes.Canceled || code == codes.Unknown || code == codes.Internal && strings.Contains(err.Error(), "panic") {
						t.Errorf("%s: %v", cl.name, err)
					}
				}
				if rss := rssMiB(t, d.Pid()); rss > 100 {
					t.Errorf("driver resident memory %d MiB after the calls", rss)
				}
				d.Stop()
				// Nothing outside the pool was touched: /dev/zero is still a device.
				if fi, err := os.Stat("/dev/zero"); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
					t.Fatalf("/dev/zero: %v %v", fi, err)
				}
			})
		}
	}
}

// rssMiB is a process's resident memory.
func rssMiB(t *testing.T, pid int) int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range bytes.Split(raw, []byte("\n")) {
		if f := strings.Fields(string(line)); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb >> 10
		}
	}
	t.Fatal(errors.New("no VmRSS"))
	return 0
}

// TestPoolCommandAnswersSIGTERM: an operator command waiting for a volume's lock
// (held here by flock(1), as by a driver mid-call on another node) ends at once
// on SIGTERM, whatever it is blocked in.
func TestPoolCommandAnswersSIGTERM(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "flock")
	bin := csiproc.Binary(t)
	dir := filepath.Join(t.TempDir(), "pool")
	if out, err := exec.Command(bin, "pool", "init", "--path", dir, "--name", "shared", "--not-a-mount-point-ok").CombinedOutput(); err != nil {
		t.Fatalf("pool init: %v\n%s", err, out)
	}
	d := csiproc.Start(t, csiproc.Options{NodeID: "node-1", Pools: []string{"shared=" + dir + ",shared"}})
	vc := csiproc.MountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	v, err := d.Controller().CreateVolume(ctx(t), &csi.CreateVolumeRequest{Name: "pvc", VolumeCapabilities: []*csi.VolumeCapability{vc},
		Parameters: map[string]string{"layout": "dir"}, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * mib}})
	if err != nil {
		t.Fatal(err)
	}
	d.Stop()
	vid, err := pool.ParseVolumeID(v.GetVolume().GetVolumeId())
	if err != nil {
		t.Fatal(err)
	}
	holder := exec.Command("flock", filepath.Join(dir, "volumes", vid.Key, "lock"), "sleep", "60")
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = holder.Process.Kill(); _ = holder.Wait() })
	time.Sleep(200 * time.Millisecond) // flock(1) takes the lock
	cmd := exec.Command(bin, "pool", "unfence", "--path", dir, "--volume", vid.String())
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	time.Sleep(time.Second)
	select {
	case err := <-done:
		t.Fatalf("pool unfence ended while the lock was held: %v", err)
	default:
	}
	_ = cmd.Process.Signal(unix.SIGTERM)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatal("pool unfence did not end within 5 s of SIGTERM")
	}
}
