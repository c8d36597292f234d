package poolmount

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/poolcsi/poolcsi/internal/fsx"
	"github.com/poolcsi/poolcsi/internal/pool"
)

// DefaultShareDir is where the driver mounts the shares StorageClasses name,
// one directory per share, named after the share's pool.
const DefaultShareDir = "/var/lib/poolcsi/shares"

// BindType is the share type of a bind mount of a directory of the node
// (mount -o bind SOURCE): for tests and for a filesystem the node mounts by
// other means. It is not in the default allow-list.
const BindType = "bind"

// Share is what mounting one share takes: the share, and the options of the
// request that needs it.
type Share struct {
	Ref pool.ShareRef
	// Options come from the StorageClass (parameters, mountOptions) or from
	// a volume context that a StorageClass filled. Each is checked against
	// the share type's allow-list. They are recorded next to the mount
	// point once the share is mounted, so a later call that brings only a
	// volume ID mounts the share again the same way.
	Options []string
	// Sensitive come from the request's secrets: checked against the
	// type's allow-list too, masked in logs, never recorded.
	Sensitive []string
	// FromStorageClass says the options are a StorageClass's own (a
	// CreateVolume): only then do they replace recorded ones. A later
	// caller's options (a volume context, which a PersistentVolume carries)
	// never do, so a forged PV cannot change how a share is mounted.
	FromStorageClass bool
}

// record is <dir>/<pool>.json: which share the mount point <dir>/<pool> is
// for, and its non-secret options. It is on the node's own disk, never on the
// share, and lets a restarted driver find the shares it mounted. It is written
// only once the share is mounted and verified.
type record struct {
	Type    string   `json:"type"`
	Source  string   `json:"source"`
	Options []string `json:"options,omitempty"`
}

// Shares mounts shares under Dir on demand and never unmounts one that holds a
// pool: volumes staged from it may be in use, by this process or another
// (the controller and the node plugin of one machine share Dir).
type Shares struct {
	Dir     string
	Timeout time.Duration
	// Command is the mount program and CephFuse ceph-fuse's; tests replace
	// them.
	Command  string
	CephFuse string

	mu       sync.Mutex
	mounters map[string]*Mounter
}

// NewShares returns a share mounter over dir.
func NewShares(dir string, timeout time.Duration) (*Shares, error) {
	if !filepath.IsAbs(dir) || filepath.Clean(dir) != dir || dir == "/" {
		return nil, fmt.Errorf("share directory %q must be a clean absolute path other than /", dir)
	}
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	return &Shares{Dir: dir, Timeout: timeout, Command: "mount", CephFuse: "ceph-fuse", mounters: map[string]*Mounter{}}, nil
}

// Path is the mount point of a share.
func (s *Shares) Path(r pool.ShareRef) string { return filepath.Join(s.Dir, r.PoolName()) }

// RequireMount is true: a share's pool is used only where the share is mounted.
func (s *Shares) RequireMount() bool { return true }

// Check checks a share and its options against the share type's grammar,
// before anything is mounted or written.
func Check(sh Share) error {
	if err := CheckShare(sh.Ref); err != nil {
		return err
	}
	for _, o := range sh.Options {
		if err := CheckOption(sh.Ref.Type, o, false); err != nil {
			return err
		}
	}
	for _, o := range sh.Sensitive {
		if err := CheckOption(sh.Ref.Type, o, true); err != nil {
			return err
		}
	}
	return nil
}

// spec is the mount stanza of a share; keyfile is where a ceph-fuse mount
// finds its secret key.
func (s *Shares) spec(sh Share, keyfile string) Spec {
	spec := Spec{Type: sh.Ref.Type, Source: sh.Ref.Source, Options: sh.Options, Sensitive: sh.Sensitive, Timeout: s.Timeout.String()}
	switch sh.Ref.Type {
	case BindType:
		spec.Type = ""
		spec.Options = append([]string{"bind"}, sh.Options...)
	case "fuse.ceph":
		spec.command = func(target string) (string, []string, string) {
			args := cephFuseArgs(sh, keyfile, target)
			return s.CephFuse, args, strings.Join(args, " ")
		}
	}
	return spec
}

// cephFuseArgs is ceph-fuse's command line for a share of type fuse.ceph,
// built from the checked source and options only: monitors (-m) and path
// (-r) from the source, the client name (--id) and filesystem (--client_fs)
// from the options, the key from a file the driver wrote, the FUSE options
// with -o. No configuration file is read (-c /dev/null): nothing but this
// argv decides what ceph-fuse does.
func cephFuseArgs(sh Share, keyfile, target string) []string {
	i := strings.LastIndex(sh.Ref.Source, ":/")
	args := []string{"-c", "/dev/null", "-m", sh.Ref.Source[:i], "-r", sh.Ref.Source[i+1:]}
	var fuse []string
	for _, o := range sh.Options {
		k, v, _ := strings.Cut(o, "=")
		switch k {
		case "name":
			args = append(args, "--id", v)
		case "fs":
			args = append(args, "--client_fs", v)
		case "defaults":
		default:
			fuse = append(fuse, o)
		}
	}
	if keyfile != "" {
		args = append(args, "--keyfile", keyfile)
	}
	if len(fuse) > 0 {
		args = append(args, "-o", strings.Join(fuse, ","))
	}
	return append(args, target)
}

