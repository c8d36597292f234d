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

	"github.com/poolcsi/poolcsi/test/harness"
)

// fioPattern is one fio job run against every target.
type fioPattern struct {
	name  string
	rw    string
	bs    string
	depth int
	mibps bool // report MiB/s rather than IOPS
}

var fioPatterns = []fioPattern{
	{name: "read-1m", rw: "read", bs: "1m", depth: 8, mibps: true},
	{name: "write-1m", rw: "write", bs: "1m", depth: 8, mibps: true},
	{name: "randread-4k", rw: "randread", bs: "4k", depth: 32},
	{name: "randwrite-4k", rw: "randwrite", bs: "4k", depth: 32},
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
// and poolcsi/hand-loop; the log has every round's figures.
// The pool lives under $TMPDIR: set TMPDIR to measure another filesystem.
//
// POOLCSI_FIO_RUNTIME (seconds, default 5) is each fio job's measured time.
// POOLCSI_FIO_KNOBS=1 adds hand-made loop devices that each differ from
// hand-loop by one knob: 4096-byte logical blocks (loop-4k), a fully allocated
// image (loop-thick, fallocate), buffered I/O (loop-buffered), and queue settings
// (loop-queue: nomerges=2, iostats=0, add_random=0, wbt_lat_usec=0, rotational=0).
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
	vc := harness.MountCap("xfs", harness.RWO)
	id := e.create("fio", vc, fioImageSize)
	e.stage(id, vc)
	e.publish(id, vc, false)
	targets := []fioTarget{
		{"pool-fs", poolFS},
		{"hand-loop", handLoop(b, e.root, "hand-loop", "512", "on", false, nil)},
		{"poolcsi", e.target(id)},
	}
	if os.Getenv("POOLCSI_FIO_KNOBS") != "" {
		targets = append(targets,
			fioTarget{"loop-4k", handLoop(b, e.root, "loop-4k", "4096", "on", false, nil)},
			fioTarget{"loop-thick", handLoop(b, e.root, "loop-thick", "512", "on", true, nil)},
			fioTarget{"loop-buffered", handLoop(b, e.root, "loop-buffered", "512", "off", false, nil)},
			fioTarget{"loop-queue", handLoop(b, e.root, "loop-queue", "512", "on", false, map[string]string{
				"nomerges": "2", "iostats": "0", "add_random": "0", "wbt_lat_usec": "0", "rotational": "0",
			})},
		)
	}
	// Lay every file out before anything is measured: the jobs then overwrite
	// written blocks everywhere, as a long-running workload does.
	for _, t := range targets {
		runFio(b, t.dir, "write", "1m", 8, 0)
	}

	for _, p := range fioPatterns {
		b.Run(p.name, func(b *testing.B) {
			got := map[string][]float64{}
			var vsPool, vsLoop []float64
			for round := 0; b.Loop(); round++ {
				this := map[string]float64{}
				for i := range targets {
					t := targets[(i+round)%len(targets)]
					r := runFio(b, t.dir, p.rw, p.bs, p.depth, runtime)
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

type fioResult struct{ iops, mibps float64 }

// runFio runs one fio job on dir/fio.dat (1 GiB, direct I/O, libaio); runtime 0
// runs it once through the file instead of for a time.
func runFio(b *testing.B, dir, rw, bs string, depth, runtime int) fioResult {
	b.Helper()
	out := filepath.Join(dir, "fio.json")
	args := []string{"--name=bench", "--directory=" + dir, "--filename=fio.dat", "--size=" + fioFileSize,
		"--direct=1", "--ioengine=libaio", "--rw=" + rw, "--bs=" + bs, "--iodepth=" + strconv.Itoa(depth),
		"--output-format=json", "--output=" + out}
	if runtime > 0 {
		args = append(args, "--time_based", "--ramp_time=1", "--runtime="+strconv.Itoa(runtime))
	}
	run(b, "fio", args...)
	raw, err := os.ReadFile(out)
	must(b, err)
	must(b, os.Remove(out))
	var rep struct {
		Jobs []struct {
			Read, Write struct {
				IOPS    float64 `json:"iops"`
				BWBytes float64 `json:"bw_bytes"`
			}
		} `json:"jobs"`
	}
	if err := json.Unmarshal(raw, &rep); err != nil || len(rep.Jobs) != 1 {
		b.Fatalf("fio in %s: unreadable report (%v):\n%s", dir, err, raw)
	}
	j := rep.Jobs[0]
	return fioResult{iops: j.Read.IOPS + j.Write.IOPS, mibps: (j.Read.BWBytes + j.Write.BWBytes) / (1 << 20)}
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
