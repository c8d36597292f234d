// Package fake stands in for the node's kernel in the driver's unit tests: loop
// devices, filesystems, mounts and freezes kept in memory, over image files and
// directories that really exist (in a test's temporary directory), so the
// driver's handlers run without root. Faults injects an error at the Nth call
// of a method, to test the rollback paths that real devices cannot be made to
// take on demand.
//
// It models what the driver relies on, not the kernel: a mount is a record of
// what is shown at a target, and a bind of a mounted target shows what that
// target shows.
package fake

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/poolcsi/poolcsi/internal/cgroup"
	"github.com/poolcsi/poolcsi/internal/fsx"
	"github.com/poolcsi/poolcsi/internal/mount"
)

// Host is a fake node kernel. The zero value is not usable: call New.
type Host struct {
	mu      sync.Mutex
	next    int
	loops   map[string]string  // backing file -> device
	devices map[string]*device // device -> state
	fs      map[string]*filesystem
	mounts  map[string]*Mount // target -> what it shows
	frozen  map[string]bool   // by device
	// pods are the pods with a cgroup, and the I/O limits written there
	// by device (cgroups.go).
	pods   map[string]map[string]cgroup.Limits
	Faults *Faults
}

type device struct {
	backing string
	// id is the backing file's identity when attached; shown, if set, the
	// path the kernel shows for it now; unidentified, if set, why it cannot
	// be identified.
	id           struct{ dev, ino uint64 }
	shown        string
	unidentified error

	size     int64
	readOnly bool
	fenced   bool
}

// filesystem is what a mkfs left on a file (an image, or a loop device's
// backing file).
type filesystem struct {
	fsType string
	size   int64
	// born identifies the image file it was formatted on (inode and birth
	// time): a file made anew at the same path (a volume deleted and made
	// again, which may reuse the inode) is blank.
	born fileIdentity
	// What the health checks read, set by the test through the Set*
	// methods: a superblock made read-only, ext4's error count, usage.
	readOnly   bool
	errors     int64
	firstError string
	usage      *Usage
}

// Usage is the fraction of a fake filesystem's blocks and inodes in use.
type Usage struct{ Blocks, Inodes float64 }

// Mount is one fake mount: a filesystem on a device, a directory, or a block
// device node, shown at a target.
type Mount struct {
	Target   string
	Device   string // the loop device whose filesystem (or node) is shown
	Dir      string // the directory shown, for binds of plain directories
	FSType   string
	ReadOnly bool
	Block    bool
	Options  []string
}

// New returns an empty fake host.
func New() *Host {
	return &Host{
		loops:   map[string]string{},
		devices: map[string]*device{},
		fs:      map[string]*filesystem{},
		mounts:  map[string]*Mount{},
		frozen:  map[string]bool{},
		pods:    map[string]map[string]cgroup.Limits{},
		Faults:  &Faults{},
	}
}

// Mounts lists the fake mount table, sorted by target.
func (h *Host) Mounts() []Mount {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]Mount, 0, len(h.mounts))
	for _, m := range h.mounts {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Target < out[j].Target })
	return out
}

// Attached lists the backing files of the fake loop devices, sorted.
func (h *Host) Attached() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]string, 0, len(h.loops))
	for f := range h.loops {
		out = append(out, f)
	}
	sort.Strings(out)
	return out
}

// Frozen tells whether the filesystem shown at path is frozen.
func (h *Host) Frozen(path string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	m := h.mounts[filepath.Clean(path)]
	return m != nil && m.Device != "" && h.frozen[m.Device]
}

// mountedFS is the filesystem shown at target, or nil. Callers hold h.mu.
func (h *Host) mountedFS(target string) *filesystem {
	m := h.mounts[filepath.Clean(target)]
	if m == nil || m.Device == "" || m.Block {
		return nil
	}
	return h.fs[h.backingOf(m.Device)]
}

// SetFilesystemReadOnly makes the filesystem shown at target read-only behind
// the driver's back, as the kernel does after an error with
// errors=remount-ro: the superblock turns read-only, every mount keeps its
// own flag.
func (h *Host) SetFilesystemReadOnly(target string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if f := h.mountedFS(target); f != nil {
		f.readOnly = true
	}
}

