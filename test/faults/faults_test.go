package faults

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

const (
	degraded     = csi.VolumeHealthErrorType_DEGRADED
	inaccessible = csi.VolumeHealthErrorType_INACCESSIBLE
	dataLoss     = csi.VolumeHealthErrorType_DATA_LOSS
)

func TestFilesystemRemountedReadOnly(t *testing.T) {
	e := start(t, "")
	v := e.create("ro", "ext4", 64<<20)
	e.stage(v)
	e.publish(v)
	wantHealthy(t, e.nodeHealth(v))

	run(t, "mount", "-o", "remount,ro", v.target)
	h := e.nodeHealth(v)
	wantIssue(t, h, degraded, "FilesystemReadOnly", v.id, "read-only", "published read-write", "dmesg")

	run(t, "mount", "-o", "remount,rw", v.target)
	wantHealthy(t, e.nodeHealth(v))
}

func TestVolumeFilledPastThreshold(t *testing.T) {
	e := start(t, "")
	v := e.create("full", "ext4", 64<<20)
	e.stage(v)
	e.publish(v)
	wantHealthy(t, e.nodeHealth(v))

	filler := fill(t, v.target, 0.95)
	wantIssue(t, e.nodeHealth(v), degraded, "VolumeNearlyFull", v.id, "full", "threshold 90%", "Expand the PVC")

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	wantHealthy(t, e.nodeHealth(v))
}

func TestVolumeFullThresholdFlag(t *testing.T) {
	e := start(t, "", "--volume-full-threshold=50")
	v := e.create("half", "ext4", 64<<20)
	e.stage(v)
	e.publish(v)
	filler := fill(t, v.target, 0.6)
	wantIssue(t, e.nodeHealth(v), degraded, "VolumeNearlyFull", "threshold 50%")
	os.Remove(filler)
	wantHealthy(t, e.nodeHealth(v))
}

func TestPublishMountRemoved(t *testing.T) {
	e := start(t, "")
	v := e.create("gone", "ext4", 64<<20)
	e.stage(v)
	e.publish(v)
	wantHealthy(t, e.nodeHealth(v))

	run(t, "umount", v.target)
	wantIssue(t, e.nodeHealth(v), inaccessible, "PublishMountMissing", v.id, v.target, "not mounted", "Delete the pod")

	e.publish(v) // what kubelet does for the replacement pod
	wantHealthy(t, e.nodeHealth(v))
}

func TestStagingMountRemoved(t *testing.T) {
	e := start(t, "")
	v := e.create("stage-gone", "ext4", 64<<20)
	e.stage(v)
	wantHealthy(t, e.nodeHealth(&vol{id: v.id, staging: v.staging}))

	run(t, "umount", v.staging)
	wantIssue(t, e.nodeHealth(&vol{id: v.id, staging: v.staging}), inaccessible, "StagingMountMissing", v.staging)

	e.stage(v)
	wantHealthy(t, e.nodeHealth(&vol{id: v.id, staging: v.staging}))
}

func TestImageOfUnstagedVolumeTruncated(t *testing.T) {
	e := start(t, "")
	v := e.create("trunc", "ext4", 64<<20)
	wantHealthy(t, e.controllerHealth(v))
	if e.listedHealth(v) != nil {
		t.Fatal("a healthy volume is listed by ControllerListVolumeHealth")
	}

	if err := os.Truncate(v.image, 32<<20); err != nil {
		t.Fatal(err)
	}
	wantIssue(t, e.controllerHealth(v), dataLoss, "ImageTruncated", v.image, "33554432 bytes", "67108864 bytes", "restore the image")
	if h := e.listedHealth(v); h == nil {
		t.Fatal("ControllerListVolumeHealth does not list the truncated volume")
	} else {
		wantIssue(t, h, dataLoss, "ImageTruncated")
	}

	if err := os.Truncate(v.image, 64<<20); err != nil {
		t.Fatal(err)
	}
	wantHealthy(t, e.controllerHealth(v))
	if e.listedHealth(v) != nil {
		t.Fatal("the repaired volume is still listed as unhealthy")
	}
}

