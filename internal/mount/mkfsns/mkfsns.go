// Package mkfsns runs mkfs so that a dead mount elsewhere on the node cannot
// fail it.
//
// mkfs.btrfs (btrfs-progs) checks that its target is not mounted by walking
// every entry of /proc/self/mounts, stat-ing each source and, for loop
// devices, each backing file; one error other than "does not exist" aborts the
// whole mkfs ("cannot check mount status"); mkfs.ext4 stats them too, and
// mkfs.xfs stats mount points. A shared pool whose FUSE client died leaves
// exactly such entries: the fence deliberately keeps the loop devices of its
// images attached (and mounted), and their backing files then answer
// ENOTCONN; one whose client hangs leaves backing files whose stat never
// returns, which hung every btrfs and ext4 mkfs on the node. One lost pool
// must not stop new volumes on every other pool, so when the host shows such
// mounts (a stat that fails, or has not answered within statWait), mkfs runs
// in a private copy of the mount namespace from which only those mounts are
// lazily detached. Every other mount, and every mount of the target itself
// however slow, stays visible to mkfs's check, and the host's namespace is
// never changed.
package mkfsns

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// Run runs the mkfs command name with args, target being the path it
// formats, and returns its combined output. See the package comment.
func Run(ctx context.Context, target, name string, args ...string) ([]byte, error) {
	dead, err := unreachableMounts(ctx)
	if err != nil || len(dead) == 0 {
		if err != nil {
			klog.FromContext(ctx).V(2).Info("Cannot list mounts; running mkfs in the host's mount namespace", "err", err)
		}
		return exec.CommandContext(ctx, name, args...).CombinedOutput()
	}
	if dead = sparing(dead, target); len(dead) == 0 {
		return exec.CommandContext(ctx, name, args...).CombinedOutput()
	}
	klog.FromContext(ctx).V(2).Info("Running mkfs without the unreachable mounts", "target", target, "mountpoints", dead)
	type result struct {
		out []byte
		err error
	}
	done := make(chan result, 1)
	// The namespace is unshared by one OS thread only, which this goroutine
	// keeps locked until it exits: the runtime then ends the thread instead
	// of reusing it, and new threads are made from a clean template thread.
	go func() {
		runtime.LockOSThread()
		out, err := runIsolated(ctx, target, dead, name, args)
		done <- result{out, err}
	}()
	r := <-done
	return r.out, r.err
}

// runIsolated runs on a locked thread that it moves into a private mount
// namespace.
func runIsolated(ctx context.Context, target string, dead []string, name string, args []string) ([]byte, error) {
	before, err := os.Stat(target)
	if err != nil {
		return nil, fmt.Errorf("stat mkfs target: %w", err)
	}
	// Without the right to (no CAP_SYS_ADMIN), mkfs runs as it always did:
	// only mkfs.btrfs needs the dead mounts gone, and it reports them.
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		klog.FromContext(ctx).V(2).Info("Cannot unshare the mount namespace for mkfs; running it in the host's", "err", err)
		return exec.CommandContext(ctx, name, args...).CombinedOutput()
	}
	// Private before anything is detached: a shared mount's unmount would
	// otherwise propagate to the host.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		klog.FromContext(ctx).V(2).Info("Cannot make mkfs's mount namespace private; detaching nothing", "err", err)
		return exec.CommandContext(ctx, name, args...).CombinedOutput()
	}
	for _, mp := range dead {
		// A mount already gone with a detached parent answers EINVAL or
		// ENOENT; one that cannot be detached is left to mkfs to judge.
		if err := unix.Unmount(mp, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil {
			klog.FromContext(ctx).V(4).Info("Cannot detach unreachable mount for mkfs", "mountpoint", mp, "err", err)
		}
	}
	// The target must be the same file it was in the host's namespace: a
	// detached mount must never make mkfs format something else.
	after, err := os.Stat(target)
	if err != nil {
		return nil, fmt.Errorf("mkfs target after detaching the unreachable mounts %v: %w", dead, err)
	}
	if !os.SameFile(before, after) {
		return nil, fmt.Errorf("mkfs target %s is another file once the unreachable mounts %v are detached", target, dead)
	}
	return exec.CommandContext(ctx, name, args...).CombinedOutput()
}

