// Package kubeletplugin registers poolcsi with kubelet itself, and serves
// the liveness endpoint in-process, so a node pod needs neither the
// node-driver-registrar nor the livenessprobe sidecar (one image to pull per
// node instead of three). It speaks kubelet's plugin registration API v1
// (k8s.io/kubelet/pkg/apis/pluginregistration/v1): a socket in kubelet's
// plugins_registry directory serving GetInfo and NotifyRegistrationStatus.
package kubeletplugin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"regexp"
	"time"

	"google.golang.org/grpc"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/poolcsi/poolcsi/internal/unixsock"
)

// Registrar serves the registration socket for one CSI driver.
type Registrar struct {
	registerapi.UnimplementedRegistrationServer
	// DriverName is the CSI driver name kubelet registers.
	DriverName string
	// Endpoint is the CSI socket as kubelet sees it, on the host (for example
	// /var/lib/kubelet/plugins/poolcsi.io/csi.sock).
	Endpoint string
	// Dir is kubelet's plugins_registry directory as this process sees it;
	// the socket is <Dir>/<DriverName>-reg.sock.
	Dir string
	// Retry paces the attempts to take the socket while it cannot be had
	// (another instance serves it); DefaultRetry when zero.
	Retry wait.Backoff
}

// DefaultRetry paces a registrar waiting for the socket: soon at first (the
// instance a rolling update replaces is about to go), then every 30 s.
var DefaultRetry = wait.Backoff{Duration: time.Second, Factor: 2, Jitter: 0.1, Cap: 30 * time.Second, Steps: math.MaxInt32}

// SocketPath is where the registration socket is made.
func (r *Registrar) SocketPath() string { return filepath.Join(r.Dir, r.DriverName+"-reg.sock") }

// driverName is the CSI spec's rule for a plugin name (GetPluginInfo), which
// Kubernetes applies to a CSIDriver's: at most 63 characters, alphanumerics,
// '-' and '.', beginning and ending with an alphanumeric.
var driverName = regexp.MustCompile(`^[a-zA-Z0-9]([-.a-zA-Z0-9]{0,61}[a-zA-Z0-9])?$`)

// ValidateDriverName refuses a name that is not a CSI driver name. Such a name
// never holds a '/' and is never "." or "..": the registration socket named
// after it stays in its directory.
func ValidateDriverName(name string) error {
	if !driverName.MatchString(name) {
		return fmt.Errorf("driver name %q: want at most 63 characters, letters, digits, '-' and '.', beginning and ending with a letter or digit (the CSI spec's rule; e.g. poolcsi.io)", name)
	}
	return nil
}

// Run waits until ready answers (the CSI socket serves: kubelet calls
// NodeGetInfo right after it registers the plugin), then serves the
// registration socket until ctx ends, and removes it on the way out (if it is
// still its own), which deregisters the driver. A stale socket from an earlier
// process is replaced: kubelet's watcher sees the new one and registers the
// restarted driver. A socket another process serves, or anything that is not
// a socket, is never replaced nor removed: Run says what is there and tries
// again, paced by Retry, until it has the socket or ctx ends (an instance that
// gave up would leave kubelet without this driver once the other one goes).
func (r *Registrar) Run(ctx context.Context, ready func(context.Context) error) error {
	if err := ValidateDriverName(r.DriverName); err != nil {
		return err
	}
	log := klog.FromContext(ctx).WithValues("driver", r.DriverName, "socket", r.SocketPath())
	if err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := ready(pctx); err != nil {
			log.V(2).Info("Waiting for the CSI socket before registering with kubelet", "err", err)
			return false, nil
		}
		return true, nil
	}); err != nil {
		return nil // ctx ended
	}
	lis := r.listen(ctx, log)
	if lis == nil {
		return nil // ctx ended
	}
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, r)
	go func() {
		<-ctx.Done()
		srv.Stop()
	}()
	// Only the socket this process made goes: a newer instance's is its own
	// registration.
	defer func() {
		if err := lis.Remove(); err != nil {
			log.Error(err, "Not removing the registration socket")
		}
	}()
	log.Info("Serving kubelet plugin registration", "endpoint", r.Endpoint)
	if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve registration socket: %w", err)
	}
	return nil
}

// GetInfo tells kubelet what this plugin is and where its CSI socket is.
func (r *Registrar) GetInfo(ctx context.Context, _ *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.DriverName,
		Endpoint:          r.Endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

// NotifyRegistrationStatus is kubelet's answer: logged, and an error when
// kubelet refused the plugin (it says why).
func (r *Registrar) NotifyRegistrationStatus(ctx context.Context, s *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !s.GetPluginRegistered() {
		klog.FromContext(ctx).Error(errors.New(s.GetError()), "Kubelet refused to register the driver", "driver", r.DriverName)
		return &registerapi.RegistrationStatusResponse{}, nil
	}
	klog.FromContext(ctx).Info("Registered with kubelet", "driver", r.DriverName, "endpoint", r.Endpoint)
	return &registerapi.RegistrationStatusResponse{}, nil
}

// listen takes the registration socket, trying again while it cannot (another
// instance serves it, or something else is in the way); nil when ctx ends
// first. The first failure and every change of reason are logged; the same
// reason again only at V(2).
func (r *Registrar) listen(ctx context.Context, log klog.Logger) *unixsock.Socket {
	backoff := r.Retry // a copy: Step changes it
	if backoff.Duration == 0 {
		backoff = DefaultRetry
	}
	last := ""
	for {
		lis, err := unixsock.Listen(r.SocketPath())
		if err == nil {
			return lis
		}
		if msg := err.Error(); msg != last {
			last = msg
			log.Error(err, "Cannot serve the registration socket yet; trying again (another instance of the driver on this node? is kubelet's plugins_registry mounted?)")
		} else {
			log.V(2).Info("Registration socket still unavailable", "err", err)
		}
		// Step keeps returning the cap once it is reached.
		t := time.NewTimer(backoff.Step())
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}
