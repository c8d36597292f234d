package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/fsx"
)

// Spec is what a new volume is made of.
type Spec struct {
	Name          string
	Layout        Layout
	AccessType    AccessType
	FSType        string
	CapacityBytes int64
	Parameters    map[string]string
	Topology      map[string]string
	Source        *ContentSource
}

// Reserve finds or makes the volume named spec.Name: its directory, a volume.json in
// state creating and, for the image layout, a sparse image of the full size. The
// capacity check and the reservation happen under the pool lock, so two creates on
// two nodes cannot both take the last free bytes. The caller formats the image and
// then calls MarkReady; a volume still creating after a crash is handed back for
// the caller to finish.
func (p *Pool) Reserve(ctx context.Context, spec Spec) (*Volume, error) {
	if err := ValidateVolumeName(spec.Name); err != nil {
		return nil, err
	}
	id := p.NewID(spec.Name)
	// An unmounted shared pool must not grow a volumes/ tree on the root disk.
	if err := p.Check(); err != nil {
		return nil, err
	}
	unlock, err := p.LockPool(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()

	if v, err := p.Load(id); err == nil {
		if v.Name != spec.Name {
			return nil, fmt.Errorf("%w: key %s is taken by %q (hash collision)", ErrCorrupt, id.Key, v.Name)
		}
		return v, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}

	if err := p.admit(spec.CapacityBytes, "a new volume"); err != nil {
		return nil, err
	}

	v := &Volume{
		ID:            id.String(),
		Name:          spec.Name,
		Pool:          p.Name,
		Layout:        spec.Layout,
		AccessType:    spec.AccessType,
		FSType:        spec.FSType,
		CapacityBytes: spec.CapacityBytes,
		State:         StateCreating,
		Parameters:    spec.Parameters,
		Topology:      spec.Topology,
		Source:        spec.Source,
		CreatedAt:     time.Now().UTC(),
	}
	if err := v.validate(); err != nil {
		return nil, fmt.Errorf("%w: volume %q: %w", ErrBadRange, spec.Name, err)
	}
	dir := p.Dir(id)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create volume %s: %w", id, err)
	}
	if err := p.touch(volumeRel(id, lockFile)); err != nil {
		return nil, err
	}
	// The creating record need not survive a crash by itself: MarkReady's
	// durable write in the same directory makes it durable along with the
	// ready one, and before that nothing has been promised. If a crash loses
	// the rename, the directory has no volume.json, which the CO's retried
	// CreateVolume (it got no answer) handles as a new volume, remaking the
	// image, exactly as after a crash between the mkdir above and this write.
	// The temp file is still fsynced, so what survives is whole.
	if err := p.save(v, false); err != nil {
		return nil, err
	}
	return v, nil
}

// PrepareImage (re)creates the sparse image of a volume still in state creating.
// Whatever an interrupted attempt left (a half-written mkfs) holds no user data yet,
// so it is thrown away rather than trusted. The image is not fsynced here: the
// caller formats it (mkfs fsyncs what it wrote, the new size included) and
// calls SyncImage before MarkReady, so one fsync covers both.
func (p *Pool) PrepareImage(v *Volume) error {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return err
	}
	if v.State != StateCreating {
		return fmt.Errorf("volume %s is %s, not creating: refusing to recreate its image", id, v.State)
	}
	if err := p.checkDir(volumeRel(id)); err != nil {
		return err
	}
	path := p.ImagePath(id)
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove half-made image %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create image %s: %w", path, err)
	}
	defer f.Close()
	if err := f.Truncate(v.CapacityBytes); err != nil {
		return fmt.Errorf("size image %s to %d bytes: %w", path, v.CapacityBytes, err)
	}
	return f.Close()
}

// SyncImage makes a volume's image durable (its size and all it holds) before
// MarkReady records it ready. After mkfs, which fsyncs the image itself, it
// finds nothing left to write and costs almost nothing; it is here so that
// the guarantee does not rest on what mkfs does.
func (p *Pool) SyncImage(id VolumeID) error {
	// O_NONBLOCK: a FIFO put in the image's place must not hang the open.
	f, err := p.openBeneath(volumeRel(id, imageFile), unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return fmt.Errorf("stat %s: %w", f.Name(), err)
	} else if !fi.Mode().IsRegular() {
		return fmt.Errorf("%w: %s is not a regular file (%s)", ErrCorrupt, f.Name(), fi.Mode().Type())
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", f.Name(), err)
	}
	return nil
}