// Kubelet reads health only from the node (NodeGetVolumeStats), so the node must see an
// image cut short under a staged, published volume too, not only the controller.
func TestImageOfPublishedVolumeTruncated(t *testing.T) {
	e := start(t, "")
	v := e.create("trunc-node", "xfs", 300<<20)
	e.stage(v)
	e.publish(v)
	t.Cleanup(func() { e.unpublish(v); e.unstage(v) })
	wantHealthy(t, e.nodeHealth(v))
	if err := os.Truncate(v.image, 299<<20); err != nil {
		t.Fatal(err)
	}
	wantIssue(t, e.nodeHealth(v), dataLoss, "ImageTruncated", v.image, "313524224 bytes", "314572800 bytes")
	if err := os.Truncate(v.image, 300<<20); err != nil {
		t.Fatal(err)
	}
	wantHealthy(t, e.nodeHealth(v))
}

func TestImageDeleted(t *testing.T) {
	e := start(t, "")
	v := e.create("deleted", "ext4", 64<<20)
	backup := v.image + ".backup"
	if err := os.Rename(v.image, backup); err != nil { // the operator's backup of the image
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Rename(backup, v.image) })

	wantIssue(t, e.controllerHealth(v), dataLoss, "ImageMissing", v.image, "missing", "Restore the image")
	if h := e.listedHealth(v); h == nil {
		t.Fatal("ControllerListVolumeHealth does not list the volume whose image is gone")
	} else {
		wantIssue(t, h, dataLoss, "ImageMissing", v.image)
	}
	list, err := e.d.Controller().ListVolumes(ctx(t), &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetEntries()) != 1 || list.GetEntries()[0].GetVolume().GetVolumeId() != v.id {
		t.Fatalf("ListVolumes should still list the volume: %v", list)
	}
	// The node side sees the same when asked about the volume as a whole.
	wantIssue(t, e.nodeHealth(&vol{id: v.id}), dataLoss, "ImageMissing")

	if err := os.Rename(backup, v.image); err != nil {
		t.Fatal(err)
	}
	wantHealthy(t, e.controllerHealth(v))
	if e.listedHealth(v) != nil {
		t.Fatal("the restored volume is still listed as unhealthy")
	}
}

func TestBackingFileDeletedUnderStagedVolume(t *testing.T) {
	e := start(t, "")
	v := e.create("backing", "ext4", 64<<20)
	e.stage(v)
	e.publish(v)
	data := []byte("survives the repair\n")
	if err := os.WriteFile(filepath.Join(v.target, "data"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, "sync")
	backup := v.image + ".link"
	if err := os.Link(v.image, backup); err != nil { // a hard link stands for the operator's copy
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(backup) })
	if err := os.Remove(v.image); err != nil {
		t.Fatal(err)
	}
	wantIssue(t, e.nodeHealth(v), dataLoss, "BackingFileDeleted", v.image, "deleted", "dd if=/dev/loop")
	wantIssue(t, e.nodeHealth(&vol{id: v.id}), dataLoss, "BackingFileDeleted")

	// Repair: put the image back, then re-stage so the loop device uses the file at its path.
	if err := os.Link(backup, v.image); err != nil {
		t.Fatal(err)
	}
	e.unpublish(v)
	e.unstage(v)
	e.stage(v)
	e.publish(v)
	wantHealthy(t, e.nodeHealth(v))
	got, err := os.ReadFile(filepath.Join(v.target, "data"))
	if err != nil || string(got) != string(data) {
		t.Fatalf("data after repair: %q, %v", got, err)
	}
}

func TestMetadataUnreadable(t *testing.T) {
	e := start(t, "")
	v := e.create("meta", "ext4", 64<<20)
	meta := filepath.Join(filepath.Dir(v.image), "volume.json")
	good, err := os.ReadFile(meta)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(meta, []byte("{not json"), 0o640); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(meta, good, 0o640) })

	wantIssue(t, e.controllerHealth(v), inaccessible, "MetadataUnreadable", meta, "Restore volume.json")
	if e.listedHealth(v) == nil {
		t.Fatal("ControllerListVolumeHealth does not list the damaged volume")
	}
	list, err := e.d.Controller().ListVolumes(ctx(t), &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetEntries()) != 1 || list.GetEntries()[0].GetVolume().GetVolumeId() != v.id {
		t.Fatalf("ListVolumes should list the damaged volume: %v", list)
	}

	if err := os.WriteFile(meta, good, 0o640); err != nil {
		t.Fatal(err)
	}
	wantHealthy(t, e.controllerHealth(v))
}