// secretOf returns the value of the sensitive option key, "" if none.
func secretOf(sh Share, key string) string {
	for _, o := range sh.Sensitive {
		if k, v, ok := strings.Cut(o, "="); ok && k == key {
			return v
		}
	}
	return ""
}

// Ensure mounts the share at its mount point unless it is mounted there
// already, and checks that what is mounted there is the share. mountedNow
// tells whether this call mounted it. Concurrent calls, in this process or in
// another sharing Dir, make one mount: they hold Dir's lock file while they
// look and mount. A mount that fails leaves nothing behind: no record, no
// mount point.
func (s *Shares) Ensure(ctx context.Context, sh Share) (path string, mountedNow bool, err error) {
	if err := Check(sh); err != nil {
		return "", false, err
	}
	name := sh.Ref.PoolName()
	path = s.Path(sh.Ref)
	if err := os.MkdirAll(s.Dir, 0o750); err != nil {
		return "", false, fmt.Errorf("share %s: %w", sh.Ref, err)
	}
	unlock, err := lockFile(ctx, filepath.Join(s.Dir, dirLock))
	if err != nil {
		return "", false, fmt.Errorf("share %s: %w", sh.Ref, err)
	}
	defer unlock()
	recPath := filepath.Join(s.Dir, name+".json")
	rec, recErr := readRecord(recPath)
	recorded := recErr == nil && rec.Type == sh.Ref.Type && rec.Source == sh.Ref.Source
	if recorded && !sh.FromStorageClass {
		sh.Options = rec.Options // a later caller's options never replace the recorded ones
	}
	writeRecord := func() error {
		if recorded && (!sh.FromStorageClass || slices.Equal(rec.Options, sh.Options)) {
			return nil
		}
		raw, _ := json.Marshal(record{Type: sh.Ref.Type, Source: sh.Ref.Source, Options: sh.Options})
		return fsx.WriteFilePath(recPath, append(raw, '\n'), true)
	}
	if mounted, err := mountinfo.Mounted(path); err == nil && mounted {
		if err := Verify(sh.Ref, path); err != nil {
			return "", false, err
		}
		return path, false, writeRecord()
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", false, fmt.Errorf("share %s: inspect %s: %w", sh.Ref, path, err)
	}
	var keyfile string
	if key := secretOf(sh, "secret"); key != "" && sh.Ref.Type == "fuse.ceph" {
		keyfile = filepath.Join(s.Dir, "."+name+".key")
		if err := fsx.WriteFilePath(keyfile, []byte(key), false); err != nil {
			return "", false, fmt.Errorf("share %s: write its key file: %w", sh.Ref, err)
		}
		// ceph-fuse reads the key once, at start.
		defer func() { _ = os.Remove(keyfile) }()
	}
	spec := s.spec(sh, keyfile)
	if err := spec.Validate(); err != nil {
		return "", false, fmt.Errorf("share %s: %w", sh.Ref, err)
	}
	m := s.mounter(name, path)
	m.setSpec(spec)
	if err := m.Ensure(ctx); err != nil {
		s.forget(name, path)
		return "", false, err
	}
	if err := Verify(sh.Ref, path); err != nil {
		return "", true, err
	}
	if err := writeRecord(); err != nil {
		return "", true, fmt.Errorf("share %s: %w", sh.Ref, err)
	}
	return path, true, nil
}

// dirLock is the lock file in Dir that every mount and release of a share
// holds: one file for all shares, so a share that turns out not to be one of
// ours (or whose mount fails) leaves no file of its own behind.
const dirLock = ".lock"

