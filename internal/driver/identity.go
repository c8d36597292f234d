package driver

import (
	"context"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/poolcsi/poolcsi/internal/health"
)

func (d *Driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.opts.Name, VendorVersion: d.opts.Version}, nil
}

func (d *Driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
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
		})
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe is ready only when every pool is present, writable and not out of
// space; otherwise it names
// each broken pool and why, which the livenessprobe sidecar turns into a failing
// /healthz. It does a few system calls per pool and no I/O on volumes.
func (d *Driver) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	var problems []string
	for _, name := range d.poolNames {
		if _, err := health.CheckPoolReady(d.pools[name]); err != nil {
			problems = append(problems, err.Error())
		}
	}
	for _, check := range d.opts.Readiness {
		if err := check(); err != nil {
			problems = append(problems, err.Error())
		}
	}
	d.registerNode(ctx)
	if len(problems) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "not ready: %s", strings.Join(problems, "; "))
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
