package cgroup

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestValidatePodUID(t *testing.T) {
	for _, tt := range []struct {
		uid string
		ok  bool
	}{
		{"0d7d9a9e-3c1b-4d7e-9a55-1b2c3d4e5f60", true},
		{"0D7D9A9E-3C1B-4D7E-9A55-1B2C3D4E5F60", false},
		{"", false},
		{"../../etc", false},
		{"0d7d9a9e-3c1b-4d7e-9a55-1b2c3d4e5f60/..", false},
		{"0d7d9a9e3c1b4d7e9a551b2c3d4e5f60", false},
		{"0d7d9a9e-3c1b-4d7e-9a55-1b2c3d4e5f6\n", false},
	} {
		if err := ValidatePodUID(tt.uid); (err == nil) != tt.ok {
			t.Errorf("%q: %v, want ok=%t", tt.uid, err, tt.ok)
		}
	}
}

// TestPodCgroupAndWrite lays out fake cgroup trees (a plain directory
// tree: cgroupfs cannot be mounted without root) for each version and
// kubelet cgroup driver and checks the pod's cgroup is found and written.
func TestPodCgroupAndWrite(t *testing.T) {
	const uid = "0d7d9a9e-3c1b-4d7e-9a55-1b2c3d4e5f60"
	l := Limits{ReadBPS: 1 << 20, WriteBPS: 2 << 20, WriteIOPS: 300}
	tests := []struct {
		name  string
		v2    bool
		dir   string
		files map[string]string // file -> what it holds afterwards
	}{
		{"v1 cgroupfs burstable", false, "blkio/kubepods/burstable/pod" + uid, map[string]string{
			"blkio.throttle.read_bps_device": "7:3 1048576\n", "blkio.throttle.write_bps_device": "7:3 2097152\n",
			"blkio.throttle.read_iops_device": "7:3 0\n", "blkio.throttle.write_iops_device": "7:3 300\n"}},
		{"v1 systemd guaranteed", false, "blkio/kubepods.slice/kubepods-pod0d7d9a9e_3c1b_4d7e_9a55_1b2c3d4e5f60.slice", map[string]string{
			"blkio.throttle.write_iops_device": "7:3 300\n"}},
		{"v2 cgroupfs best-effort", true, "kubepods/besteffort/pod" + uid, map[string]string{
			"io.max": "7:3 rbps=1048576 wbps=2097152 riops=max wiops=300\n"}},
		{"v1 cgroupfs under kubelet's cgroupRoot /node-a", false, "blkio/node-a/kubepods/besteffort/pod" + uid, map[string]string{
			"blkio.throttle.write_bps_device": "7:3 2097152\n"}},
		{"v2 systemd under kubelet's cgroupRoot", true, "kubelet.slice/kubepods.slice/kubepods-pod0d7d9a9e_3c1b_4d7e_9a55_1b2c3d4e5f60.slice", map[string]string{
			"io.max": "7:3 rbps=1048576 wbps=2097152 riops=max wiops=300\n"}},
		{"v2 systemd burstable", true, "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0d7d9a9e_3c1b_4d7e_9a55_1b2c3d4e5f60.slice", map[string]string{
			"io.max": "7:3 rbps=1048576 wbps=2097152 riops=max wiops=300\n"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := t.TempDir()
			if tt.v2 {
				if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte("io\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			c := FS{Root: root}
			if _, err := c.PodCgroup(uid); !errors.Is(err, ErrNoPodCgroup) {
				t.Fatalf("no pod yet: %v", err)
			}
			dir := filepath.Join(root, tt.dir)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			for f := range map[string]bool{"io.max": tt.v2, "blkio.throttle.read_bps_device": !tt.v2, "blkio.throttle.write_bps_device": !tt.v2,
				"blkio.throttle.read_iops_device": !tt.v2, "blkio.throttle.write_iops_device": !tt.v2} {
				if strings.HasPrefix(f, "io.") == tt.v2 {
					if err := os.WriteFile(filepath.Join(dir, f), nil, 0o644); err != nil {
						t.Fatal(err)
					}
				}
			}
			got, err := c.PodCgroup(uid)
			if err != nil || got != dir {
				t.Fatalf("PodCgroup: %q, %v; want %q", got, err, dir)
			}
			if err := WriteLimits(got, c.v2(), 7, 3, l); err != nil {
				t.Fatal(err)
			}
			for f, want := range tt.files {
				raw, err := os.ReadFile(filepath.Join(dir, f))
				if err != nil || string(raw) != want {
					t.Errorf("%s holds %q (%v), want %q", f, raw, err, want)
				}
			}
			if back, err := ReadLimits(got, c.v2(), 7, 3); err != nil || back != l {
				t.Errorf("ReadLimits: %+v, %v; want %+v", back, err, l)
			}
		})
	}
}

func TestApplyRefusesBadUIDAndNonDevice(t *testing.T) {
	c := FS{Root: t.TempDir()}
	if _, err := c.Apply("../x", "/dev/null", Limits{}); !errors.Is(err, ErrBadPodUID) {
		t.Errorf("bad uid: %v", err)
	}
	const uid = "0d7d9a9e-3c1b-4d7e-9a55-1b2c3d4e5f60"
	if err := os.MkdirAll(filepath.Join(c.Root, "blkio/kubepods/pod"+uid), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Apply(uid, "/dev/null", Limits{}); err == nil || !strings.Contains(err.Error(), "not a block device") {
		t.Errorf("character device: %v", err)
	}
}

// TestReadLimits reads what the kernel shows: other devices' lines, a device
// with no line, and a value that is no number.
func TestReadLimits(t *testing.T) {
	tests := []struct {
		name    string
		v2      bool
		files   map[string]string
		want    Limits
		wantErr bool
	}{
		{name: "v2 among other devices", v2: true, files: map[string]string{"io.max": "8:0 rbps=1 wbps=max riops=max wiops=max\n7:3 rbps=max wbps=2097152 riops=max wiops=300\n"},
			want: Limits{WriteBPS: 2 << 20, WriteIOPS: 300}},
		{name: "v2 no line for the device", v2: true, files: map[string]string{"io.max": "8:0 rbps=1 wbps=max riops=max wiops=max\n"}},
		{name: "v2 empty", v2: true, files: map[string]string{"io.max": ""}},
		{name: "v2 a value that is no number", v2: true, files: map[string]string{"io.max": "7:3 rbps=lots\n"}, wantErr: true},
		{name: "v1 among other devices", files: map[string]string{
			"blkio.throttle.read_bps_device": "8:0 5\n7:3 1048576\n", "blkio.throttle.write_bps_device": "",
			"blkio.throttle.read_iops_device": "7:30 9\n", "blkio.throttle.write_iops_device": "7:3 300\n"},
			want: Limits{ReadBPS: 1 << 20, WriteIOPS: 300}},
		{name: "v1 a file missing", files: map[string]string{"blkio.throttle.read_bps_device": ""}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for f, body := range tt.files {
				if err := os.WriteFile(filepath.Join(dir, f), []byte(body), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			got, err := ReadLimits(dir, tt.v2, 7, 3)
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("ReadLimits: %+v, %v; want %+v (error %t)", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

// TestV1ContainersAreWritten: under cgroup v1 the pod's limits are written into
// each container's cgroup too (throttling is not hierarchical there), and a
// container that holds other limits (started since) makes the pod hold those.
func TestV1ContainersAreWritten(t *testing.T) {
	pod := t.TempDir()
	files := []string{"blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device",
		"blkio.throttle.read_iops_device", "blkio.throttle.write_iops_device"}
	for _, d := range []string{pod, filepath.Join(pod, "pause"), filepath.Join(pod, "app")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if err := os.WriteFile(filepath.Join(d, f), nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	l := Limits{WriteBPS: 8 << 20, ReadIOPS: 100}
	if err := writePod(pod, false, 7, 5, l); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{pod, filepath.Join(pod, "pause"), filepath.Join(pod, "app")} {
		if got, err := ReadLimits(d, false, 7, 5); err != nil || got != l {
			t.Errorf("%s holds %+v (%v), want %+v", d, got, err, l)
		}
	}
	if got, at, err := heldByPod(pod, false, 7, 5); err != nil || got != l || at != pod {
		t.Fatalf("held %+v at %s (%v), want %+v at the pod", got, at, err, l)
	}
	// A container restarted: a new cgroup, nothing in it.
	restarted := filepath.Join(pod, "app2")
	if err := os.MkdirAll(restarted, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(restarted, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got, at, err := heldByPod(pod, false, 7, 5); err != nil || got != (Limits{}) || at != restarted {
		t.Fatalf("with a new container: held %+v at %s (%v), want nothing at %s", got, at, err, restarted)
	}
}
