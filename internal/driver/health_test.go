package driver

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/poolcsi/poolcsi/internal/csilegacy"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// readLegacyCondition decodes the spec v1.12 volume_condition that
// setLegacyCondition writes as an unknown field; found is false without one.
func readLegacyCondition(t *testing.T, m proto.Message) (abnormal bool, message string, found bool) {
	t.Helper()
	raw := m.ProtoReflect().GetUnknown()
	for len(raw) > 0 {
		num, typ, n := protowire.ConsumeTag(raw)
		if n < 0 {
			t.Fatalf("bad unknown fields: %v", protowire.ParseError(n))
		}
		raw = raw[n:]
		if num != csilegacy.VolumeConditionField || typ != protowire.BytesType {
			n = protowire.ConsumeFieldValue(num, typ, raw)
			raw = raw[n:]
			continue
		}
		cond, n := protowire.ConsumeBytes(raw)
		raw = raw[n:]
		found = true
		for len(cond) > 0 {
			f, ft, n := protowire.ConsumeTag(cond)
			cond = cond[n:]
			switch {
			case f == 1 && ft == protowire.VarintType:
				v, n := protowire.ConsumeVarint(cond)
				abnormal, cond = protowire.DecodeBool(v), cond[n:]
			case f == 2 && ft == protowire.BytesType:
				s, n := protowire.ConsumeString(cond)
				message, cond = s, cond[n:]
			default:
				cond = cond[protowire.ConsumeFieldValue(f, ft, cond):]
			}
		}
	}
	return abnormal, message, found
}

// healthVolume is a volume staged (and, for a filesystem, published) on the
// fake node, with the paths a health call names.
type healthVolume struct {
	id, image, staging, target string
}