// forget removes what a share that is not mounted left under Dir: its mount
// point (an empty directory; never anything else) and its mounter.
func (s *Shares) forget(name, path string) {
	if mounted, err := mountinfo.Mounted(path); err == nil && !mounted {
		_ = os.Remove(path) // only an empty directory goes
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if m, ok := s.mounters[name]; ok && !m.busy() {
		delete(s.mounters, name)
	}
}

func (s *Shares) mounter(name, path string) *Mounter {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.mounters[name]
	if !ok {
		m = &Mounter{Pool: name, Path: path, Command: s.Command}
		s.mounters[name] = m
	}
	return m
}

// Release unmounts a share this driver mounted and found to hold no pool of
// its name (a volume ID named a share that is not one of ours), and forgets
// it: its record, its mount point. Nothing of a pool is ever there, so
// nothing is in use.
func (s *Shares) Release(ctx context.Context, r pool.ShareRef) error {
	path := s.Path(r)
	unlock, err := lockFile(ctx, filepath.Join(s.Dir, dirLock))
	if err != nil {
		return err
	}
	defer unlock()
	if mounted, err := mountinfo.Mounted(path); err == nil && mounted {
		if err := unix.Unmount(path, 0); err != nil {
			return fmt.Errorf("unmount share %s at %s: %w", r, path, err)
		}
	}
	_ = os.Remove(filepath.Join(s.Dir, r.PoolName()+".json"))
	s.forget(r.PoolName(), path)
	klog.FromContext(ctx).Info("Unmounted a share that holds no pool of its name", "share", r.String(), "path", path)
	return nil
}

// Recorded tells whether this node mounted share r before: its record is in
// Dir (written only after a mount of it succeeded and was verified).
func (s *Shares) Recorded(r pool.ShareRef) bool {
	rec, err := readRecord(filepath.Join(s.Dir, r.PoolName()+".json"))
	return err == nil && rec.Type == r.Type && rec.Source == r.Source
}

// Known returns the shares mounted under Dir (by this process before a
// restart, or by another process sharing Dir) that are what their records
// say, with their mount points.
func (s *Shares) Known() (map[pool.ShareRef]string, error) {
	out := map[pool.ShareRef]string{}
	recs, err := filepath.Glob(filepath.Join(s.Dir, "s-*.json"))
	if err != nil {
		return nil, err
	}
	for _, rp := range recs {
		name := strings.TrimSuffix(filepath.Base(rp), ".json")
		rec, err := readRecord(rp)
		if err != nil {
			klog.ErrorS(err, "Unreadable share record; ignored", "path", rp)
			continue
		}
		r := pool.ShareRef{Type: rec.Type, Source: rec.Source}
		if r.Validate() != nil || r.PoolName() != name {
			klog.InfoS("Share record does not name its share; ignored", "path", rp)
			continue
		}
		path := s.Path(r)
		if mounted, err := mountinfo.Mounted(path); err != nil || !mounted {
			continue // mounted again when a call needs it
		}
		if err := Verify(r, path); err != nil {
			klog.ErrorS(err, "Share mount point holds something else; not used", "share", r.String())
			continue
		}
		out[r] = path
	}
	return out, nil
}

// Verify checks that the filesystem mounted at path is the share: for a bind
// mount, the same directory as the source; for NFS, an nfs or nfs4 mount of
// that source; for CephFS, a ceph mount (the kernel shows the monitors its own
// way) or a ceph-fuse one; for any other type, a mount of that type. The
// mount point is one the driver made and mounted itself, so this guards
// against a mount point taken over by something else, not against the server.
func Verify(r pool.ShareRef, path string) error {
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		return fmt.Errorf("share %s: read mount table: %w", r, err)
	}
	if len(ms) == 0 {
		return fmt.Errorf("share %s: %s is not mounted", r, path)
	}
	m := ms[len(ms)-1] // the top mount is what a path lookup finds
	wrong := func(want string) error {
		return fmt.Errorf("share %s: %s holds %s %s, not %s", r, path, m.FSType, m.Source, want)
	}
	switch r.Type {
	case BindType:
		var a, b unix.Stat_t
		if err := unix.Stat(path, &a); err != nil {
			return fmt.Errorf("share %s: %w", r, err)
		}
		if err := unix.Stat(r.Source, &b); err != nil {
			return fmt.Errorf("share %s: %w", r, err)
		}
		if a.Dev != b.Dev || a.Ino != b.Ino {
			return wrong("a bind mount of " + r.Source)
		}
	case "nfs", "nfs4":
		if m.FSType != "nfs" && m.FSType != "nfs4" {
			return wrong("an NFS mount")
		}
		if strings.TrimSuffix(m.Source, "/") != strings.TrimSuffix(r.Source, "/") {
			return wrong(r.Source)
		}
	case "fuse.ceph":
		if m.FSType != "fuse.ceph-fuse" {
			return wrong("a ceph-fuse mount")
		}
	default:
		if m.FSType != r.Type {
			return wrong("a " + r.Type + " mount")
		}
	}
	return nil
}

// maxRecord bounds a share record: a type, a source and a few options.
const maxRecord = 64 << 10

func readRecord(path string) (record, error) {
	var rec record
	raw, err := fsx.ReadFileAt(path, maxRecord)
	if err != nil {
		return rec, err
	}
	if err := json.Unmarshal(raw, &rec); err != nil {
		return rec, fmt.Errorf("%s: %w", path, err)
	}
	return rec, nil
}

// lockFile takes an exclusive flock on path (on the node's own disk, so its
// open cannot hang as a share's can), waiting until ctx ends.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	if err := fsx.FlockContext(ctx, f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("lock %s: another mount of this share is under way: %w", path, err)
	}
	return func() { _ = f.Close() }, nil
}
