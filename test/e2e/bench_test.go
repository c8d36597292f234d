package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
	"github.com/poolcsi/poolcsi/internal/testutil"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// lifecycleSteps are the steps of a volume's life that BenchmarkLifecycle times.
var lifecycleSteps = []string{"create", "stage", "publish", "unpublish", "unstage", "delete"}

// lifecycleArm is one way of walking a 1 GiB volume through its life: step
// runs one named step of iteration i.
type lifecycleArm struct {
	name  string
	setup func(b *testing.B, root string)
	step  func(b *testing.B, i int, name string)
	times map[string][]time.Duration
	total []time.Duration
}

// mkfsFor is the mkfs command line the driver uses (internal/mount.mkfsArgs),
// repeated so the three arms format the same way.
func mkfsFor(fsType, target string) []string {
	switch fsType {
	case "ext4":
		return []string{"mkfs.ext4", "-F", "-q", "-m", "0", "-b", "4096",
			"-E", "lazy_itable_init=1,lazy_journal_init=1", target}
	case "xfs":
		return []string{"mkfs.xfs", "-q", target}
	default:
		return []string{"mkfs.btrfs", "-q", target}
	}
}

// BenchmarkLifecycle times create → stage → publish → unpublish → unstage → delete
// of a 1 GiB volume, per filesystem, three ways side by side in every round (the
// order rotates, so no arm always runs on a cache another warmed):
//
//   - poolcsi: the real driver process over its socket;
//   - raw-commands: truncate and mkfs of the file (create), losetup
//     --direct-io=on and mount (stage), mount --bind (publish), umount
//     (unpublish), umount and losetup -d (unstage), rm (delete);
//   - syscall-floor: the same work from Go with system calls only (open +
//     ftruncate, LOOP_CTL_GET_FREE + LOOP_CONFIGURE, mount(2), MS_BIND,
//     umount2, LOOP_CLR_FD, unlink) and mkfs, which cannot be avoided;
//   - durable-floor: syscall-floor plus the crash-safe records any driver that
//     keeps a volume's state in its pool must write, with poolcsi's fsyncs
//     (durableFloorArm): what is left of poolcsi/durable-floor is the driver's
//     own cost, and durable-floor/raw says how near half the raw commands a
//     driver that loses nothing on a crash can come on this disk;
//   - rpc-durable: durable-floor plus one no-op CSI call per step to a driver
//     over its socket (rpcDurableArm): the CO reaches a driver only through
//     gRPC, so poolcsi/rpc-durable is what the driver's own checks and
//     bookkeeping cost.
//
// All three format the image file before it is attached, with the driver's
// mkfs options. Every driver arm runs at the chart's default logLevel
// (csiproc.ChartLogLevel), as operators run it; the tests' -v 5 formats each
// call's request and answer into the log, a cost of its own. Run with
//
//	go test ./test/e2e -run '^$' -bench Lifecycle -benchtime 20x
//
// With POOLCSI_BENCH_BASELINE naming a poolcsi binary built from another
// commit, a sixth arm (poolcsi-baseline) runs it in the same rounds, and
// poolcsi/baseline says what a change won or lost, side by side:
//
//	git archive main | tar -x -C /tmp/base && (cd /tmp/base && go build -o /tmp/poolcsi-main ./cmd/poolcsi)
//	POOLCSI_BENCH_BASELINE=/tmp/poolcsi-main go test ./test/e2e -run '^$' -bench '^BenchmarkLifecycle$/^xfs$' -benchtime 10x -count 3 -v
//
// Each arm reports its median whole cycle (<arm>-ms) and per-step medians
// (logged as a table); the ratios are medians of the per-round ratios.
func BenchmarkLifecycle(b *testing.B) {
	testutil.RequireRoot(b)
	for _, fs := range []string{"xfs", "ext4", "btrfs"} {
		b.Run(fs, func(b *testing.B) {
			testutil.RequireCommands(b, "mkfs."+fs, "losetup", "mount", "umount", "truncate")
			root := b.TempDir()
			csiproc.CheckNoLeaks(b, root)
			arms := []*lifecycleArm{poolcsiArm(fs), rawArm(fs), floorArm(fs), durableFloorArm(fs), rpcDurableArm(fs)}
			if base := os.Getenv("POOLCSI_BENCH_BASELINE"); base != "" {
				arms = append(arms, poolcsiBinaryArm(fs, "poolcsi-baseline", base))
			}
			for _, a := range arms {
				a.times = map[string][]time.Duration{}
				a.setup(b, filepath.Join(root, a.name))
			}
			for i := 0; b.Loop(); i++ {
				for k := range arms {
					a := arms[(i+k)%len(arms)]
					start := time.Now()
					for _, s := range lifecycleSteps {
						t0 := time.Now()
						a.step(b, i, s)
						a.times[s] = append(a.times[s], time.Since(t0))
					}
					a.total = append(a.total, time.Since(start))
				}
			}
			reportLifecycle(b, arms)
		})
	}
}

