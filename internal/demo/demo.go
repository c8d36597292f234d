// Package demo walks one volume through the CSI calls Kubernetes makes, against
// a driver started in this process on a throw-away pool, and prints every call
// and its answer: a guided tour of CSI and of poolcsi's health reporting. It
// leaves no loop device, mount or file behind, also when a step fails.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/mount"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// Config of a demo run.
type Config struct {
	Out     io.Writer
	TempDir string // parent of the throw-away directory; "" is the system default
	FSType  string // xfs grows online here; ext4 needs CAP_SYS_RESOURCE for that
	Size    int64
	Version string
}

// ErrNotRoot is returned when the demo cannot attach loop devices or mount.
var ErrNotRoot = errors.New("poolcsi demo needs root: it attaches a loop device and mounts a filesystem, as the node plugin does; run it as root (sudo poolcsi demo)")

// Check tells whether this machine can run the demo, before anything is made.
func Check(fsType string) error {
	if os.Geteuid() != 0 {
		return ErrNotRoot
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return fmt.Errorf("poolcsi demo needs loop devices: %w", err)
	}
	for _, c := range []string{"mkfs." + fsType, "blkid", "mount", "umount"} {
		if _, err := exec.LookPath(c); err != nil {
			return fmt.Errorf("poolcsi demo needs the command %s: %w", c, err)
		}
	}
	return nil
}

type run struct {
	cfg      Config
	ctx      context.Context
	step     int
	ctrl     csi.ControllerClient
	node     csi.NodeClient
	id       csi.IdentityClient
	dir      string
	staging  string
	target   string
	volumeID string
}

// Run performs the walk-through. Cleanup runs whatever happened.
func Run(ctx context.Context, cfg Config) (err error) {
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	if cfg.FSType == "" {
		cfg.FSType = "xfs"
	}
	if cfg.Size == 0 {
		cfg.Size = 300 * pool.MiB
	}
	if err := Check(cfg.FSType); err != nil {
		return err
	}
	dir, err := os.MkdirTemp(cfg.TempDir, "poolcsi-demo-")
	if err != nil {
		return err
	}
	r := &run{cfg: cfg, ctx: ctx, dir: dir,
		staging: filepath.Join(dir, "kubelet", "staging"), target: filepath.Join(dir, "kubelet", "pod", "mount")}
	p, err := pool.Open(pool.Config{Name: "demo", Path: filepath.Join(dir, "pool")})
	if err != nil {
		return errors.Join(err, os.RemoveAll(dir))
	}
	d, err := driver.New(driver.Options{Name: "poolcsi.io", Version: cfg.Version, NodeID: "demo-node", Mode: driver.ModeAll, Pools: []*pool.Pool{p}})
	if err != nil {
		return errors.Join(err, os.RemoveAll(dir))
	}
	serveCtx, stop := context.WithCancel(context.Background())
	endpoint := "unix://" + filepath.Join(dir, "csi.sock")
	served := make(chan error, 1)
	go func() { served <- d.Serve(serveCtx, endpoint) }()
	defer func() {
		r.cleanup(p)
		stop()
		if serr := <-served; serr != nil && err == nil {
			err = serr
		}
		if rerr := os.RemoveAll(dir); rerr != nil && err == nil {
			err = rerr
		}
	}()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }() // a client connection holds nothing to lose
	r.ctrl, r.node, r.id = csi.NewControllerClient(conn), csi.NewNodeClient(conn), csi.NewIdentityClient(conn)
	// The driver listens in its own goroutine: wait until its socket serves
	// before the first call, which does not wait.
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err = r.id.Probe(wctx, &csi.ProbeRequest{}, grpc.WaitForReady(true))
	cancel()
	if err != nil {
		return fmt.Errorf("the demo's driver did not start: %w", err)
	}
	r.say("poolcsi demo: one volume through the calls Kubernetes makes, on a throw-away pool in %s\n", dir)
	return r.walk()
}

func (r *run) say(format string, args ...any) { fmt.Fprintf(r.cfg.Out, format, args...) }

var marshal = protojson.MarshalOptions{EmitUnpopulated: false}