// TestNodeHealthReasons: every condition the node-side checks report, and the
// healthy case, caused on the fake kernel and read back through
// NodeGetVolumeHealth and through the legacy volume_condition kubelet reads
// from NodeGetVolumeStats.
func TestNodeHealthReasons(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		fs   string // "" for a block volume
		// upTo is how far the volume got before the cause: published unless
		// it says staged, or unstaged (staged, then unstaged again).
		upTo string
		// cause makes the condition behind the driver's back.
		cause func(t *testing.T, h *fake.Host, v healthVolume)
		// paths: which of staging and target the health call names.
		staging, target bool
		want            []string
		// in is a word the message must carry.
		in string
		// statsFail: NodeGetVolumeStats of the published volume fails (no
		// usage to report), so it carries no condition.
		statsFail bool
	}{
		{name: "healthy", fs: "ext4", staging: true, target: true},
		{name: "healthy, asked about the volume as a whole", fs: "ext4"},
		{name: "healthy block", staging: true, target: true},
		{name: "mount table unreadable", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { h.Faults.FailFrom("Table", 1, errInjected) },
			want:  []string{health.ReasonWrongMount}, in: "mount table"},
		{name: "staging unmounted", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { unmount(t, h, v.staging) },
			want:  []string{health.ReasonStagingMountMissing}, in: "staging path"},
		{name: "target unmounted", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { unmount(t, h, v.target) },
			want:  []string{health.ReasonPublishMountMissing}, statsFail: true},
		{name: "block device detached", upTo: "staged", staging: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) {
				if err := h.Detach(context.Background(), v.image); err != nil {
					t.Fatal(err)
				}
			},
			want: []string{health.ReasonLoopDeviceDetached}, in: "losetup -d", statsFail: true},
		{name: "loop device unreadable", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { h.Faults.FailFrom("Status", 1, errInjected) },
			want:  []string{health.ReasonLoopDeviceDetached}, in: errInjected.Error()},
		{name: "image missing, not staged", fs: "ext4", upTo: "unstaged",
			cause: func(t *testing.T, h *fake.Host, v healthVolume) {
				if err := os.Remove(v.image); err != nil {
					t.Fatal(err)
				}
			},
			want: []string{health.ReasonImageMissing}, statsFail: true},
		{name: "image deleted under its loop device", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) {
				if err := os.Remove(v.image); err != nil {
					t.Fatal(err)
				}
			},
			want: []string{health.ReasonImageMissing, health.ReasonBackingFileDeleted}, in: "dd if="},
		{name: "statfs fails", fs: "xfs", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { h.Faults.FailFrom("Statfs", 1, errInjected) },
			want:  []string{health.ReasonFilesystemIOError}, in: "repair tool", statsFail: true},
		{name: "filesystem remounted read-only", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { h.SetFilesystemReadOnly(v.staging) },
			want:  []string{health.ReasonFilesystemReadOnly}, in: "read-only"},
		{name: "ext4 errors recorded", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { h.SetFilesystemErrors(v.staging, 3, "ext4_lookup") },
			want:  []string{health.ReasonFilesystemErrors}, in: "3 errors (first in ext4_lookup)"},
		{name: "ext4 error count cleared", fs: "ext4", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) { h.SetFilesystemErrors(v.staging, 0, "") }},
		{name: "nearly full", fs: "xfs", staging: true, target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) {
				h.SetFilesystemUsage(v.staging, fake.Usage{Blocks: 0.95})
			},
			want: []string{health.ReasonVolumeNearlyFull}, in: "Expand the PVC"},
		{name: "inodes nearly used up", fs: "ext4", target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) {
				h.SetFilesystemUsage(v.staging, fake.Usage{Blocks: 0.1, Inodes: 0.95})
			},
			want: []string{health.ReasonInodesNearlyFull}, in: "inodes"},
		{name: "xfs allocates inodes as it goes", fs: "xfs", target: true,
			cause: func(t *testing.T, h *fake.Host, v healthVolume) {
				h.SetFilesystemUsage(v.staging, fake.Usage{Blocks: 0.1, Inodes: 0.95})
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			td := newTestDriver(t, testOpts{})
			vc := blockCap(rwo)
			if tt.fs != "" {
				vc = mountCap(rwo, tt.fs)
			}
			var v healthVolume
			v.id = td.create(t, "v", vc, nil)
			vid, err := pool.ParseVolumeID(v.id)
			if err != nil {
				t.Fatal(err)
			}
			v.image = td.pool.ImagePath(vid)
			v.staging = filepath.Join(td.root, "staging", v.id)
			v.target = filepath.Join(td.root, "target", v.id)
			if err := td.stage(v.id, vc); err != nil {
				t.Fatal(err)
			}
			switch tt.upTo {
			case "":
				if err := td.publish(v.id, vc, false); err != nil {
					t.Fatal(err)
				}
			case "unstaged":
				if _, err := td.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
					t.Fatal(err)
				}
			}
			if tt.cause != nil {
				tt.cause(t, td.host, v)
			}
			req := &csi.NodeGetVolumeHealthRequest{VolumeId: v.id}
			if tt.staging {
				req.StagingTargetPath = v.staging
			}
			if tt.target {
				req.VolumePublishPath = v.target
			}
			resp, err := td.NodeGetVolumeHealth(ctx, req)
			if err != nil {
				t.Fatalf("NodeGetVolumeHealth: %v", err)
			}
			var got, messages []string
			for _, s := range resp.GetVolumeHealth().GetHealthStatuses() {
				got = append(got, s.GetReason())
				messages = append(messages, s.GetMessage())
			}
			slices.Sort(got)
			want := slices.Sorted(slices.Values(tt.want))
			if !slices.Equal(got, want) {
				t.Fatalf("reasons %q, want %q: %s", got, want, strings.Join(messages, " | "))
			}
			if tt.in != "" && !strings.Contains(strings.Join(messages, " | "), tt.in) {
				t.Errorf("messages do not say %q: %s", tt.in, strings.Join(messages, " | "))
			}

			// kubelet's path: the same answer as the legacy condition of the
			// published volume's stats.
			if tt.upTo != "" {
				return
			}
			stats, err := td.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.id, VolumePath: v.target, StagingTargetPath: req.StagingTargetPath})
			if tt.statsFail {
				if err == nil {
					t.Error("NodeGetVolumeStats answered; the table says it cannot")
				}
				return
			}
			if err != nil {
				t.Fatalf("NodeGetVolumeStats: %v", err)
			}
			abnormal, message, found := readLegacyCondition(t, stats)
			if !found || abnormal != (len(tt.want) > 0) {
				t.Fatalf("legacy condition found=%v abnormal=%v (%s), want abnormal=%v", found, abnormal, message, len(tt.want) > 0)
			}
			for _, r := range tt.want {
				if !strings.Contains(message, r+": ") {
					t.Errorf("legacy condition %q does not name %s", message, r)
				}
			}
		})
	}
}

// unmount takes a mount away behind the driver's back.
func unmount(t *testing.T, h *fake.Host, target string) {
	t.Helper()
	if err := h.UnmountChecked(context.Background(), target, nil); err != nil {
		t.Fatal(err)
	}
}
