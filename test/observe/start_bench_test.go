package observe

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/test/csiproc"
)

// BenchmarkServeStart10k starts `poolcsi serve` on a pool of 10,000 volumes and reports
// the time from exec to a ready Probe, the time of a whole unpaged ListVolumes, and the
// process's resident memory after it (everything the pool holds has been read once):
// VmRSS, and its anonymous part (heap, stacks) and file part (the binary's pages).
// The budgets (docs/performance.md, "Start with 10,000 volumes"): under 1 s and
// under 50 MiB.
//
// The binary is built as deploy/Dockerfile builds the image's (no cgo, stripped):
// the memory that counts is that of the binary that runs. The test harness's own
// build (cgo, symbols) maps libc and the dynamic loader besides.
//
//	go test ./test/observe -run '^$' -bench ServeStart10k -benchtime 5x
func BenchmarkServeStart10k(b *testing.B) {
	dir := b.TempDir()
	p, err := pool.Open(pool.Config{Name: "local", Path: dir})
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 10000; i++ {
		name := fmt.Sprintf("pvc-%06d", i)
		id := pool.NewVolumeID("local", name)
		v := pool.Volume{SchemaVersion: pool.SchemaVersion, ID: id.String(), Name: name, Pool: "local", Layout: pool.LayoutImage,
			AccessType: pool.AccessBlock, CapacityBytes: pool.MiB, State: pool.StateReady, CreatedAt: time.Now().UTC()}
		raw, _ := json.Marshal(v)
		if err := os.MkdirAll(p.Dir(id), 0o750); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(p.MetadataPath(id), raw, 0o600); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(p.ImagePath(id), nil, 0o600); err != nil {
			b.Fatal(err)
		}
		if err := os.Truncate(p.ImagePath(id), pool.MiB); err != nil {
			b.Fatal(err)
		}
	}
	bin := imageBinary(b) // built once, outside the timing
	var startTotal, listMax time.Duration
	var rssMax, anonMax, fileMax int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sock := filepath.Join(b.TempDir(), "csi.sock")
		start := time.Now()
		cmd := exec.Command(bin, "serve", "--endpoint", "unix://"+sock, "--node-id", "node-1", "--pool", "local="+dir, "-v", "1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		// Poll the socket directly: a gRPC client dialled before the socket exists backs off
		// for a second, which would be measured instead of the driver.
		var conn *grpc.ClientConn
		for {
			if c, err := net.Dial("unix", sock); err == nil {
				c.Close()
				conn, err = grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
				if err != nil {
					b.Fatal(err)
				}
				if r, err := csi.NewIdentityClient(conn).Probe(context.Background(), &csi.ProbeRequest{}); err == nil && r.GetReady().GetValue() {
					break
				}
				conn.Close()
			}
			if time.Since(start) > 30*time.Second {
				b.Fatal("poolcsi not ready after 30 s")
			}
			time.Sleep(2 * time.Millisecond)
		}
		startTotal += time.Since(start)
		listStart := time.Now()
		resp, err := csi.NewControllerClient(conn).ListVolumes(context.Background(), &csi.ListVolumesRequest{})
		if err != nil || len(resp.GetEntries()) != 10000 {
			b.Fatalf("ListVolumes: %d entries, %v", len(resp.GetEntries()), err)
		}
		listMax = max(listMax, time.Since(listStart))
		rssMax = max(rssMax, procStatus(b, cmd.Process.Pid, "VmRSS:"))
		anonMax = max(anonMax, procStatus(b, cmd.Process.Pid, "RssAnon:"))
		fileMax = max(fileMax, procStatus(b, cmd.Process.Pid, "RssFile:"))
		conn.Close()
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}
	b.ReportMetric(float64(startTotal.Milliseconds())/float64(b.N), "ms-to-ready")
	b.ReportMetric(float64(listMax.Milliseconds()), "ms-list-max")
	b.ReportMetric(float64(rssMax)/(1<<20), "MiB-RSS")
	b.ReportMetric(float64(anonMax)/(1<<20), "MiB-anon")
	b.ReportMetric(float64(fileMax)/(1<<20), "MiB-file")
}

// imageBinary builds cmd/poolcsi with deploy/Dockerfile's flags.
func imageBinary(b *testing.B) string {
	bin := filepath.Join(b.TempDir(), "poolcsi")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, "./cmd/poolcsi")
	cmd.Dir = csiproc.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// procStatus reads a size field (kB) of a process's /proc status, in bytes.
func procStatus(b *testing.B, pid int, field string) int64 {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == field {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	b.Fatalf("no %s", field)
	return 0
}