func medianDur(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func medianRatio(a, b []time.Duration) float64 {
	r := make([]float64, len(a))
	for i := range a {
		r[i] = float64(a[i]) / float64(b[i])
	}
	slices.Sort(r)
	return r[len(r)/2]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d.Microseconds())/1000) }

func reportLifecycle(b *testing.B, arms []*lifecycleArm) {
	if len(arms[0].total) == 0 {
		return
	}
	var t strings.Builder
	fmt.Fprintf(&t, "\n%-20s", "ms (median)")
	for _, s := range lifecycleSteps {
		fmt.Fprintf(&t, "%10s", s)
	}
	fmt.Fprintf(&t, "%10s\n", "cycle")
	for _, a := range arms {
		fmt.Fprintf(&t, "%-20s", a.name)
		for _, s := range lifecycleSteps {
			fmt.Fprintf(&t, "%10s", ms(medianDur(a.times[s])))
		}
		fmt.Fprintf(&t, "%10s\n", ms(medianDur(a.total)))
		b.ReportMetric(float64(medianDur(a.total).Microseconds())/1000, a.name+"-ms")
	}
	pc, raw, floor, durable, rpc := arms[0], arms[1], arms[2], arms[3], arms[4]
	for _, r := range []struct {
		name string
		a, b *lifecycleArm
	}{
		{"poolcsi/raw", pc, raw}, {"poolcsi/floor", pc, floor}, {"raw/floor", raw, floor},
		{"poolcsi/durable", pc, durable}, {"durable/raw", durable, raw},
		{"poolcsi/rpc-durable", pc, rpc}, {"rpc-durable/raw", rpc, raw},
	} {
		fmt.Fprintf(&t, "%-20s", r.name)
		for _, s := range lifecycleSteps {
			fmt.Fprintf(&t, "%10.2f", medianRatio(r.a.times[s], r.b.times[s]))
		}
		fmt.Fprintf(&t, "%10.2f\n", medianRatio(r.a.total, r.b.total))
		b.ReportMetric(medianRatio(r.a.total, r.b.total), r.name)
	}
	if len(arms) > 5 { // a baseline driver (POOLCSI_BENCH_BASELINE)
		base := arms[5]
		for _, r := range []struct {
			name string
			a, b *lifecycleArm
		}{{"poolcsi/baseline", pc, base}, {"baseline/raw", base, raw}, {"baseline/rpc-durable", base, rpc}} {
			fmt.Fprintf(&t, "%-20s", r.name)
			for _, s := range lifecycleSteps {
				fmt.Fprintf(&t, "%10.2f", medianRatio(r.a.times[s], r.b.times[s]))
			}
			fmt.Fprintf(&t, "%10.2f\n", medianRatio(r.a.total, r.b.total))
			b.ReportMetric(medianRatio(r.a.total, r.b.total), r.name)
		}
	}
	b.Log(t.String())
}

// poolcsiArm drives the real driver process over its socket.
func poolcsiArm(fs string) *lifecycleArm { return poolcsiBinaryArm(fs, "poolcsi", "") }