// call prints who makes the call and why, the request and the answer.
func (r *run) call(who, method, why string, req proto.Message, do func(context.Context) (proto.Message, error)) (proto.Message, error) {
	r.step++
	r.say("\n%2d. %s -> %s\n    why:      %s\n    request:  %s\n", r.step, who, method, why, marshal.Format(req))
	ctx, cancel := context.WithTimeout(r.ctx, 2*time.Minute)
	defer cancel()
	resp, err := do(ctx)
	if err != nil {
		r.say("    answer:   %s: %s\n", status.Code(err), status.Convert(err).Message())
		return nil, err
	}
	r.say("    answer:   %s\n", marshal.Format(resp))
	return resp, nil
}

func (r *run) shell(why string, args ...string) error {
	r.step++
	r.say("\n%2d. operator$ %s\n    why:      %s\n", r.step, strings.Join(args, " "), why)
	out, err := exec.CommandContext(r.ctx, args[0], args[1:]...).CombinedOutput()
	if len(out) > 0 {
		r.say("    output:   %s\n", strings.TrimSpace(string(out)))
	}
	if err != nil {
		return fmt.Errorf("%s: %w", strings.Join(args, " "), err)
	}
	return nil
}

func (r *run) capability() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: r.cfg.FSType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

func (r *run) walk() error {
	if _, err := r.call("kubelet (plugin registration)", "GetPluginInfo", "learn the driver's name and version",
		&csi.GetPluginInfoRequest{}, func(ctx context.Context) (proto.Message, error) {
			return r.id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		}); err != nil {
		return err
	}
	if _, err := r.call("livenessprobe sidecar", "Probe", "every few seconds: is the driver serving? (always ready: a broken pool fails its own calls, it does not fail Probe)",
		&csi.ProbeRequest{}, func(ctx context.Context) (proto.Message, error) {
			return r.id.Probe(ctx, &csi.ProbeRequest{})
		}); err != nil {
		return err
	}
	create := &csi.CreateVolumeRequest{
		Name:               "pvc-demo",
		CapacityRange:      &csi.CapacityRange{RequiredBytes: r.cfg.Size},
		VolumeCapabilities: []*csi.VolumeCapability{r.capability()},
		Parameters:         map[string]string{"pool": "demo", "layout": "image", "fsType": r.cfg.FSType},
	}
	resp, err := r.call("external-provisioner", "CreateVolume", "a PVC was created: make a sparse image and format it",
		create, func(ctx context.Context) (proto.Message, error) { return r.ctrl.CreateVolume(ctx, create) })
	if err != nil {
		return err
	}
	r.volumeID = resp.(*csi.CreateVolumeResponse).GetVolume().GetVolumeId()
	if err := r.controllerHealth("right after creation"); err != nil {
		return err
	}
	stage := &csi.NodeStageVolumeRequest{VolumeId: r.volumeID, StagingTargetPath: r.staging, VolumeCapability: r.capability()}
	if _, err := r.call("kubelet", "NodeStageVolume", "a pod using the PVC was scheduled here: attach a loop device and mount the filesystem once per node",
		stage, func(ctx context.Context) (proto.Message, error) { return r.node.NodeStageVolume(ctx, stage) }); err != nil {
		return err
	}
	publish := &csi.NodePublishVolumeRequest{VolumeId: r.volumeID, StagingTargetPath: r.staging, TargetPath: r.target, VolumeCapability: r.capability()}
	if _, err := r.call("kubelet", "NodePublishVolume", "bind-mount the staged filesystem into the pod's directory",
		publish, func(ctx context.Context) (proto.Message, error) { return r.node.NodePublishVolume(ctx, publish) }); err != nil {
		return err
	}
	if err := r.write(); err != nil {
		return err
	}
	if err := r.expand(); err != nil {
		return err
	}
	stats := &csi.NodeGetVolumeStatsRequest{VolumeId: r.volumeID, VolumePath: r.target, StagingTargetPath: r.staging}
	if _, err := r.call("kubelet (every minute)", "NodeGetVolumeStats", "usage for the kubelet_volume_stats_* metrics",
		stats, func(ctx context.Context) (proto.Message, error) { return r.node.NodeGetVolumeStats(ctx, stats) }); err != nil {
		return err
	}
	if err := r.snapshot(); err != nil {
		return err
	}
	if err := r.fault(); err != nil {
		return err
	}
	unpublish := &csi.NodeUnpublishVolumeRequest{VolumeId: r.volumeID, TargetPath: r.target}
	if _, err := r.call("kubelet", "NodeUnpublishVolume", "the pod was deleted: remove its bind mount",
		unpublish, func(ctx context.Context) (proto.Message, error) { return r.node.NodeUnpublishVolume(ctx, unpublish) }); err != nil {
		return err
	}
	unstage := &csi.NodeUnstageVolumeRequest{VolumeId: r.volumeID, StagingTargetPath: r.staging}
	if _, err := r.call("kubelet", "NodeUnstageVolume", "no pod on this node uses the volume any more: unmount and detach the loop device",
		unstage, func(ctx context.Context) (proto.Message, error) { return r.node.NodeUnstageVolume(ctx, unstage) }); err != nil {
		return err
	}
	del := &csi.DeleteVolumeRequest{VolumeId: r.volumeID}
	if _, err := r.call("external-provisioner", "DeleteVolume", "the PVC was deleted (reclaim policy Delete): remove the image and its metadata",
		del, func(ctx context.Context) (proto.Message, error) { return r.ctrl.DeleteVolume(ctx, del) }); err != nil {
		return err
	}
	r.volumeID = ""
	r.say("\nDone: the volume went through its whole life; nothing is left behind.\n")
	return nil
}

