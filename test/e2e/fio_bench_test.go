package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// fioPattern is one fio job run against every target.
type fioPattern struct {
	name  string
	rw    string
	bs    string
	depth int
	mibps bool // report MiB/s rather than IOPS
	fsync bool // synchronous writes, fsync after each (a database's commit)
	knob  bool // only with POOLCSI_FIO_KNOBS
}

var fioPatterns = []fioPattern{
	{name: "read-1m", rw: "read", bs: "1m", depth: 8, mibps: true},
	{name: "write-1m", rw: "write", bs: "1m", depth: 8, mibps: true},
	{name: "randread-4k", rw: "randread", bs: "4k", depth: 32},
	{name: "randwrite-4k", rw: "randwrite", bs: "4k", depth: 32},
	{name: "randwrite-4k-fsync", rw: "randwrite", bs: "4k", depth: 1, fsync: true, knob: true},
}

// fioTarget is a directory fio writes its file in.
type fioTarget struct{ name, dir string }

const (
	fioImageSize = 4 << 30
	fioFileSize  = "1g"
)

// BenchmarkFio runs the same fio jobs (direct I/O, libaio, one 1 GiB file) inside a
// published 4 GiB xfs image volume, on the pool's own filesystem, and inside a loop
// device made by hand the way the driver makes one (sparse file, losetup
// --direct-io=on, mkfs.xfs on the device), interleaved round by round so all three
// share the machine's state. Run with
//
//	go test ./test/e2e -run '^$' -bench Fio -benchtime 5x -timeout 60m
//
// Each -benchtime iteration is one round of every target (the order rotates per
// round). It reports per target the median IOPS (4 KiB jobs) or MiB/s (1 MiB jobs)
// and the median, smallest and largest of the per-round ratios poolcsi/pool-fs
// and poolcsi/hand-loop, and the machine's CPU time per I/O (cpu-µs/io: every
// process and kernel thread, other work included); the log has every round's
// figures. The pool lives under $TMPDIR: set TMPDIR to measure another filesystem.
//
// POOLCSI_FIO_RUNTIME (seconds, default 5) is each fio job's measured time.
// POOLCSI_FIO_KNOBS=1 adds hand-made loop devices that each differ from
// hand-loop (which has the pool disk's logical block size, as the driver's loop
// devices do) by one knob: 4096-byte logical blocks (loop-4k), a fully allocated
// image (loop-thick, fallocate), buffered I/O (loop-buffered), and queue settings
// (loop-queue: nomerges=2, iostats=0, add_random=0, wbt_lat_usec=0, rotational=0),
// and a fifth job: 4 KiB random writes, one at a time, each followed by fsync
// (loop-4k's xfs has 4096-byte sectors, so its log writes match the pool's blocks).
func BenchmarkFio(b *testing.B) {
	if _, err := exec.LookPath("fio"); err != nil {
		b.Fatalf("BenchmarkFio needs fio on PATH (Debian: apt-get install fio): %v", err)
	}
	e := newEnv(b, "mkfs.xfs", "losetup", "fallocate")
	runtime := 5
	if s := os.Getenv("POOLCSI_FIO_RUNTIME"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("POOLCSI_FIO_RUNTIME=%q: want whole seconds ≥ 1", s)
		}
		runtime = n
	}

	poolFS := filepath.Join(e.root, "pool-fs")
	must(b, os.MkdirAll(poolFS, 0o750))
	vc := csiproc.MountCap("xfs", csiproc.RWO)
	id := e.create("fio", vc, fioImageSize)
	e.stage(id, vc)
	e.publish(id, vc, false)
	sector := diskSectorSize(b, e.root)
	targets := []fioTarget{
		{"pool-fs", poolFS},
		{"hand-loop", handLoop(b, e.root, "hand-loop", sector, "on", false, nil)},
		{"poolcsi", e.target(id)},
	}
	if os.Getenv("POOLCSI_FIO_KNOBS") != "" {
		targets = append(targets,
			fioTarget{"loop-4k", handLoop(b, e.root, "loop-4k", "4096", "on", false, nil)},
			fioTarget{"loop-thick", handLoop(b, e.root, "loop-thick", sector, "on", true, nil)},
			fioTarget{"loop-buffered", handLoop(b, e.root, "loop-buffered", sector, "off", false, nil)},
			fioTarget{"loop-queue", handLoop(b, e.root, "loop-queue", sector, "on", false, map[string]string{
				"nomerges": "2", "iostats": "0", "add_random": "0", "wbt_lat_usec": "0", "rotational": "0",
			})},
		)
	}
	// Lay every file out before anything is measured: the jobs then overwrite
	// written blocks everywhere, as a long-running workload does.
	for _, t := range targets {
		runFio(b, t.dir, fioPattern{rw: "write", bs: "1m", depth: 8}, 0)
	}

	for _, p := range fioPatterns {
		if p.knob && os.Getenv("POOLCSI_FIO_KNOBS") == "" {
			continue
		}
		b.Run(p.name, func(b *testing.B) {
			got, cpu := map[string][]float64{}, map[string][]float64{}
			var vsPool, vsLoop []float64
			for round := 0; b.Loop(); round++ {
				this := map[string]float64{}
				for i := range targets {
					t := targets[(i+round)%len(targets)]
					r := runFio(b, t.dir, p, runtime)
					cpu[t.name] = append(cpu[t.name], r.busyMicros)
					v := r.iops
					if p.mibps {
						v = r.mibps
					}
					this[t.name] = v
					got[t.name] = append(got[t.name], v)
				}
				vsPool = append(vsPool, this["poolcsi"]/this["pool-fs"])
				vsLoop = append(vsLoop, this["poolcsi"]/this["hand-loop"])
				line := fmt.Sprintf("round %d:", round+1)
				for _, t := range targets {
					line += fmt.Sprintf(" %s %.0f", t.name, this[t.name])
				}
				b.Log(line)
			}
			unit := "IOPS"
			if p.mibps {
				unit = "MiB/s"
			}
			for _, t := range targets {
				b.ReportMetric(median(got[t.name]), t.name+"-"+unit)
				b.ReportMetric(median(cpu[t.name]), t.name+"-cpu-µs/io")
			}
			// The spread says how far one round's ratio can be trusted here.
			b.ReportMetric(median(vsPool), "poolcsi/pool-fs")
			b.ReportMetric(slices.Min(vsPool), "poolcsi/pool-fs-min")
			b.ReportMetric(slices.Max(vsPool), "poolcsi/pool-fs-max")
			b.ReportMetric(median(vsLoop), "poolcsi/hand-loop")
			b.ReportMetric(slices.Min(vsLoop), "poolcsi/hand-loop-min")
			b.ReportMetric(slices.Max(vsLoop), "poolcsi/hand-loop-max")
		})
	}
}

