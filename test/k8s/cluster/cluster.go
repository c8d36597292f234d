package cluster

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/poolcsi/poolcsi/test/k8s/tools"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Proc is one process of the test cluster; its output goes to Log.
type Proc struct {
	Name string
	Log  string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Cluster is a control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager.
type Cluster struct {
	Dir       string
	PKI       *PKI
	APIServer string // https://127.0.0.1:port
	AdminKube string // kubeconfig path
	Config    *rest.Config
	Client    *kubernetes.Clientset
	// OnHostPath, if set, is told each directory on the host a node of the cluster is
	// about to take, before it takes it (kind "node": the node's own directory).
	OnHostPath func(kind, path string)
	mu         sync.Mutex
	procs      []*Proc
}

// FreePort is a TCP port on 127.0.0.1 nothing listens on now.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Start runs a process whose output goes to <dir>/logs/<name>.log; it is stopped when the
// test ends, and its log tail is printed if the test failed.
func (c *Cluster) Start(t testing.TB, name, bin string, env []string, args ...string) *Proc {
	t.Helper()
	p := c.launch(t, name, bin, env, args...)
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			b, _ := os.ReadFile(p.Log)
			t.Logf("---- last lines of %s (%s) ----\n%s", name, p.Log, Tail(string(b), 25))
		}
	})
	return p
}

// launch is Start without the cleanup: for a process that replaces one Start started,
// which its owner stops in that one's place (a cleanup registered now would run before
// the graceful teardown registered earlier).
func (c *Cluster) launch(t testing.TB, name, bin string, env []string, args ...string) *Proc {
	t.Helper()
	logDir := filepath.Join(c.Dir, "logs")
	_ = os.MkdirAll(logDir, 0o755)
	p := &Proc{Name: name, Log: filepath.Join(logDir, name+".log"), done: make(chan struct{})}
	f, err := os.Create(p.Log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { p.err = p.cmd.Wait(); f.Close(); close(p.done) }()
	c.mu.Lock()
	c.procs = append(c.procs, p)
	c.mu.Unlock()
	return p
}

// Stop ends the process (SIGTERM, then SIGKILL after 5 s) and waits for it.
func (p *Proc) Stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// Exited reports whether the process has ended, and how.
func (p *Proc) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// MustRun fails the test if the process has already exited, with its log's tail.
func (p *Proc) MustRun(t testing.TB) {
	t.Helper()
	if done, err := p.Exited(); done {
		b, _ := os.ReadFile(p.Log)
		t.Fatalf("%s exited (%v):\n%s", p.Name, err, Tail(string(b), 30))
	}
}

// WriteKubeconfig writes a kubeconfig for the API server with either the admin client
// certificate (token == "") or a bearer token.
func (c *Cluster) WriteKubeconfig(name, token string) (string, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: c.APIServer, CertificateAuthority: c.PKI.CACert}
	auth := &clientcmdapi.AuthInfo{}
	if token == "" {
		auth.ClientCertificate, auth.ClientKey = c.PKI.AdminCert, c.PKI.AdminKey
	} else {
		auth.Token = token
	}
	cfg.AuthInfos[name] = auth
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: name}
	cfg.CurrentContext = "test"
	path := filepath.Join(c.Dir, name+".kubeconfig")
	return path, clientcmd.WriteToFile(*cfg, path)
}

// StartCluster brings up etcd, kube-apiserver and kube-controller-manager (the controllers
// a CSI driver meets: PV binder and expander, PV/PVC protection) and waits until the API
// server is ready.
func StartCluster(t testing.TB, dir string) *Cluster {
	t.Helper()
	return StartClusterWith(t, dir, ClusterOptions{})
}

// ClusterOptions changes the control plane for a cluster with real nodes.
type ClusterOptions struct {
	// NodeIP, when set, makes kube-apiserver listen on every address and advertise NodeIP:
	// pods reach it through the kubernetes Service, which kube-proxy maps to NodeIP. It
	// also asks for kube-controller-manager with all its controllers (service-account
	// tokens, the root CA ConfigMap, namespaces, garbage collection, ...) and
	// kube-scheduler: without them no pod starts.
	NodeIP string
}

