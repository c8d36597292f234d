package driver

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/health"
)

func (d identityServer) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.opts.Name, VendorVersion: d.opts.Version}, nil
}

func (d identityServer) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	caps := []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
			Type: csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS,
		}},
	}}
	// Image volumes grow while published (NodeExpandVolume) and while not
	// (at the next NodeStageVolume).
	for _, t := range []csi.PluginCapability_VolumeExpansion_Type{csi.PluginCapability_VolumeExpansion_ONLINE, csi.PluginCapability_VolumeExpansion_OFFLINE} {
		caps = append(caps, &csi.PluginCapability{
			Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: t}},
		})
	}
	if d.opts.Mode.controller() {
		caps = append(caps, &csi.PluginCapability{
			Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
				Type: csi.PluginCapability_Service_CONTROLLER_SERVICE,
			}},
		}, &csi.PluginCapability{
			// Volume group snapshots (group.go), served with the controller.
			Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
				Type: csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE,
			}},
		})
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe is liveness: it answers ready whenever this process can serve, and a
// broken pool never makes it fail. A pool that is missing, unmounted,
// read-only or out of space makes that pool unavailable, not the driver:
// its calls answer UNAVAILABLE (or RESOURCE_EXHAUSTED) naming the cause and
// the fix, NodeGetStorageHealth reports it, poolcsi_pool_up is 0 for it, and
// the log says when it goes and when it comes back; the other pools keep
// serving. That holds even when no pool is usable: restarting the process
// mounts no share and frees no space, and a restart loop would only bury the
// cause under CrashLoopBackOff (docs/health.md). Probe costs a few system
// calls per pool.
//
// The pool checks (registering with a pool that appeared, logging a pool that
// became unusable) read the pools' filesystems, which on a shared pool can
// take seconds to answer: another client's change stalls a lookup on CephFS,
// a dead client longer. Probe is the livenessprobe's question, "is the process
// alive", with a 3 s timeout in the chart, so it does not wait for them past
// its deadline: they run in the background, one round at a time, and Probe
// answers when they are done or its deadline comes, whichever is first.
func (d identityServer) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	select {
	case <-d.probePools(ctx):
	case <-ctx.Done():
		klog.FromContext(ctx).V(2).Info("Probe answered before its pool checks finished: a pool's filesystem is slow to answer; they go on in the background")
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

// probePools starts a round of Probe's pool checks unless one is under way,
// and returns a channel closed when that round is done.
func (d identityServer) probePools(ctx context.Context) <-chan struct{} {
	d.probeMu.Lock()
	defer d.probeMu.Unlock()
	if d.probing != nil {
		select {
		case <-d.probing:
		default:
			return d.probing // a round under way: wait for that one
		}
	}
	done := make(chan struct{})
	d.probing = done
	bg := context.WithoutCancel(ctx)
	go func() {
		defer close(done)
		d.registerNode(bg)
		d.notePools(bg)
	}()
	return done
}

// notePools logs each pool's change between usable and unusable (and the
// extra readiness checks', such as a mount stanza's), once per change.
func (d identityServer) notePools(ctx context.Context) {
	log := klog.FromContext(ctx)
	note := func(key string, err error) {
		prev, seen := d.poolState.Load(key)
		now := ""
		if err != nil {
			now = err.Error()
		}
		if seen && prev.(string) == now {
			return
		}
		d.poolState.Store(key, now)
		switch {
		case err != nil:
			log.Error(err, "Pool unavailable; its calls answer UNAVAILABLE until it is back, the other pools keep serving", "pool", key)
		case seen:
			log.Info("Pool available again", "pool", key)
		}
	}
	for _, name := range d.pools.Names() {
		_, err := health.CheckPoolReady(d.pools.Pool(name))
		note(name, err)
	}
	for i, check := range d.opts.Readiness {
		note(fmt.Sprintf("readiness-check-%d", i), check())
	}
}