// snapshot cuts a snapshot of the mounted volume and deletes it again, as the
// external-snapshotter does for a VolumeSnapshot.
func (r *run) snapshot() error {
	create := &csi.CreateSnapshotRequest{Name: "snapshot-demo", SourceVolumeId: r.volumeID}
	resp, err := r.call("external-snapshotter", "CreateSnapshot", "a VolumeSnapshot was created: freeze the filesystem staged here, copy the image (reflink where the pool can), thaw",
		create, func(ctx context.Context) (proto.Message, error) { return r.ctrl.CreateSnapshot(ctx, create) })
	if err != nil {
		return err
	}
	del := &csi.DeleteSnapshotRequest{SnapshotId: resp.(*csi.CreateSnapshotResponse).GetSnapshot().GetSnapshotId()}
	_, err = r.call("external-snapshotter", "DeleteSnapshot", "the VolumeSnapshot was deleted: remove the copy",
		del, func(ctx context.Context) (proto.Message, error) { return r.ctrl.DeleteSnapshot(ctx, del) })
	return err
}

func (r *run) write() error {
	r.step++
	file := filepath.Join(r.target, "hello.txt")
	r.say("\n%2d. pod writes %s\n", r.step, file)
	data := []byte("written by the demo pod at " + time.Now().UTC().Format(time.RFC3339) + "\n")
	f, err := os.OpenFile(file, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	r.say("    wrote %d bytes and fsynced them through the loop device into the image\n", len(data))
	return nil
}

// expand grows the volume online by a third, as the external-resizer and
// kubelet do after the PVC's request is raised. A build without expansion
// answers Unimplemented; the demo shows that answer and goes on.
func (r *run) expand() error {
	newSize := r.cfg.Size + r.cfg.Size/3
	newSize = (newSize + pool.MiB - 1) / pool.MiB * pool.MiB
	cexp := &csi.ControllerExpandVolumeRequest{VolumeId: r.volumeID, CapacityRange: &csi.CapacityRange{RequiredBytes: newSize}, VolumeCapability: r.capability()}
	resp, err := r.call("external-resizer", "ControllerExpandVolume", "the PVC's storage request was raised: grow the image file",
		cexp, func(ctx context.Context) (proto.Message, error) { return r.ctrl.ControllerExpandVolume(ctx, cexp) })
	if err != nil && status.Code(err) != codes.Unimplemented {
		return err
	}
	if err == nil && !resp.(*csi.ControllerExpandVolumeResponse).GetNodeExpansionRequired() {
		return nil
	}
	nexp := &csi.NodeExpandVolumeRequest{VolumeId: r.volumeID, VolumePath: r.target, StagingTargetPath: r.staging,
		CapacityRange: &csi.CapacityRange{RequiredBytes: newSize}, VolumeCapability: r.capability()}
	_, err = r.call("kubelet", "NodeExpandVolume", "grow the loop device and the mounted filesystem, online",
		nexp, func(ctx context.Context) (proto.Message, error) { return r.node.NodeExpandVolume(ctx, nexp) })
	if status.Code(err) == codes.Unimplemented {
		r.say("    (this build cannot expand volumes yet; the demo goes on)\n")
		return nil
	}
	return err
}

func (r *run) controllerHealth(when string) error {
	req := &csi.ControllerGetVolumeHealthRequest{VolumeId: r.volumeID}
	_, err := r.call("external-health-monitor controller", "ControllerGetVolumeHealth", "check the volume's data in the pool "+when,
		req, func(ctx context.Context) (proto.Message, error) { return r.ctrl.ControllerGetVolumeHealth(ctx, req) })
	return err
}

func (r *run) nodeHealth(why string) (*csi.VolumeHealth, error) {
	req := &csi.NodeGetVolumeHealthRequest{VolumeId: r.volumeID, VolumePublishPath: r.target, StagingTargetPath: r.staging}
	resp, err := r.call("kubelet (volume health)", "NodeGetVolumeHealth", why,
		req, func(ctx context.Context) (proto.Message, error) { return r.node.NodeGetVolumeHealth(ctx, req) })
	if err != nil {
		return nil, err
	}
	return resp.(*csi.NodeGetVolumeHealthResponse).GetVolumeHealth(), nil
}

// fault remounts the pod's view read-only behind the driver's back, as the
// kernel does after filesystem errors, shows the health check catch it, and
// repairs it.
func (r *run) fault() error {
	if h, err := r.nodeHealth("before the fault: expect no health statuses"); err != nil {
		return err
	} else if len(h.GetHealthStatuses()) != 0 {
		return fmt.Errorf("volume unhealthy before the fault: %v", h)
	}
	if err := r.shell("inject a fault: the filesystem becomes read-only, as after errors=remount-ro", "mount", "-o", "remount,ro", r.target); err != nil {
		return err
	}
	h, err := r.nodeHealth("after the fault: expect FilesystemReadOnly")
	if err != nil {
		return err
	}
	if !hasReason(h, "FilesystemReadOnly") {
		return fmt.Errorf("the read-only filesystem was not reported: %v", h)
	}
	if err := r.shell("repair: make it writable again", "mount", "-o", "remount,rw", r.target); err != nil {
		return err
	}
	h, err = r.nodeHealth("after the repair: expect no health statuses again (nothing is cached)")
	if err != nil {
		return err
	}
	if len(h.GetHealthStatuses()) != 0 {
		return fmt.Errorf("volume still unhealthy after the repair: %v", h)
	}
	return nil
}

func hasReason(h *csi.VolumeHealth, reason string) bool {
	for _, s := range h.GetHealthStatuses() {
		if s.GetReason() == reason {
			return true
		}
	}
	return false
}

// cleanup undoes whatever a failed walk left: the CSI calls first (they are
// idempotent), then by hand anything they could not remove, only inside dir.
func (r *run) cleanup(p *pool.Pool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if r.volumeID != "" {
		r.say("\n(cleaning up after a failed step)\n")
		// Each step is tried whatever the one before answered; what they
		// leave is removed by hand below.
		if _, err := r.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: r.volumeID, TargetPath: r.target}); err != nil {
			r.say("  NodeUnpublishVolume: %v\n", err)
		}
		if _, err := r.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: r.volumeID, StagingTargetPath: r.staging}); err != nil {
			r.say("  NodeUnstageVolume: %v\n", err)
		}
		if _, err := r.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: r.volumeID}); err != nil {
			r.say("  DeleteVolume: %v\n", err)
		}
	}
	for _, m := range []string{r.target, r.staging} {
		for i := 0; i < 4 && unix.Unmount(m, 0) == nil; i++ {
		}
	}
	if r.volumeID != "" {
		if loops, err := mount.NewLoops(); err == nil {
			if vid, err := pool.ParseVolumeID(r.volumeID); err == nil {
				if err := loops.Detach(ctx, p.ImagePath(vid)); err != nil {
					r.say("  detach: %v\n", err)
				}
			}
		}
	}
}