// SetFilesystemErrors records errors in the filesystem shown at target, as
// ext4 counts them in its superblock; first is the function that hit the
// first one.
func (h *Host) SetFilesystemErrors(target string, count int64, first string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if f := h.mountedFS(target); f != nil {
		f.errors, f.firstError = count, first
	}
}

// SetFilesystemUsage fills the filesystem shown at target: Statfs reports
// those fractions of its blocks and inodes used (a tenth of the blocks and a
// few inodes until set).
func (h *Host) SetFilesystemUsage(target string, u Usage) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if f := h.mountedFS(target); f != nil {
		f.usage = &u
	}
}

// ---- loop devices

// resolveProc turns a /proc/<pid>/fd/<n> path into the file's own path, as
// the kernel does when it opens one.
func resolveProc(path string) string {
	if strings.HasPrefix(path, "/proc/") {
		if r, err := os.Readlink(path); err == nil {
			return filepath.Clean(r)
		}
	}
	return filepath.Clean(path)
}

func (h *Host) Attach(ctx context.Context, backingFile string) (string, error) {
	if err := h.Faults.hit("Attach"); err != nil {
		return "", err
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	file := resolveProc(backingFile)
	fi, err := os.Stat(file)
	if err != nil {
		return "", fmt.Errorf("attach %s: %w", file, err)
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("attach %s: not a regular file", file)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if dev, ok := h.loops[file]; ok {
		return dev, nil
	}
	dev := fmt.Sprintf("/dev/fakeloop%d", h.next)
	h.next++
	h.loops[file] = dev
	h.devices[dev] = &device{backing: file, size: fi.Size()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		h.devices[dev].id.dev, h.devices[dev].id.ino = st.Dev, st.Ino
	}
	return dev, nil
}

func (h *Host) Find(backingFile string) (string, bool, error) {
	if err := h.Faults.hit("Find"); err != nil {
		return "", false, err
	}
	// As mount.Loops.Find: by the identity of the file the path resolves
	// to (links followed), else, for a file gone, by the path.
	var st syscall.Stat_t
	statErr := syscall.Stat(resolveProc(backingFile), &st)
	h.mu.Lock()
	defer h.mu.Unlock()
	if statErr == nil {
		for _, dev := range h.loops {
			if d := h.devices[dev]; d != nil && !d.fenced && d.id.dev == st.Dev && d.id.ino == st.Ino {
				return dev, true, nil
			}
		}
	}
	dev, ok := h.loops[resolveProc(backingFile)]
	return dev, ok, nil
}

func (h *Host) Detach(ctx context.Context, backingFile string) error {
	if err := h.Faults.hit("Detach"); err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	file := resolveProc(backingFile)
	for fdev, d := range h.devices { // the fenced devices of the file nothing mounts
		if d.fenced && d.backing == file && !slices.ContainsFunc(slices.Collect(maps.Values(h.mounts)), func(m *Mount) bool { return m.Device == fdev }) {
			delete(h.devices, fdev)
		}
	}
	dev, ok := h.loops[file]
	if !ok {
		return nil
	}
	for _, m := range h.mounts {
		if m.Device == dev {
			return fmt.Errorf("detach %s: mounted at %s: %w", dev, m.Target, mount.ErrDeviceBusy)
		}
	}
	delete(h.loops, file)
	delete(h.devices, dev)
	return nil
}

func (h *Host) Refresh(dev string) error {
	if err := h.Faults.hit("Refresh"); err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok {
		return fmt.Errorf("refresh %s: no such device", dev)
	}
	fi, err := os.Stat(d.backing)
	if err != nil {
		return fmt.Errorf("refresh %s: %w", dev, err)
	}
	if !d.fenced {
		d.size = fi.Size()
	}
	return nil
}

func (h *Host) Status(dev string) (mount.LoopStatus, error) {
	if err := h.Faults.hit("Status"); err != nil {
		return mount.LoopStatus{}, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok {
		return mount.LoopStatus{}, fmt.Errorf("status %s: %w", dev, os.ErrNotExist)
	}
	_, err := os.Stat(d.backing)
	return mount.LoopStatus{Device: dev, BackingFile: d.backing, BackingDeleted: err != nil, DirectIO: true, SizeBytes: d.size}, nil
}

// List reports the fake loop devices as the kernel would: each backing
// file's identity as it was when attached (the kernel keeps the file open),
// the path the test made it show (LosePath) and whether it answers
// (SetUnidentified).
func (h *Host) List(time.Duration) ([]mount.LoopDevice, error) {
	if err := h.Faults.hit("List"); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]mount.LoopDevice, 0, len(h.devices))
	for dev, d := range h.devices {
		ld := mount.LoopDevice{Device: dev, Backing: d.backing, Dev: d.id.dev, Ino: d.id.ino, Fenced: d.fenced}
		if d.shown != "" {
			ld.Backing = d.shown
		}
		if d.unidentified != nil {
			ld.Dev, ld.Ino, ld.Err = 0, 0, d.unidentified
		}
		out = append(out, ld)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Device < out[j].Device })
	return out, nil
}