// StartClusterWith is StartCluster with options.
func StartClusterWith(t testing.TB, dir string, opts ClusterOptions) *Cluster {
	t.Helper()
	etcd, apiserver, kcm := tools.Etcd.Path(t), tools.APIServer.Path(t), tools.ControllerManager.Path(t)
	pki, err := NewPKI(filepath.Join(dir, "pki"))
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Dir: dir, PKI: pki}

	ep, pp := FreePort(t), FreePort(t)
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", ep)
	peer := fmt.Sprintf("http://127.0.0.1:%d", pp)
	ep2 := c.Start(t, "etcd", etcd, nil,
		"--name=default", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer,
		"--initial-cluster=default="+peer, "--listen-metrics-urls=",
		"--quota-backend-bytes=1073741824", "--unsafe-no-fsync", "--log-level=warn")
	WaitFor(t, 60*time.Second, "etcd health", func() error {
		ep2.MustRun(t)
		resp, err := http.Get(etcdURL + "/health")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	})

	port := FreePort(t)
	c.APIServer = "https://127.0.0.1:" + strconv.Itoa(port)
	bind, advertise := "127.0.0.1", "127.0.0.1"
	var nodeArgs []string
	if opts.NodeIP != "" {
		bind, advertise = "0.0.0.0", opts.NodeIP
		// kubectl logs/exec and the e2e suite reach kubelet by the node's InternalIP: this
		// machine's hostname does not resolve.
		nodeArgs = append(nodeArgs, "--kubelet-preferred-address-types=InternalIP",
			// logs, exec and the node proxy authenticate to kubelet (anonymous is off there).
			"--kubelet-client-certificate="+pki.AdminCert, "--kubelet-client-key="+pki.AdminKey)
	}
	api := c.Start(t, "kube-apiserver", apiserver, nil, append([]string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=" + bind, "--advertise-address=" + advertise, "--secure-port=" + strconv.Itoa(port),
		"--tls-cert-file=" + pki.ServingCert, "--tls-private-key-file=" + pki.ServingKey,
		"--client-ca-file=" + pki.CACert,
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + pki.SAPublicKey, "--service-account-signing-key-file=" + pki.SASigningKey,
		"--api-audiences=https://kubernetes.default.svc",
		"--service-cluster-ip-range=10.96.0.0/24",
		"--authorization-mode=RBAC",
		"--allow-privileged=true",
		"--enable-priority-and-fairness=false",
		"--profiling=false",
		"--v=1"}, nodeArgs...)...)
	c.AdminKube, err = c.WriteKubeconfig("admin", "")
	if err != nil {
		t.Fatal(err)
	}
	c.Config, err = clientcmd.BuildConfigFromFlags("", c.AdminKube)
	if err != nil {
		t.Fatal(err)
	}
	c.Config.QPS, c.Config.Burst = 50, 100
	c.Client = kubernetes.NewForConfigOrDie(c.Config)
	WaitFor(t, 120*time.Second, "kube-apiserver /readyz", func() error {
		api.MustRun(t)
		b, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		if err != nil {
			return fmt.Errorf("%w %s", err, b)
		}
		return nil
	})
	// The default namespace and the RBAC bootstrap roles appear shortly after readiness.
	WaitFor(t, 60*time.Second, "namespace default", func() error {
		_, err := c.Client.CoreV1().Namespaces().Get(context.Background(), "default", metav1GetOptions)
		return err
	})

	controllers := "--controllers=" + strings.Join([]string{
		"persistentvolume-binder-controller",
		"persistentvolume-expander-controller",
		"persistentvolume-protection-controller",
		"persistentvolumeclaim-protection-controller",
	}, ",")
	var kcmArgs []string
	if opts.NodeIP != "" {
		controllers = "--controllers=*"
		kcmArgs = []string{
			// Service-account tokens and the kube-root-ca.crt ConfigMap every pod mounts.
			"--service-account-private-key-file=" + pki.SASigningKey,
			"--root-ca-file=" + pki.CACert,
			// One node, no cloud: nothing allocates pod CIDRs, the CNI config has its own.
			"--allocate-node-cidrs=false",
			"--node-monitor-grace-period=40s",
		}
	}
	kcmPort := FreePort(t)
	k := c.Start(t, "kube-controller-manager", kcm, nil, append([]string{
		"--kubeconfig=" + c.AdminKube,
		"--authentication-kubeconfig=" + c.AdminKube, "--authorization-kubeconfig=" + c.AdminKube,
		"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(kcmPort),
		"--leader-elect=false",
		"--use-service-account-credentials=false",
		controllers,
		"--pvclaimbinder-sync-period=1s",
		"--v=2"}, kcmArgs...)...)
	time.Sleep(500 * time.Millisecond)
	k.MustRun(t)
	return c
}

// WaitFor polls f every 250 ms until it returns nil, failing the test after timeout.
func WaitFor(t testing.TB, timeout time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for {
		if err = f(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s: %v", timeout, what, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}