// scanTimeout bounds the scan: a paused FUSE daemon can block a stat for as
// long as it stays paused.
// Variables for the tests.
var (
	scanTimeout = 5 * time.Second
	scanFunc    = scanMounts
)

// scan is the one scan in flight: callers share it, so a scan blocked on a
// paused FUSE holds one goroutine, not one per mkfs, and delays each mkfs
// by at most what is left of its scanTimeout.
var scan struct {
	sync.Mutex
	cur *scanRun
}

type scanRun struct {
	deadline time.Time
	done     chan struct{} // closed when dead and err are set
	dead     []string
	err      error
}

// unreachableMounts returns the mount points of the host's mounts whose
// source or loop backing file (what btrfs-progs stats) cannot be stat-ed for
// a reason other than not existing, deepest first. A scan still blocked after
// scanTimeout is given up (its goroutine ends when the stat returns) and mkfs
// runs as it always did.
func unreachableMounts(ctx context.Context) ([]string, error) {
	scan.Lock()
	r := scan.cur
	if r == nil {
		r = &scanRun{deadline: time.Now().Add(scanTimeout), done: make(chan struct{})}
		scan.cur = r
		go func() {
			r.dead, r.err = scanFunc()
			scan.Lock()
			scan.cur = nil
			scan.Unlock()
			close(r.done)
		}()
	}
	scan.Unlock()
	t := time.NewTimer(time.Until(r.deadline))
	defer t.Stop()
	select {
	case <-r.done:
		return r.dead, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
		return nil, fmt.Errorf("stat of the mounts' sources still blocked after %v", scanTimeout)
	}
}

// statWait bounds each stat of a scan: a path that has not answered by then
// is counted unreachable, as a FUSE or network mount whose server stopped
// answering is. mkfs.btrfs and mkfs.ext4 stat the backing file of every
// mounted loop device, so one image of a hung shared pool staged on the node
// hung every ext4 or btrfs mkfs there. Counting a merely slow mount is cheap:
// it is detached from mkfs's private copy of the namespace only.
var statWait = time.Second

// stuck holds the paths whose stat of an earlier scan has not returned: they
// count as unreachable without another goroutine blocking on them.
var stuck sync.Map

func scanMounts() ([]string, error) {
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, err
	}
	// One stat per path: a device mounted twice is looked at once, so that
	// stuck only ever holds the stats of earlier scans.
	paths := make([][]string, len(mounts))
	answers := map[string]chan bool{}
	for i, m := range mounts {
		paths[i] = probed(m)
		for _, p := range paths[i] {
			if _, ok := answers[p]; ok || !strings.HasPrefix(p, "/") {
				continue
			}
			ch := make(chan bool, 1)
			answers[p] = ch
			go func() { ch <- stuckOrUnreachable(p) }()
		}
	}
	// Every stat gets the same second: one that has not answered by its end
	// is as blocked as the first that did not.
	waited, cancel := context.WithTimeout(context.Background(), statWait)
	defer cancel()
	gone := map[string]bool{}
	for p, ch := range answers {
		select {
		case gone[p] = <-ch:
		case <-waited.Done():
			select {
			case gone[p] = <-ch:
			default:
				gone[p] = true
			}
		}
	}
	var dead []string
	for i, m := range mounts {
		if slices.ContainsFunc(paths[i], func(p string) bool { return gone[p] }) {
			dead = append(dead, m.Mountpoint)
		}
	}
	// Children before parents: a parent's detach takes its children along,
	// after which their paths no longer resolve.
	slices.Reverse(dead)
	return dead, nil
}