// LosePath makes the fake loop devices whose backing file is below dir show
// it without dir, as the kernel shows a file of a mount that was detached (a
// lazy unmount, a torn-down NFS client).
func (h *Host) LosePath(dir string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	prefix := strings.TrimSuffix(dir, "/") + "/"
	for _, d := range h.devices {
		if strings.HasPrefix(d.backing, prefix) {
			d.shown = "/" + strings.TrimPrefix(d.backing, prefix)
		}
	}
}

// SetUnidentified makes List unable to identify the backing file of the
// fake loop devices below dir, as when its filesystem fails or hangs.
func (h *Host) SetUnidentified(dir string, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	prefix := strings.TrimSuffix(dir, "/") + "/"
	for _, d := range h.devices {
		if strings.HasPrefix(d.backing, prefix) {
			d.unidentified = err
		}
	}
}

// Devices lists the fake loop devices, fenced or not, sorted.
func (h *Host) Devices() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Sorted(maps.Keys(h.devices))
}

// Fence makes a fake loop device map nothing, as the real one does.
func (h *Host) Fence(dev string) error {
	if err := h.Faults.hit("Fence"); err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok {
		return fmt.Errorf("fence %s: no such device", dev)
	}
	d.fenced, d.readOnly, d.size = true, true, 0
	if h.loops[d.backing] == dev {
		delete(h.loops, d.backing) // no attachment of the file any more
	}
	return nil
}

// DetachFenced detaches a fenced fake loop device that nothing mounts.
func (h *Host) DetachFenced(dev string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok || !d.fenced {
		return nil
	}
	for _, m := range h.mounts {
		if m.Device == dev {
			return fmt.Errorf("detach %s: mounted at %s: %w", dev, m.Target, mount.ErrDeviceBusy)
		}
	}
	delete(h.devices, dev)
	return nil
}

// Backs tells whether dev is a fake loop device (fenced or not) of backingFile.
func (h *Host) Backs(dev, backingFile string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	return ok && d.backing == resolveProc(backingFile)
}

// Fenced tells whether a fake loop device was fenced.
func (h *Host) Fenced(dev string) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok {
		return false, fmt.Errorf("fenced %s: no such device", dev)
	}
	return d.fenced, nil
}

// ---- block devices and filesystems on them

// backingOf resolves a device to its backing file; anything else is a file.
// Callers hold h.mu.
func (h *Host) backingOf(target string) string {
	if d, ok := h.devices[target]; ok {
		return d.backing
	}
	return resolveProc(target)
}