// PrepareImageFrom (re)makes the image of a volume still in state creating as a
// copy of the image file src (a snapshot's or another volume's), grown to the
// volume's capacity. It returns the copy method (CopyReflink or CopyFull).
func (p *Pool) PrepareImageFrom(ctx context.Context, v *Volume, src string) (string, error) {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return "", err
	}
	if v.State != StateCreating {
		return "", fmt.Errorf("volume %s is %s, not creating: refusing to recreate its image", id, v.State)
	}
	if err := p.checkDir(volumeRel(id)); err != nil {
		return "", err
	}
	path := p.ImagePath(id)
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("remove half-made image %s: %w", path, err)
	}
	return CopyImage(ctx, src, path, v.CapacityBytes)
}

// DiscardImage removes the image of a volume still in state creating, after a
// step that made it failed: a half-made image holds no data and must not be
// left for anything to mistake for a volume.
func (p *Pool) DiscardImage(v *Volume) error {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return err
	}
	if v.State != StateCreating {
		return fmt.Errorf("volume %s is %s, not creating: refusing to discard its image", id, v.State)
	}
	if err := p.checkDir(volumeRel(id)); err != nil {
		return err
	}
	if err := os.Remove(p.ImagePath(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("discard half-made image of volume %s: %w", id, err)
	}
	return nil
}

// Finish runs make on a volume still in state creating, holding the volume's
// lock from before it looks until make is done, and returns the volume as it
// then is. On a shared pool two controllers may both reserve one name (the
// second finds the first's record): only one makes the volume, the other waits
// for the lock, within ctx, and gets the finished volume. make formats, copies
// or lays out data, and ends with MarkReady. A volume deleted meanwhile wraps
// os.ErrNotExist.
func (p *Pool) Finish(ctx context.Context, id VolumeID, make func(*Volume) error) (*Volume, error) {
	unlock, err := p.LockVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := p.Load(id)
	if err != nil {
		return nil, err
	}
	if v.State == StateCreating {
		if err := make(v); err != nil {
			return nil, err
		}
	}
	return v, nil
}

// MarkReady records that the volume is complete.
func (p *Pool) MarkReady(v *Volume) error {
	v.State = StateReady
	return p.Save(v)
}

// Delete removes a volume's directory and everything in it. The directory is first
// renamed out of the volumes namespace, so a crash mid-delete never leaves a
// half-deleted volume that lists as present; leftovers are swept by Sweep.
// It returns nil if the volume does not exist. The caller checks that nothing holds
// the volume (staged, published) before calling.
func (p *Pool) Delete(ctx context.Context, id VolumeID) error {
	return p.DeleteWith(ctx, id, nil)
}

// DeleteWith is Delete with a step that runs before the renamed-away volume is
// removed: a dir volume whose data is a btrfs subvolume deletes it there. The
// step gets the path the volume's data directory now has.
func (p *Pool) DeleteWith(ctx context.Context, id VolumeID, before func(data string) error) error {
	unlock, err := p.LockPool(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	var inTrash func(string) error
	if before != nil {
		inTrash = func(trash string) error { return before(filepath.Join(trash, dataDir)) }
	}
	if err := removeRenamed(filepath.Join(p.Path, volumesDir), id.Key, inTrash); err != nil {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	return nil
}

// removeRenamed deletes parent/key by renaming it to parent/.deleting-key and
// then removing that, so a crash never leaves something half-deleted under its
// own name; a retry (parent/key gone, the renamed one still there) finishes the
// removal. before runs on the renamed directory first. key is a validated key
// and RemoveAll does not follow symlinks, so nothing outside parent/key is reached.
func removeRenamed(parent, key string, before func(dir string) error) error {
	trash := filepath.Join(parent, ".deleting-"+key)
	if err := os.Rename(filepath.Join(parent, key), trash); err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if _, err := os.Lstat(trash); err != nil {
			return nil // nothing is left
		}
	}
	if before != nil {
		if err := before(trash); err != nil {
			return err
		}
	}
	if err := os.RemoveAll(trash); err != nil {
		return err
	}
	return syncDir(parent)
}

// touch creates the pool file rel if it is missing (a link planted there is
// refused, never followed to create a file elsewhere).
func (p *Pool) touch(rel string) error {
	f, err := fsx.OpenRegular(p.Path, rel, unix.O_RDWR|unix.O_CREAT, 0o600)
	if err != nil {
		return fmt.Errorf("create %s: %w", filepath.Join(p.Path, rel), unsafe(err))
	}
	return f.Close()
}
