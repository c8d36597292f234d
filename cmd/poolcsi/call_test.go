package main

import (
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// startDriver serves a controller on a throw-away local pool over a unix
// socket, in this process, until the test ends; it returns the endpoint.
func startDriver(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	p, err := pool.Open(pool.Config{Name: "p", Path: filepath.Join(dir, "pool")})
	if err != nil {
		t.Fatal(err)
	}
	d, err := driver.New(driver.Options{Name: "call.test", Version: "v-test", NodeID: "n", Mode: driver.ModeController, Pools: []*pool.Pool{p}})
	if err != nil {
		t.Fatal(err)
	}
	return serveInTest(t, d, dir)
}

// serveInTest serves d on a socket in dir until the test ends; it returns the
// endpoint.
func serveInTest(t *testing.T, d *driver.Driver, dir string) string {
	t.Helper()
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Serve(ctx, endpoint) }()
	// The client does not wait for a socket that is not there yet, and a
	// socket file exists from bind(2) on, before it listens: wait for a
	// connection to be accepted, not for the file.
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		c, err := net.Dial("unix", strings.TrimPrefix(endpoint, "unix://"))
		if err == nil {
			_ = c.Close()
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("the driver does not accept connections on its socket: %v", err)
		}
	}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return endpoint
}

func TestCall(t *testing.T) {
	endpoint := startDriver(t)
	tests := []struct {
		name string
		args []string
		code int
		want string // in stdout, or stderr when the call fails
	}{
		{"no request", []string{"GetPluginInfo"}, 0, `"vendor_version": "v-test"`},
		{"service named", []string{"Identity.GetPluginInfo"}, 0, `"name": "call.test"`},
		{"empty request", []string{"Probe", "{}"}, 0, `"ready": true`},
		{"request fields", []string{"ListVolumes", `{"max_entries": 2}`}, 0, "{}"},
		{"camel-case fields", []string{"ControllerGetCapabilities", `{}`}, 0, `"CREATE_DELETE_VOLUME"`},
		{"an error's code", []string{"ControllerGetVolume", `{"volumeId": "p.0123456789abcdef0123456789abcdef"}`}, 1, "NotFound"},
		{"an invalid argument", []string{"DeleteVolume", `{}`}, 1, "InvalidArgument"},
		{"unknown method", []string{"Frobnicate"}, 1, `no CSI method "Frobnicate"`},
		{"a field the message lacks", []string{"GetCapacity", `{"nope": 1}`}, 1, `unknown field "nope"`},
		{"bad JSON", []string{"Probe", `{`}, 1, "request for Probe"},
		{"no method", nil, 1, "want METHOD"},
		{"a service not served", []string{"NodeGetInfo"}, 1, "Unimplemented"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := runCLI(append([]string{"call", "--endpoint", endpoint}, tt.args...)...)
			got := out
			if tt.code != 0 {
				got = errOut
			}
			if code != tt.code || !strings.Contains(got, tt.want) {
				t.Fatalf("exit %d, want %d with %q; stdout:\n%s\nstderr:\n%s", code, tt.code, tt.want, out, errOut)
			}
			if code == 0 && !json.Valid([]byte(out)) {
				t.Fatalf("output is not JSON:\n%s", out)
			}
		})
	}
}

func TestFindCSIMethod(t *testing.T) {
	tests := []struct {
		name, want string // want: the full name, or "" for an error
	}{
		{"CreateVolume", "csi.v1.Controller.CreateVolume"},
		{"Controller.CreateVolume", "csi.v1.Controller.CreateVolume"},
		{"Node.CreateVolume", ""},
		{"NodeGetVolumeStats", "csi.v1.Node.NodeGetVolumeStats"},
		{"GetPluginInfo", "csi.v1.Identity.GetPluginInfo"},
		{"createvolume", ""},
	}
	for _, tt := range tests {
		m, err := findCSIMethod(tt.name)
		switch {
		case tt.want == "" && err == nil:
			t.Errorf("%s: found %s, want an error", tt.name, m.FullName())
		case tt.want != "" && (err != nil || string(m.FullName()) != tt.want):
			t.Errorf("%s: %v %v, want %s", tt.name, m, err, tt.want)
		}
	}
}