func (h *Host) Format(ctx context.Context, target, fsType string) error {
	if err := h.Faults.hit("Format"); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if !mount.SupportedFS(fsType) {
		return fmt.Errorf("format %s: unsupported filesystem %q", target, fsType)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	file := h.backingOf(target)
	if h.formatted(file) != nil {
		return fmt.Errorf("format %s: %w", target, mount.ErrAlreadyFormatted)
	}
	fi, err := os.Stat(file)
	if err != nil {
		return fmt.Errorf("format %s: %w", target, err)
	}
	h.fs[file] = &filesystem{fsType: fsType, size: fi.Size(), born: identity(file)}
	return nil
}

func (h *Host) DiskFormat(ctx context.Context, target string) (string, error) {
	if err := h.Faults.hit("DiskFormat"); err != nil {
		return "", err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if f := h.formatted(h.backingOf(target)); f != nil {
		return f.fsType, nil
	}
	return "", nil
}

func (h *Host) FilesystemSize(dev string) (string, int64, error) {
	if err := h.Faults.hit("FilesystemSize"); err != nil {
		return "", 0, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f, ok := h.fs[h.backingOf(dev)]
	if !ok {
		return "", 0, fmt.Errorf("%s: %w", dev, mount.ErrUnknownFS)
	}
	return f.fsType, f.size, nil
}

func (h *Host) Size(dev string) (int64, error) {
	if err := h.Faults.hit("Size"); err != nil {
		return 0, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok {
		return 0, fmt.Errorf("size of %s: %w", dev, os.ErrNotExist)
	}
	return d.size, nil
}

func (h *Host) ReadOnly(dev string) (bool, error) {
	if err := h.Faults.hit("ReadOnly"); err != nil {
		return false, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok {
		return false, fmt.Errorf("%s: %w", dev, os.ErrNotExist)
	}
	return d.readOnly, nil
}

func (h *Host) SetReadOnly(dev string, readOnly bool) error {
	if err := h.Faults.hit("SetReadOnly"); err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	if !ok {
		return fmt.Errorf("%s: %w", dev, os.ErrNotExist)
	}
	d.readOnly = readOnly
	return nil
}

func (h *Host) NeedResize(_ context.Context, dev, mountPath string) (bool, error) {
	if err := h.Faults.hit("NeedResize"); err != nil {
		return false, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	f, fok := h.fs[h.backingOf(dev)]
	if !ok || !fok {
		return false, fmt.Errorf("need resize %s: not a formatted device", dev)
	}
	return f.size < d.size, nil
}

func (h *Host) ResizeFS(ctx context.Context, dev, mountPath string) error {
	if err := h.Faults.hit("ResizeFS"); err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.devices[dev]
	f, fok := h.fs[h.backingOf(dev)]
	if !ok || !fok {
		return fmt.Errorf("resize %s: not a formatted device", dev)
	}
	mounted := false
	for _, m := range h.mounts {
		if m.Device == dev && !m.Block {
			mounted = true
			if m.ReadOnly && m.Target == filepath.Clean(mountPath) {
				return fmt.Errorf("resize %s: %s is mounted read-only", dev, mountPath)
			}
		}
	}
	if !mounted && f.fsType != "ext4" {
		return fmt.Errorf("resize %s: %s can only be grown while mounted", dev, f.fsType)
	}
	f.size = d.size
	return nil
}

// ---- mounts

func (h *Host) Info(target string) (mount.MountInfo, bool, error) {
	if err := h.Faults.hit("Info"); err != nil {
		return mount.MountInfo{}, false, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	m, ok := h.mounts[filepath.Clean(target)]
	if !ok {
		return mount.MountInfo{}, false, nil
	}
	src := m.Device
	if src == "" {
		src = m.Dir
	}
	return mount.MountInfo{Target: m.Target, Source: src, FSType: m.FSType, ReadOnly: m.ReadOnly, Options: slices.Clone(m.Options)}, true, nil
}

// conflict answers a mount at an occupied target: nil when it already shows
// the same thing the same way, ErrMountConflict otherwise. Callers hold h.mu.
func (h *Host) conflict(target string, want Mount) (bool, error) {
	m, ok := h.mounts[target]
	if !ok {
		return false, nil
	}
	if m.Device != want.Device || m.Dir != want.Dir || m.Block != want.Block {
		return false, fmt.Errorf("%s is mounted from something else: %w", target, mount.ErrMountConflict)
	}
	if m.ReadOnly != want.ReadOnly {
		return false, fmt.Errorf("%s is mounted with read-only=%t: %w", target, m.ReadOnly, mount.ErrMountConflict)
	}
	return true, nil
}

func (h *Host) Mount(ctx context.Context, source, target, fsType string, options []string) error {
	if err := h.Faults.hit("Mount"); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	target = filepath.Clean(target)
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.devices[source]; !ok {
		return fmt.Errorf("mount %s: no such device", source)
	}
	f, ok := h.fs[h.backingOf(source)]
	if !ok || f.fsType != fsType {
		return fmt.Errorf("mount %s on %s: wrong fs type, bad option, bad superblock", source, target)
	}
	want := Mount{Target: target, Device: source, FSType: fsType, ReadOnly: slices.Contains(options, "ro"), Options: slices.Clone(options)}
	if done, err := h.conflict(target, want); done || err != nil {
		return err
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return fmt.Errorf("mount: create target: %w", err)
	}
	h.mounts[target] = &want
	return nil
}

func (h *Host) Bind(ctx context.Context, source, target string, readOnly bool, options []string) error {
	if err := h.Faults.hit("Bind"); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	source, target = filepath.Clean(source), filepath.Clean(target)
	h.mu.Lock()
	defer h.mu.Unlock()
	want := Mount{Target: target, ReadOnly: readOnly, Options: slices.Clone(options)}
	if m, ok := h.mounts[source]; ok {
		want.Device, want.Dir, want.FSType, want.Block = m.Device, m.Dir, m.FSType, m.Block
	} else {
		source = resolveProc(source)
		fi, err := os.Stat(source)
		if err != nil {
			return fmt.Errorf("bind %s: %w", source, err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("bind %s: not a directory", source)
		}
		want.Dir = source
	}
	if done, err := h.conflict(target, want); done || err != nil {
		return err
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return fmt.Errorf("bind: create target: %w", err)
	}
	h.mounts[target] = &want
	return nil
}

func (h *Host) BindBlock(ctx context.Context, dev, target string, readOnly bool) error {
	if err := h.Faults.hit("BindBlock"); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	target = filepath.Clean(target)
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.devices[dev]; !ok {
		return fmt.Errorf("bind block %s: no such device", dev)
	}
	want := Mount{Target: target, Device: dev, ReadOnly: readOnly, Block: true, FSType: "devtmpfs"}
	if done, err := h.conflict(target, want); done || err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return fmt.Errorf("bind block: create parent: %w", err)
	}
	f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY, 0o640)
	if err != nil {
		return fmt.Errorf("bind block: create target: %w", err)
	}
	f.Close()
	h.mounts[target] = &want
	return nil
}

func (h *Host) UnmountChecked(ctx context.Context, target string, check func(mount.MountInfo) error) error {
	if err := h.Faults.hit("Unmount"); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if check != nil {
		if info, ok, _ := h.Info(target); ok {
			if err := check(info); err != nil {
				return err
			}
		}
	}
	target = filepath.Clean(target)
	h.mu.Lock()
	delete(h.mounts, target)
	h.mu.Unlock()
	fi, err := os.Lstat(target)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().IsRegular() && fi.Size() > 0 {
		return fmt.Errorf("remove %s: regular file with data: %w", target, unix.ENOTEMPTY)
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", target, err)
	}
	return nil
}

// Table lists the fake mounts as the kernel's mount table shows them, sorted
// by target (one mount per target, so the order shows nothing else). A
// device's filesystem has the loop major (7) and the device's number; a bound
// directory, the numbers of the filesystem it really is on.
func (h *Host) Table() ([]mount.MountEntry, error) {
	if err := h.Faults.hit("Table"); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]mount.MountEntry, 0, len(h.mounts))
	for _, m := range h.mounts {
		e := mount.MountEntry{Mountpoint: m.Target, Source: m.Device, Options: "rw", VFSOptions: "rw"}
		if m.ReadOnly {
			e.Options = "ro"
		}
		if len(m.Options) > 0 {
			e.Options += "," + strings.Join(m.Options, ",")
		}
		switch {
		case m.Device != "":
			e.Major = 7
			_, _ = fmt.Sscanf(strings.TrimPrefix(m.Device, "/dev/fakeloop"), "%d", &e.Minor)
			if f := h.fs[h.backingOf(m.Device)]; !m.Block && f != nil && (f.readOnly || h.onlyReadOnly(m.Device)) {
				e.VFSOptions = "ro"
			}
		default:
			e.Source = m.Dir
			var st unix.Stat_t
			if unix.Stat(m.Dir, &st) == nil {
				e.Major, e.Minor = int(unix.Major(st.Dev)), int(unix.Minor(st.Dev))
			}
		}
		out = append(out, e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Mountpoint < out[j].Mountpoint })
	return out, nil
}

// onlyReadOnly tells whether every mount of dev's filesystem is read-only:
// the kernel then mounted the superblock read-only. Callers hold h.mu.
func (h *Host) onlyReadOnly(dev string) bool {
	for _, m := range h.mounts {
		if m.Device == dev && !m.Block && !m.ReadOnly {
			return false
		}
	}
	return true
}

func (h *Host) MountPoints(dev string) ([]string, error) {
	if err := h.Faults.hit("MountPoints"); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for t, m := range h.mounts {
		if m.Device == dev {
			out = append(out, t)
		}
	}
	sort.Strings(out)
	return out, nil
}

func (h *Host) MountsBelow(dir string) ([]string, error) {
	if err := h.Faults.hit("MountsBelow"); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	dir = filepath.Clean(dir)
	var out []string
	for t := range h.mounts {
		if t == dir || strings.HasPrefix(t, dir+"/") {
			out = append(out, t)
		}
	}
	sort.Strings(out)
	return out, nil
}

func (h *Host) MountedElsewhere(data string, except ...string) (string, error) {
	if err := h.Faults.hit("MountedElsewhere"); err != nil {
		return "", err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	data = filepath.Clean(data)
	var out []string
	for t, m := range h.mounts {
		if m.Dir == data && !slices.Contains(except, t) {
			out = append(out, t)
		}
	}
	sort.Strings(out)
	if len(out) == 0 {
		return "", nil
	}
	return out[0], nil
}

// shows is what a path shows: its mount's device or directory, or itself.
// Callers hold h.mu.
func (h *Host) shows(path string) string {
	path = filepath.Clean(path)
	if m, ok := h.mounts[path]; ok {
		if m.Device != "" {
			return "device:" + m.Device
		}
		return m.Dir
	}
	return path
}

func (h *Host) SameDir(a, b string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.shows(a) == h.shows(b)
}

func (h *Host) OnDevice(path, dev string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	m, ok := h.mounts[filepath.Clean(path)]
	return ok && !m.Block && m.Device == dev
}

func (h *Host) IsDevice(path, dev string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if filepath.Clean(path) == dev {
		_, ok := h.devices[dev]
		return ok
	}
	m, ok := h.mounts[filepath.Clean(path)]
	return ok && m.Block && m.Device == dev
}

// ---- statfs and freezing

// Statfs reports a fake filesystem of the device's size, a tenth used, for a
// mounted image volume; for anything else, the real filesystem the path is on.
func (h *Host) Statfs(path string, st *unix.Statfs_t) error {
	if err := h.Faults.hit("Statfs"); err != nil {
		return err
	}
	h.mu.Lock()
	m, ok := h.mounts[filepath.Clean(path)]
	var f *filesystem
	if ok && m.Device != "" && !m.Block {
		f = h.fs[h.backingOf(m.Device)]
	}
	h.mu.Unlock()
	if f == nil {
		if err := unix.Statfs(path, st); err != nil {
			return fmt.Errorf("statfs %s: %w", path, err)
		}
		return nil
	}
	const bs = 4096
	*st = unix.Statfs_t{Bsize: bs, Blocks: uint64(f.size / bs), Files: 1 << 16}
	st.Bfree = st.Blocks * 9 / 10
	st.Ffree = st.Files - 11
	if u := f.usage; u != nil {
		st.Bfree = st.Blocks - uint64(float64(st.Blocks)*u.Blocks)
		st.Ffree = st.Files - uint64(float64(st.Files)*u.Inodes)
	}
	st.Bavail = st.Bfree
	return nil
}

// Ext4Errors reports the error count SetFilesystemErrors recorded on the
// ext4 filesystem of dev; like sysfs, it knows no other filesystem.
func (h *Host) Ext4Errors(dev string) (int64, string, error) {
	if err := h.Faults.hit("Ext4Errors"); err != nil {
		return 0, "", err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f, ok := h.fs[h.backingOf(dev)]
	if _, isDev := h.devices[dev]; !isDev || !ok || f.fsType != "ext4" {
		return 0, "", fmt.Errorf("ext4 errors of %s: %w", dev, os.ErrNotExist)
	}
	return f.errors, f.firstError, nil
}

// FreezeMount opens path below prefix as the real one does (openat2 without
// links, O_DIRECTORY: a link, a FIFO or a device there is refused, never
// opened), then freezes the filesystem of dev if a mount of it is at path.
// The freeze is the filesystem's, as the kernel's is: every mount of it shows
// frozen. The bound thaws it as the real one's does.
func (h *Host) FreezeMount(prefix, path, dev string, bound time.Duration) (mount.FrozenFS, error) {
	if err := h.Faults.hit("Freeze"); err != nil {
		return nil, err
	}
	if err := h.checkMountRoot(prefix, path, dev); err != nil {
		return nil, fmt.Errorf("freeze %s: %w", path, err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.frozen[dev] {
		return nil, fmt.Errorf("freeze %s: %w", path, unix.EBUSY)
	}
	hold := &hold{h: h, dev: dev}
	// Armed first, as the real one is; it takes h.mu, held until the freeze is done.
	hold.timer = time.AfterFunc(bound, hold.expire)
	h.frozen[dev] = true
	return hold, nil
}

func (h *Host) checkMountRoot(prefix, path, dev string) error {
	if prefix == "" {
		prefix = "/"
	}
	rel, err := filepath.Rel(prefix, path)
	if err != nil || !filepath.IsAbs(path) || filepath.Clean(path) != path || rel == ".." || strings.HasPrefix(rel, "../") {
		return fmt.Errorf("%w: %s is not a clean path below %s", mount.ErrNotTheMount, path, prefix)
	}
	f, err := fsx.OpenBeneath(prefix, rel, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("%w: %w", mount.ErrNotTheMount, err)
	}
	f.Close()
	h.mu.Lock()
	defer h.mu.Unlock()
	m := h.mounts[path]
	if m == nil || m.Device != dev || m.Block || m.Dir != "" {
		return fmt.Errorf("%w: %s does not show the filesystem of %s", mount.ErrNotTheMount, path, dev)
	}
	return nil
}

// hold is a fake freeze.
type hold struct {
	h               *Host
	dev             string
	timer           *time.Timer
	thawed, expired bool
}

func (f *hold) expire() {
	f.h.mu.Lock()
	defer f.h.mu.Unlock()
	if !f.thawed {
		delete(f.h.frozen, f.dev)
		f.thawed, f.expired = true, true
	}
}

func (f *hold) Expired() bool {
	f.h.mu.Lock()
	defer f.h.mu.Unlock()
	return f.expired
}

func (f *hold) Thaw() error {
	if err := f.h.Faults.hit("Thaw"); err != nil {
		return err
	}
	f.timer.Stop()
	f.h.mu.Lock()
	defer f.h.mu.Unlock()
	if !f.thawed {
		delete(f.h.frozen, f.dev)
		f.thawed = true
	}
	return nil
}

// ThawMount thaws the filesystem of dev if a mount of it is at path, checked
// as FreezeMount checks it.
func (h *Host) ThawMount(prefix, path, dev string) error {
	if err := h.Faults.hit("Thaw"); err != nil {
		return err
	}
	if err := h.checkMountRoot(prefix, path, dev); err != nil {
		return fmt.Errorf("thaw %s: %w", path, err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.frozen, dev)
	return nil
}

// FreezeDevice freezes the filesystem of dev behind the driver's back, as an
// earlier process that crashed while it held it frozen would leave it.
func (h *Host) FreezeDevice(dev string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.frozen[dev] = true
}

// Allocate allocates for real: images are real files in the test's directory,
// and the pool's accounting reads their blocks.
func (h *Host) Allocate(f *os.File, off, length int64) error {
	if err := h.Faults.hit("Allocate"); err != nil {
		return err
	}
	return mount.Allocate(f, off, length)
}

// formatted is the filesystem on file, nil when it has none: never one
// formatted on an earlier file of the same path. The caller holds mu.
func (h *Host) formatted(file string) *filesystem {
	f, ok := h.fs[file]
	if !ok {
		return nil
	}
	if id := identity(file); id != (fileIdentity{}) && f.born != (fileIdentity{}) && id != f.born {
		delete(h.fs, file)
		return nil
	}
	return f
}

type fileIdentity struct {
	ino  uint64
	born unix.StatxTimestamp
}

// identity is file's inode and birth time; zero when they cannot be read.
func identity(file string) fileIdentity {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, file, 0, unix.STATX_INO|unix.STATX_BTIME, &st); err != nil {
		return fileIdentity{}
	}
	return fileIdentity{ino: st.Ino, born: st.Btime}
}
