package observe

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/poolcsi/poolcsi/test/csiproc"
)

// TestKubeletRegistration plays kubelet's plugin watcher against `poolcsi
// serve --registration-dir`: the socket appears once the CSI socket answers,
// GetInfo names the driver and the CSI socket, /healthz answers in-process,
// and a driver killed and started again registers again (a new socket).
func TestKubeletRegistration(t *testing.T) {
	root := t.TempDir()
	regDir, err := os.MkdirTemp("", "plugins_registry")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(regDir) })
	addr := freeAddr(t)
	d := csiproc.Start(t, csiproc.Options{Pools: []string{"p=" + filepath.Join(root, "pool")},
		Args: []string{"--driver-name", "poolcsi.test", "--registration-dir", regDir, "--kubelet-registration-path", "/var/lib/kubelet/plugins/poolcsi.test/csi.sock", "--healthz-address", addr}})
	sock := filepath.Join(regDir, "poolcsi.test-reg.sock")
	getInfo := func() *registerapi.PluginInfo {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				info, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{})
				cancel()
				conn.Close()
				if err == nil {
					return info
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("no registration at %s: %v", sock, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	info := getInfo()
	if info.GetType() != registerapi.CSIPlugin || info.GetName() != "poolcsi.test" || info.GetEndpoint() != "/var/lib/kubelet/plugins/poolcsi.test/csi.sock" {
		t.Fatalf("GetInfo: %v", info)
	}
	if code, body := get(t, "http://"+addr+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz %d %s", code, body)
	}
	d.Kill()
	d.Launch(t)
	if info := getInfo(); info.GetName() != "poolcsi.test" {
		t.Fatalf("after a restart: %v", info)
	}
	d.Stop()
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("a stopped driver left its registration socket: %v", err)
	}
}