// poolcsiBinaryArm is poolcsiArm with the driver binary bin ("": this tree's).
// POOLCSI_BENCH_BASELINE names a binary built from another commit, which runs
// as a sixth arm: before and after a change, side by side in one run.
func poolcsiBinaryArm(fs, name, bin string) *lifecycleArm {
	a := &lifecycleArm{name: name}
	var d *csiproc.Driver
	var staging, target, id string
	vc := csiproc.MountCap(fs, csiproc.RWO)
	a.setup = func(b *testing.B, root string) {
		d = csiproc.Start(b, csiproc.Options{Pools: []string{"bench=" + filepath.Join(root, "pool")}, Binary: bin, Verbosity: csiproc.ChartLogLevel})
		staging, target = filepath.Join(root, "staging"), filepath.Join(root, "pod")
	}
	a.step = func(b *testing.B, i int, s string) {
		ctx := context.Background()
		var err error
		switch s {
		case "create":
			var v *csi.CreateVolumeResponse
			v, err = d.Controller().CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "bench-" + strconv.Itoa(i), CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
				VolumeCapabilities: []*csi.VolumeCapability{vc},
			})
			id = v.GetVolume().GetVolumeId()
		case "stage":
			_, err = d.Node().NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc})
		case "publish":
			_, err = d.Node().NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc})
		case "unpublish":
			_, err = d.Node().NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
		case "unstage":
			_, err = d.Node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		case "delete":
			_, err = d.Controller().DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		}
		must(b, err)
	}
	return a
}

// rawArm runs the commands an administrator would type.
func rawArm(fs string) *lifecycleArm {
	a := &lifecycleArm{name: "raw-commands"}
	var img, mnt, bind, dev string
	a.setup = func(b *testing.B, root string) {
		img, mnt, bind = filepath.Join(root, "raw.img"), filepath.Join(root, "mnt"), filepath.Join(root, "bind")
		must(b, os.MkdirAll(mnt, 0o750))
		must(b, os.MkdirAll(bind, 0o750))
		b.Cleanup(func() {
			_ = exec.Command("umount", bind).Run()
			_ = exec.Command("umount", mnt).Run()
			if dev != "" {
				_ = exec.Command("losetup", "-d", dev).Run()
			}
		})
	}
	a.step = func(b *testing.B, _ int, s string) {
		switch s {
		case "create":
			run(b, "truncate", "-s", strconv.Itoa(1<<30), img)
			mkfs := mkfsFor(fs, img)
			run(b, mkfs[0], mkfs[1:]...)
		case "stage":
			dev = strings.TrimSpace(run(b, "losetup", "--direct-io=on", "-f", "--show", img))
			run(b, "mount", dev, mnt)
		case "publish":
			run(b, "mount", "--bind", mnt, bind)
		case "unpublish":
			run(b, "umount", bind)
		case "unstage":
			run(b, "umount", mnt)
			run(b, "losetup", "-d", dev)
			dev = ""
		case "delete":
			run(b, "rm", img)
		}
	}
	return a
}