// handLoop makes a loop device by hand, formats it xfs and mounts it under root,
// registering the undoing of each step before taking it. sector is losetup's
// --sector-size, dio its --direct-io; thick fallocates the image instead of
// leaving it sparse; queue sets /sys/block/loopN/queue attributes.
func handLoop(b *testing.B, root, name, sector, dio string, thick bool, queue map[string]string) string {
	b.Helper()
	img := filepath.Join(root, name+".img")
	mnt := filepath.Join(root, name)
	must(b, os.MkdirAll(mnt, 0o750))
	b.Cleanup(func() { os.Remove(img) })
	if thick {
		run(b, "fallocate", "-l", strconv.Itoa(fioImageSize), img)
	} else {
		run(b, "truncate", "-s", strconv.Itoa(fioImageSize), img)
	}
	dev := strings.TrimSpace(run(b, "losetup", "--direct-io="+dio, "--sector-size", sector, "-f", "--show", img))
	b.Cleanup(func() {
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			b.Errorf("losetup -d %s: %v\n%s", dev, err, out)
		}
	})
	if dio == "on" {
		// losetup falls back to buffered I/O silently; the comparison would be void.
		got, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "dio"))
		if err != nil || strings.TrimSpace(string(got)) != "1" {
			b.Fatalf("%s (%s) runs without direct I/O (sysfs dio %q, %v)", dev, name, got, err)
		}
	}
	for attr, v := range queue {
		must(b, os.WriteFile(filepath.Join("/sys/block", filepath.Base(dev), "queue", attr), []byte(v), 0o644))
	}
	run(b, "mkfs.xfs", "-q", dev)
	b.Cleanup(func() {
		if ok, _ := mountinfo.Mounted(mnt); ok {
			if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
				b.Errorf("umount %s: %v\n%s", mnt, err, out)
			}
		}
	})
	run(b, "mount", dev, mnt)
	return mnt
}

