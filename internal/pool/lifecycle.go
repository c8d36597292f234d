package pool

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
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
	IOLimits      IOLimits
	// Preallocate: the image is to be fully allocated (Images().Allocate, once
	// made); its bytes must fit now as well as under the overcommit policy.
	Preallocate bool
	Ephemeral   *EphemeralRecord
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
	// The pool lock covers the decision and the few system calls that
	// record it (a mkdir, the ledger, a volume.json): no scan, no mkfs.
	tx, end, err := p.Ledger().beginCreate(ctx)
	if err != nil {
		return nil, err
	}
	defer end()

	if v, err := p.Load(id); err == nil {
		if v.Name != spec.Name {
			return nil, fmt.Errorf("%w: key %s is taken by %q (hash collision)", ErrCorrupt, id.Key, v.Name)
		}
		return v, nil
	} else if !missing(err) {
		return nil, err
	}

	if err := tx.admit(spec.CapacityBytes, "a new volume"); err != nil {
		return nil, err
	}
	if spec.Preallocate {
		if err := tx.admitAllocation(spec.CapacityBytes, 0, "a new preallocated volume"); err != nil {
			return nil, err
		}
	}

	v := &Volume{
		ID:            id.String(),
		Name:          spec.Name,
		Pool:          p.cfg.Name,
		Layout:        spec.Layout,
		AccessType:    spec.AccessType,
		FSType:        spec.FSType,
		CapacityBytes: spec.CapacityBytes,
		State:         StateCreating,
		Parameters:    spec.Parameters,
		Topology:      spec.Topology,
		Source:        spec.Source,
		IOLimits:      spec.IOLimits,
		Preallocate:   spec.Preallocate,
		Ephemeral:     spec.Ephemeral,
		CreatedAt:     time.Now().UTC(),
	}
	if err := v.validate(); err != nil {
		return nil, fmt.Errorf("%w: volume %q: %w", ErrBadRange, spec.Name, err)
	}
	dir := p.Dir(id)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create volume %s: %w", id, err)
	}
	if err := p.files().touch(volumeRel(id, lockFile)); err != nil {
		return nil, err
	}
	// Counted before its record is written, as the pending entry: a crash
	// before the record is settled by the next transaction (which finds no
	// record and takes the count back); a crash before this write leaves the
	// volumes directory changed after the ledger's stamp, and the ledger is
	// rebuilt. Either way it never counts less than the records hold.
	if err := tx.applyStamped(func(l *ledger) {
		l.Volumes++
		l.ProvisionedBytes += v.CapacityBytes
		l.Pending = pending{Kind: pendingVolume, Key: id.Key, Bytes: v.CapacityBytes}
	}); err != nil {
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

// Prepare (re)creates the sparse image of a volume still in state creating.
// Whatever an interrupted attempt left (a half-written mkfs) holds no user data yet,
// so it is thrown away rather than trusted. The image is not fsynced here: the
// caller formats it (mkfs fsyncs what it wrote, the new size included) and
// calls Sync before MarkReady, so one fsync covers both.
func (im Images) Prepare(v *Volume) error {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return err
	}
	if v.State != StateCreating {
		return fmt.Errorf("volume %s is %s, not creating: refusing to recreate its image", id, v.State)
	}
	if err := im.p.files().checkDir(volumeRel(id)); err != nil {
		return err
	}
	path := im.p.ImagePath(id)
	if err := os.Remove(path); err != nil && !missing(err) {
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

// Sync makes a volume's image durable (its size and all it holds) before
// MarkReady records it ready. After mkfs, which fsyncs the image itself, it
// finds nothing left to write and costs almost nothing; it is here so that
// the guarantee does not rest on what mkfs does.
func (im Images) Sync(id VolumeID) error {
	// O_NONBLOCK: a FIFO put in the image's place must not hang the open.
	f, err := im.p.files().openBeneath(volumeRel(id, imageFile), unix.O_RDONLY|unix.O_NONBLOCK)
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

// PrepareFrom (re)makes the image of a volume still in state creating as a
// copy of the image file src (a snapshot's or another volume's), grown to the
// volume's capacity. It returns the copy method (CopyReflink or CopyFull).
func (im Images) PrepareFrom(ctx context.Context, v *Volume, src string) (string, error) {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return "", err
	}
	if v.State != StateCreating {
		return "", fmt.Errorf("volume %s is %s, not creating: refusing to recreate its image", id, v.State)
	}
	if err := im.p.files().checkDir(volumeRel(id)); err != nil {
		return "", err
	}
	path := im.p.ImagePath(id)
	if err := os.Remove(path); err != nil && !missing(err) {
		return "", fmt.Errorf("remove half-made image %s: %w", path, err)
	}
	return fsx.CopyImage(ctx, src, path, v.CapacityBytes)
}

// Discard removes the image of a volume still in state creating, after a
// step that made it failed: a half-made image holds no data and must not be
// left for anything to mistake for a volume.
func (im Images) Discard(v *Volume) error {
	id, err := ParseVolumeID(v.ID)
	if err != nil {
		return err
	}
	if v.State != StateCreating {
		return fmt.Errorf("volume %s is %s, not creating: refusing to discard its image", id, v.State)
	}
	if err := im.p.files().checkDir(volumeRel(id)); err != nil {
		return err
	}
	if err := os.Remove(im.p.ImagePath(id)); err != nil && !missing(err) {
		return fmt.Errorf("discard half-made image of volume %s: %w", id, err)
	}
	return nil
}

// Finish runs make on a volume still in state creating, holding the volume's
// lock from before it looks until make is done, and returns the volume as it
// then is. On a shared pool two controllers may both reserve one name (the
// second finds the first's record): only one makes the volume, the other waits
// for the lock, within ctx, and gets the finished volume. make formats, copies
// or lays out data, and ends with MarkReady. A volume deleted meanwhile is
// ErrNotFound.
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
	return p.save(v, true)
}

// Delete removes a volume's directory and everything in it. The directory is
// first renamed out of the volumes namespace (into the pool's trash), so a
// crash mid-delete never leaves a half-deleted volume that lists as present;
// a retry finishes the removal. It returns nil if the volume does not exist.
// The caller checks that nothing holds the volume (staged, published) before
// calling, and holds the volume's lock if it exists.
func (p *Pool) Delete(ctx context.Context, id VolumeID) error {
	return p.DeleteWith(ctx, id, nil)
}

// DeleteWith is Delete with a step that runs before the renamed-away volume is
// removed: a dir volume whose data is a btrfs subvolume deletes it there. The
// step gets the path the volume's data directory now has.
//
// Only the rename and the ledger's count are under the pool lock; the removal
// of the data, however large, is not.
func (p *Pool) DeleteWith(ctx context.Context, id VolumeID, before func(data string) error) error {
	var inTrash func(string) error
	if before != nil {
		inTrash = func(trash string) error { return before(filepath.Join(trash, dataDir)) }
	}
	tx, end, err := p.Ledger().begin(ctx)
	if err != nil {
		return err
	}
	v, lerr := p.Load(id)
	// The removal may be left to the trash's emptier (trash.go) when one
	// serves this pool and nothing is to be done after it: no step on the
	// data, no quota ID to give back once the data is gone.
	later := before == nil && (lerr != nil || v.Quota == nil) && p.trash.served()
	// A delete gives room back: on a full pool it may spend the reserve.
	var moved bool
	var ours []string
	err = p.Ledger().freeing(func() (err error) {
		var more []string
		moved, more, err = p.files().toTrash(volumesDir, id.Key, "v-", later)
		ours = append(ours, more...)
		return err
	})
	if err == nil && moved && lerr == nil {
		// The volumes directory changed, so a crash before this write
		// leaves an outdated ledger, which is rebuilt.
		err = p.Ledger().freeing(func() error {
			return tx.applyStamped(func(l *ledger) {
				l.Volumes--
				l.ProvisionedBytes -= v.CapacityBytes
			})
		})
	}
	end()
	if err != nil {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	// The rename is durable (toTrash synced both directories): the volume
	// is gone for every reader and stays gone after a crash, so what is left
	// is only removing its blocks, which need not delay the answer.
	if later && len(ours) > 0 && p.trash.queue(ours) {
		return nil
	}
	if err := p.files().emptyTrash("v-"+id.Key, ours, inTrash); err != nil {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	if lerr == nil && v.Quota != nil {
		p.QuotaIDs().release(v.Quota.Kind, v.Quota.ID, id.Key)
	}
	return nil
}

// toTrash renames parentRel/key, and what an older version's interrupted
// delete left of it (parentRel/.deleting-key), into the pool's trash, under a
// name of its own (prefix, key, a time), and returns those names. moved tells
// whether parentRel/key existed. The caller holds the pool lock: the rename
// changes parentRel, which the ledger stamps. With durable, both directories
// are synced after a rename, so the move survives a crash before the trash
// entry is removed (otherwise the removal's sync of the trash makes it so).
//
// Both directories are opened once, below the pool and through no link, and
// the rename acts on those descriptors: a link swapped in for either after the
// check (anyone may write a shared pool) cannot move a volume elsewhere.
func (fl files) toTrash(parentRel, key, prefix string, durable bool) (moved bool, ours []string, err error) {
	parent, err := fsx.OpenDir(fl.root, parentRel)
	if err != nil {
		return false, nil, unsafe(err)
	}
	defer parent.Close()
	// Nothing to move, nothing made: a delete of what is not there (a retry, a
	// hostile ID) leaves the pool as it was.
	var names []string
	for _, name := range []string{key, ".deleting-" + key} {
		var st unix.Stat_t
		if err := unix.Fstatat(int(parent.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return false, nil, nil
	}
	trash, err := fl.openTrash()
	if err != nil {
		return false, nil, err
	}
	defer trash.Close()
	for _, name := range names {
		dst := fmt.Sprintf("%s%s-%d", prefix, key, time.Now().UnixNano())
		err := unix.Renameat(int(parent.Fd()), name, int(trash.Fd()), dst)
		switch {
		case err == nil:
			moved = moved || name == key
			ours = append(ours, dst)
		case !errors.Is(err, unix.ENOENT):
			return moved, ours, fmt.Errorf("rename %s into %s: %w", filepath.Join(fl.root, parentRel, name), filepath.Join(fl.root, trashDir), err)
		}
	}
	if durable && len(ours) > 0 {
		// The source first: its entry's absence is what a reader sees.
		for _, d := range []*os.File{parent, trash} {
			if err := d.Sync(); err != nil {
				return moved, ours, fmt.Errorf("sync %s: %w", d.Name(), err)
			}
		}
	}
	return moved, ours, nil
}

// openTrash opens the pool's trash directory, making it first if need be.
func (fl files) openTrash() (*os.File, error) {
	root, err := fsx.OpenDir(fl.root, ".")
	if err != nil {
		return nil, unsafe(err)
	}
	defer root.Close()
	if err := unix.Mkdirat(int(root.Fd()), trashDir, 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("make %s: %w", filepath.Join(fl.root, trashDir), err)
	}
	trash, err := fsx.OpenDir(fl.root, trashDir)
	if err != nil {
		return nil, unsafe(err)
	}
	return trash, nil
}

// emptyTrash removes the trash entries ours, just renamed there, and every
// other entry of name (prefix and key) an interrupted delete left, unless a
// call (here or on another node) holds the lock file that moved with it: that
// call is removing it. before runs on each first. The entries are reached
// through the trash directory's descriptor (/proc/<pid>/fd/N/entry, a path a
// helper the step runs can use too), so a link swapped in for the trash
// directory cannot aim the removal elsewhere.
func (fl files) emptyTrash(name string, ours []string, before func(dir string) error) error {
	trash, err := fsx.OpenDir(fl.root, trashDir)
	if missing(err) {
		return nil
	}
	if err != nil {
		return unsafe(err)
	}
	defer trash.Close()
	des, err := trash.ReadDir(-1)
	if err != nil {
		return fmt.Errorf("read directory %s: %w", filepath.Join(fl.root, trashDir), err)
	}
	dir := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), trash.Fd())
	removed := false
	for _, de := range des {
		if !de.IsDir() || !strings.HasPrefix(de.Name(), name+"-") {
			continue
		}
		if !slices.Contains(ours, de.Name()) && lockHeld(fl.root, filepath.Join(trashDir, de.Name(), lockFile)) {
			continue
		}
		if before != nil {
			if err := before(filepath.Join(dir, de.Name())); err != nil {
				return err
			}
		}
		if err := removeTrashEntry(dir, de.Name()); err != nil {
			return err
		}
		removed = true
	}
	if removed {
		return trash.Sync()
	}
	return nil
}

// touch creates the pool file rel if it is missing (a link planted there is
// refused, never followed to create a file elsewhere).
func (fl files) touch(rel string) error {
	f, err := fsx.OpenRegular(fl.root, rel, unix.O_RDWR|unix.O_CREAT, 0o600)
	if err != nil {
		return fmt.Errorf("create %s: %w", filepath.Join(fl.root, rel), unsafe(err))
	}
	return f.Close()
}