// floorArm does the same work with system calls only, plus mkfs: what any
// driver has to pay at least.
func floorArm(fs string) *lifecycleArm {
	a := &lifecycleArm{name: "syscall-floor"}
	var img, mnt, bind, dev string
	a.setup = func(b *testing.B, root string) {
		img, mnt, bind = filepath.Join(root, "floor.img"), filepath.Join(root, "mnt"), filepath.Join(root, "bind")
		must(b, os.MkdirAll(mnt, 0o750))
		must(b, os.MkdirAll(bind, 0o750))
		b.Cleanup(func() {
			_ = unix.Unmount(bind, 0)
			_ = unix.Unmount(mnt, 0)
			if dev != "" {
				_ = floorDetach(dev)
			}
		})
	}
	a.step = func(b *testing.B, _ int, s string) {
		switch s {
		case "create":
			fd, err := unix.Open(img, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
			must(b, err)
			err = unix.Ftruncate(fd, 1<<30)
			unix.Close(fd)
			must(b, err)
			mkfs := mkfsFor(fs, img)
			run(b, mkfs[0], mkfs[1:]...)
		case "stage":
			var err error
			dev, err = floorAttach(img)
			must(b, err)
			must(b, unix.Mount(dev, mnt, fs, 0, ""))
		case "publish":
			must(b, unix.Mount(mnt, bind, "", unix.MS_BIND, ""))
		case "unpublish":
			must(b, unix.Unmount(bind, 0))
		case "unstage":
			must(b, unix.Unmount(mnt, 0))
			must(b, floorDetach(dev))
			dev = ""
		case "delete":
			must(b, unix.Unlink(img))
		}
	}
	return a
}

// durableFloorArm is floorArm plus the records poolcsi keeps, written the way
// it writes them (fsx.WriteFilePath: temp file, fsync, rename, and for a
// durable record an fsync of the directory), with the same fsyncs per step:
// create writes a non-durable "creating" record, fsyncs the formatted image and
// writes the durable "ready" record; stage writes the stage record before the
// mount exists and unstage clears it after the device is gone; delete renames
// the volume's directory away, removes it and fsyncs the parent. No locks, no
// checks, no gRPC: the least a driver that survives a crash without losing a
// volume or a fence pays.
func durableFloorArm(fs string) *lifecycleArm {
	a := &lifecycleArm{name: "durable-floor"}
	floor := floorArm(fs)
	var volumes, dir, rec, img string
	a.setup = func(b *testing.B, root string) {
		volumes, img = filepath.Join(root, "volumes"), filepath.Join(root, "floor.img")
		must(b, os.MkdirAll(volumes, 0o750))
		floor.setup(b, root)
	}
	record := func(b *testing.B, state string, durable bool) {
		must(b, fsx.WriteFilePath(rec, []byte(`{"state":"`+state+`"}`+"\n"), durable))
	}
	a.step = func(b *testing.B, i int, s string) {
		switch s {
		case "create":
			dir = filepath.Join(volumes, "v"+strconv.Itoa(i))
			rec = filepath.Join(dir, "volume.json")
			must(b, os.Mkdir(dir, 0o750))
			record(b, "creating", false)
			floor.step(b, i, s)
			f, err := os.Open(img)
			must(b, err)
			err = f.Sync()
			f.Close()
			must(b, err)
			record(b, "ready", true)
		case "stage":
			record(b, "staged", true)
			floor.step(b, i, s)
		case "unstage":
			floor.step(b, i, s)
			record(b, "ready", true)
		case "delete":
			floor.step(b, i, s)
			trash := filepath.Join(volumes, ".deleting-v"+strconv.Itoa(i))
			must(b, os.Rename(dir, trash))
			must(b, os.RemoveAll(trash))
			d, err := os.Open(volumes)
			must(b, err)
			err = d.Sync()
			d.Close()
			must(b, err)
		default:
			floor.step(b, i, s)
		}
	}
	return a
}

// rpcDurableArm is durable-floor plus one no-op call (GetPluginInfo) per step
// to a driver over its socket, as the poolcsi arm makes one call per step: the
// least a CSI driver that keeps crash-safe records pays, since every step
// reaches it through gRPC.
func rpcDurableArm(fs string) *lifecycleArm {
	a := &lifecycleArm{name: "rpc-durable"}
	durable := durableFloorArm(fs)
	var d *csiproc.Driver
	a.setup = func(b *testing.B, root string) {
		d = csiproc.Start(b, csiproc.Options{Pools: []string{"bench=" + filepath.Join(root, "pool")}, Verbosity: csiproc.ChartLogLevel})
		durable.setup(b, root)
	}
	a.step = func(b *testing.B, i int, s string) {
		_, err := d.Identity().GetPluginInfo(context.Background(), &csi.GetPluginInfoRequest{})
		must(b, err)
		durable.step(b, i, s)
	}
	return a
}

// floorAttach attaches img to a free loop device with direct I/O in the
// fewest calls the kernel offers (a racing process may take the free device:
// then try the next).
func floorAttach(img string) (string, error) {
	fd, err := unix.Open(img, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	defer unix.Close(ctl)
	for {
		n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", err
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		lfd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return "", err
		}
		cfg := unix.LoopConfig{Fd: uint32(fd), Size: 512}
		cfg.Info.Flags = unix.LO_FLAGS_DIRECT_IO
		err = unix.IoctlLoopConfigure(lfd, &cfg)
		unix.Close(lfd)
		if errors.Is(err, unix.EBUSY) {
			continue
		}
		return dev, err
	}
}

func floorDetach(dev string) error {
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
}

func must(b testing.TB, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

func run(b testing.TB, name string, args ...string) string {
	b.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		b.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}