// probed are the paths of a mount that mkfs may stat: its source and, for a
// loop device, the backing file (mkfs.btrfs, mkfs.ext4), and its mount point
// (mkfs.xfs, checking whether a block device is mounted).
func probed(m *mountinfo.Info) []string {
	return []string{m.Source, loopBackingFile(m.Source), m.Mountpoint}
}

// stuckOrUnreachable reports whether p is unreachable, or still blocked in a
// stat of an earlier scan.
func stuckOrUnreachable(p string) bool {
	if _, blocked := stuck.LoadOrStore(p, struct{}{}); blocked {
		return true
	}
	defer stuck.Delete(p)
	return unreachable(p)
}

// sparing returns dead without the mounts of target itself: a mount of the
// device mkfs formats, or of a loop device backed by the image it formats.
// mkfs's own check must keep seeing those, however slow their stat was, so
// a target that is mounted is refused in any namespace.
func sparing(dead []string, target string) []string {
	var t unix.Stat_t
	if err := unix.Stat(target, &t); err != nil {
		return dead
	}
	name := target
	if l, err := os.Readlink(target); err == nil && strings.HasPrefix(target, "/proc/") {
		name = l // the driver formats through /proc/self/fd/N
	}
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil // cannot tell: detach nothing
	}
	source := map[string]string{}
	for _, m := range mounts {
		source[m.Mountpoint] = m.Source
	}
	var out []string
	for _, mp := range dead {
		if !holdsTarget(source[mp], name, &t) {
			out = append(out, mp)
		}
	}
	return out
}

// holdsTarget tells whether the device dev is the target t, or a loop device
// backed by it: by the backing file's name the kernel records, or by its
// device and inode. The kernel answers the latter with a getattr of the
// backing file, which blocks as long as its filesystem does; one that has
// not answered within statWait is not the target's, whose stat just answered.
func holdsTarget(dev, name string, t *unix.Stat_t) bool {
	if !strings.HasPrefix(dev, "/dev/") {
		return false
	}
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return false
	}
	if t.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == t.Rdev {
		return true
	}
	backing := loopBackingFile(dev)
	if t.Mode&unix.S_IFMT != unix.S_IFREG || backing == "" {
		return false
	}
	if backing == name {
		return true
	}
	same := make(chan bool, 1)
	go func() {
		if _, blocked := stuck.LoadOrStore("loop:"+dev, struct{}{}); blocked {
			same <- false
			return
		}
		defer stuck.Delete("loop:" + dev)
		fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			same <- true // cannot tell: keep it visible to mkfs
			return
		}
		defer unix.Close(fd)
		info, err := unix.IoctlLoopGetStatus64(fd)
		same <- err != nil || (info.Device == t.Dev && info.Inode == t.Ino)
	}()
	timeout := time.NewTimer(statWait)
	defer timeout.Stop()
	select {
	case s := <-same:
		return s
	case <-timeout.C:
		return false
	}
}

// unreachable reports whether the absolute path p exists but cannot be
// stat-ed (ENOTCONN, ESHUTDOWN, EIO, ... of a dead network or FUSE mount).
func unreachable(p string) bool {
	if !strings.HasPrefix(p, "/") {
		return false
	}
	// A plain stat, as mkfs does: cached attributes (AT_STATX_DONT_SYNC)
	// would hide a dead FUSE.
	var st unix.Stat_t
	err := unix.Stat(p, &st)
	return err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOTDIR)
}

// loopBackingFile returns the backing file the kernel records for the loop
// device dev, "" if dev is not one.
func loopBackingFile(dev string) string {
	name, ok := strings.CutPrefix(dev, "/dev/")
	if !ok || !strings.HasPrefix(name, "loop") || strings.Contains(name, "/") {
		return ""
	}
	b, err := os.ReadFile("/sys/block/" + name + "/loop/backing_file")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