// diskSectorSize is the logical block size of the disk holding dir, which is
// what the driver gives the loop devices of images in a pool there (512 when
// sysfs does not say, as for the driver).
func diskSectorSize(b *testing.B, dir string) string {
	b.Helper()
	var st unix.Stat_t
	must(b, unix.Stat(dir, &st))
	sys := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	for _, q := range []string{"queue/logical_block_size", "../queue/logical_block_size"} {
		if raw, err := os.ReadFile(filepath.Join(sys, q)); err == nil {
			return strings.TrimSpace(string(raw))
		}
	}
	return "512"
}

type fioResult struct {
	iops, mibps float64
	// busyMicros is the whole machine's CPU time (every process and kernel
	// thread, the loop device's workers included) per I/O, over the fio run
	// including its ramp-up second.
	busyMicros float64
}

// runFio runs one fio job on dir/fio.dat (1 GiB, direct I/O, libaio); runtime 0
// runs it once through the file instead of for a time.
func runFio(b *testing.B, dir string, p fioPattern, runtime int) fioResult {
	b.Helper()
	out := filepath.Join(dir, "fio.json")
	args := []string{"--name=bench", "--directory=" + dir, "--filename=fio.dat", "--size=" + fioFileSize,
		"--direct=1", "--rw=" + p.rw, "--bs=" + p.bs, "--iodepth=" + strconv.Itoa(p.depth),
		"--output-format=json", "--output=" + out}
	if p.fsync {
		args = append(args, "--ioengine=psync", "--fsync=1")
	} else {
		args = append(args, "--ioengine=libaio")
	}
	if runtime > 0 {
		args = append(args, "--time_based", "--ramp_time=1", "--runtime="+strconv.Itoa(runtime))
	}
	busy0 := busyTicks(b)
	run(b, "fio", args...)
	busy := busyTicks(b) - busy0
	raw, err := os.ReadFile(out)
	must(b, err)
	must(b, os.Remove(out))
	var rep struct {
		Jobs []struct {
			Read, Write struct {
				IOPS     float64 `json:"iops"`
				BWBytes  float64 `json:"bw_bytes"`
				TotalIOs float64 `json:"total_ios"`
			}
		} `json:"jobs"`
	}
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Jobs) != 1 {
		b.Fatalf("fio in %s: unreadable report (%v):\n%s", dir, err, raw)
	}
	j := rep.Jobs[0]
	r := fioResult{iops: j.Read.IOPS + j.Write.IOPS, mibps: (j.Read.BWBytes + j.Write.BWBytes) / (1 << 20)}
	if ios := j.Read.TotalIOs + j.Write.TotalIOs; ios > 0 {
		r.busyMicros = float64(busy) * 1e6 / clockTicks / ios
	}
	return r
}

// clockTicks is USER_HZ, the unit of /proc/stat: 100 on every Linux architecture.
const clockTicks = 100

// busyTicks is the machine's non-idle CPU time so far (/proc/stat: user, nice,
// system, irq, softirq, steal), in clock ticks.
func busyTicks(b *testing.B) int64 {
	b.Helper()
	raw, err := os.ReadFile("/proc/stat")
	must(b, err)
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(f) < 9 || f[0] != "cpu" {
		b.Fatalf("/proc/stat: unexpected first line %q", line)
	}
	var busy int64
	for _, i := range []int{1, 2, 3, 6, 7, 8} {
		n, err := strconv.ParseInt(f[i], 10, 64)
		must(b, err)
		busy += n
	}
	return busy
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}
