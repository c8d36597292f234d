package main

import (
	"strconv"

	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/moby/sys/mountinfo"

	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/lease"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/report"
)

const poolUsage = `Usage:
  poolcsi pool init --path POOL_DIR --name NAME [--not-a-mount-point-ok]
  poolcsi pool list --path POOL_DIR
  poolcsi pool check --path POOL_DIR [--repair]
  poolcsi pool unfence --path POOL_DIR --volume VOLUME_ID [--node NODE]

init lays out a new shared pool, once, at the root of the mounted share: the
driver never lays out a shared pool by itself, because an empty directory where
a share should be mounted looks exactly like a new pool; for the same reason
init refuses a directory that is not a mount point (--not-a-mount-point-ok
overrides it).
list shows every volume with its size, the bytes its image holds, where it is
staged and published, and its controller-side health, then the volume group
snapshots.
check reports damaged or unhealthy volumes, leftovers of interrupted calls and
a capacity ledger that does not match the volumes (docs/format.md); it exits 1
when it finds any. Neither list nor check changes anything, except that
check --repair rewrites a ledger that does not match from the volumes.
unfence forgets that NODE (every node, without --node) holds the volume, so
another node may publish it. Only for a node that is dead or fenced off: see
docs/fencing.md.
`

// poolCmd runs the operator commands that work on a pool directory directly,
// without a driver: they read what the pool says about itself.
func poolCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, poolUsage)
		return errors.New("pool: want a subcommand (init, list, check, unfence)")
	}
	switch args[0] {
	case "init":
		return poolInit(stdout, stderr, args[1:])
	case "list":
		return poolList(stdout, stderr, args[1:])
	case "check":
		return poolCheck(stdout, stderr, args[1:])
	case "unfence":
		return poolUnfence(ctx, stdout, stderr, args[1:])
	case "-h", "--help", "help":
		fmt.Fprint(stdout, poolUsage)
		return nil
	}
	fmt.Fprint(stderr, poolUsage)
	return fmt.Errorf("pool: unknown subcommand %q", args[0])
}

// openPoolFlag parses --path and opens the pool it names, read-only in spirit.
func openPoolFlag(name, synopsis string, stderr io.Writer, args []string) (*pool.Pool, error) {
	return openPoolFlags(name, "pool "+name+" --path POOL_DIR\n\n"+synopsis, stderr, args, nil)
}

// openPoolFlags is openPoolFlag with a command's own flags, which more adds to the set
// (so that -h lists them).
func openPoolFlags(name, synopsis string, stderr io.Writer, args []string, more func(*flag.FlagSet)) (*pool.Pool, error) {
	fs := newFlagSet("pool "+name, synopsis, stderr)
	path := fs.String("path", "", "the pool's directory")
	if more != nil {
		more(fs)
	}
	if err := parseFlags(fs, args); err != nil {
		return nil, err
	}
	if *path == "" {
		return nil, fmt.Errorf("pool %s: --path is required", name)
	}
	return pool.OpenExisting(*path)
}

func poolList(out, stderr io.Writer, args []string) error {
	p, err := openPoolFlag("list", "Shows every volume with its size, the bytes its image holds, whether its size is\nenforced, where it is staged and published, and its controller-side health.", stderr, args)
	if err != nil {
		return err
	}
	scan, err := health.ScanPool(p, health.DefaultOptions)
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "VOLUME\tNAME\tLAYOUT\tTYPE\tCAPACITY\tSIZE ENFORCED\tHELD\tATTRIBUTES\tSTAGED\tPUBLISHED\tHEALTH")
	for _, r := range scan.Volumes {
		v := r.Volume
		if v == nil {
			fmt.Fprintf(w, "%s\t?\t?\t?\t?\t?\t?\t?\t?\t?\t%s\n", r.ID, health.Summary(r.Issues))
			continue
		}
		kind := v.FSType
		if v.AccessType == pool.AccessBlock {
			kind = "block"
		}
		var staged []string
		for _, s := range v.Staged {
			staged = append(staged, s.Node)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.ID, v.Name, v.Layout, report.OrDash(kind),
			report.HumanBytes(v.CapacityBytes), sizeEnforced(v), report.HumanBytes(r.AllocatedBytes), report.OrDash(attributes(v)), report.OrDash(strings.Join(staged, ",")),
			report.OrDash(strings.Join(v.PublishedNodes(), ",")), health.Summary(r.Issues))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	groups, err := p.Groups().List()
	if err != nil {
		return err
	}
	if len(groups) > 0 {
		fmt.Fprintln(out)
		w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "GROUP SNAPSHOT\tNAME\tCREATED\tREADY\tVOLUMES")
		for _, e := range groups {
			if e.Err != nil {
				fmt.Fprintf(w, "%s\t?\t?\t?\t%v\n", e.ID, e.Err)
				continue
			}
			g := e.Group
			fmt.Fprintf(w, "%s\t%s\t%s\t%t\t%s\n", e.ID, g.Name, g.CreatedAt.Format(time.RFC3339), g.ReadyToUse, strings.Join(g.Sources(), ","))
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}
	s := scan.Space
	fmt.Fprintf(out, "pool %s at %s: %s of %s free, %d volumes, %d group snapshots\n", p.Name(), p.Path(), report.HumanBytes(s.Free), report.HumanBytes(s.Total), len(scan.Volumes), len(groups))
	return nil
}

// errProblems makes `pool check` exit 1 without a second message.
var errProblems = errors.New("problems found")

func poolCheck(out, stderr io.Writer, args []string) error {
	repair := false
	p, err := openPoolFlags("check", "pool check --path POOL_DIR [--repair]\n\nReports damaged or unhealthy volumes, leftovers of interrupted calls and a capacity\nledger that does not match the volumes, and exits 1 when it finds any. It changes\nnothing, except that --repair rewrites such a ledger from the volumes.", stderr, args,
		func(fs *flag.FlagSet) {
			fs.BoolVar(&repair, "repair", false, "rewrite a capacity ledger that does not match the volumes from them (nothing else is changed)")
		})
	if err != nil {
		return err
	}
	problems := 0
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if lr, err := p.Ledger().Check(ctx, repair); err != nil {
		fmt.Fprintf(out, "LEDGER  cannot be checked: %v\n", err)
		problems++
	} else if lr.Problem != "" {
		if repair {
			fmt.Fprintf(out, "LEDGER  %s: repaired from the volumes\n", lr.Problem)
		} else {
			fmt.Fprintf(out, "LEDGER  %s (the next create rebuilds or settles it; --repair rewrites it now)\n", lr.Problem)
			problems++
		}
	} else if lr.Stale {
		// What a crash between a change and its ledger write leaves: the
		// driver does not trust it and rebuilds it at the next change.
		if repair {
			fmt.Fprintln(out, "LEDGER  outdated: rewritten from the volumes")
		} else {
			fmt.Fprintln(out, "LEDGER  outdated (a create or delete it did not count: a crash, or an older driver); not trusted, the next change rebuilds it: no problem")
		}
	}
	if err := p.Check(); err != nil {
		fmt.Fprintf(out, "POOL  %v\n", err)
		problems++
	}
	scan, err := health.ScanPool(p, health.DefaultOptions)
	if err != nil {
		return err
	}
	for _, r := range scan.Volumes {
		for _, is := range r.Issues {
			fmt.Fprintf(out, "%s  %s %s: %s\n", is.Status, r.ID, is.Reason, is.Message)
			problems++
		}
	}
	left, err := p.Leftovers(time.Now())
	if err != nil {
		return err
	}
	for _, l := range left {
		fmt.Fprintf(out, "LEFTOVER  %s: %s\n", l.Path, l.Reason)
		problems++
	}
	if problems > 0 {
		fmt.Fprintf(out, "pool %s: %d problems in %d volumes\n", p.Name(), problems, len(scan.Volumes))
		return errProblems
	}
	fmt.Fprintf(out, "pool %s: %d volumes, no problems\n", p.Name(), len(scan.Volumes))
	return nil
}

func poolUnfence(ctx context.Context, out, stderr io.Writer, args []string) error {
	fs := newFlagSet("pool unfence", "pool unfence --path POOL_DIR --volume VOLUME_ID [--node NODE] [--wait]\n\nForgets that NODE (every node, without --node) holds the volume, so another node may\npublish it. Only for a node that is dead or fenced off: see docs/fencing.md.", stderr)
	path := fs.String("path", "", "the pool's directory")
	volume := fs.String("volume", "", "the volume ID (<pool>.<32 hex>)")
	node := fs.String("node", "", "the node whose record to drop (default: every node)")
	wait := fs.Bool("wait", false, "watch the lease of each node that holds the volume read-write for the lease's duration plus its margin, and drop its records only if the lease does not move (docs/fencing.md)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	id, err := pool.ParseVolumeID(*volume)
	if err != nil {
		return err
	}
	if *path == "" {
		return errors.New("pool unfence: --path is required")
	}
	cfg := pool.Config{Name: id.Pool, Path: filepath.Clean(*path), Shared: true, NoLayout: true}
	if ref, ok := id.ShareRef(); ok {
		cfg.Share = &ref // a volume on a share a StorageClass names: its IDs carry the share
	}
	p, err := pool.Open(cfg)
	if err != nil {
		return err
	}
	if err := leasesExpired(ctx, out, p, id, *node, *wait); err != nil {
		return err
	}
	gone, err := p.Publications().Unfence(ctx, id, *node)
	if err != nil {
		return err
	}
	if len(gone) == 0 {
		fmt.Fprintf(out, "volume %s had no publish record to drop\n", id)
		return nil
	}
	fmt.Fprintf(out, "volume %s: dropped the publish record of %s\n", id, strings.Join(gone, ", "))
	return nil
}

// attributes is a volume's mutable parameters (its VolumeAttributesClass) in
// one column: I/O limits (bytes per second, binary units) and preallocation.
func attributes(v *pool.Volume) string {
	var out []string
	add := func(key string, n int64, bytes bool) {
		if n == 0 {
			return
		}
		val := strconv.FormatInt(n, 10)
		if bytes {
			val = resource.NewQuantity(n, resource.BinarySI).String()
		}
		out = append(out, key+"="+val)
	}
	l := v.IOLimits
	add("rbps", l.ReadBytesPerSecond, true)
	add("wbps", l.WriteBytesPerSecond, true)
	add("riops", l.ReadIOPS, false)
	add("wiops", l.WriteIOPS, false)
	if v.Preallocate {
		out = append(out, "preallocated")
	}
	return strings.Join(out, ",")
}

// sizeEnforced says whether the volume's capacity is a limit: always for an
// image (its file is the size), for a dir volume only where the pool's
// filesystem has a quota for it; otherwise the size is a promise.
func sizeEnforced(v *pool.Volume) string {
	if v.Layout != pool.LayoutDir {
		return "yes"
	}
	if v.Quota == nil || !v.Quota.Enforced {
		return "NO"
	}
	return "yes (" + v.Quota.Kind + ")"
}

func poolInit(out, stderr io.Writer, args []string) error {
	fs := newFlagSet("pool init", "pool init --path POOL_DIR --name NAME [--not-a-mount-point-ok]\n\n"+
		"Lays out a new shared pool, once, at the root of the mounted share. It refuses a\n"+
		"directory that is not a mount point: an empty directory where a share should be\n"+
		"mounted looks exactly like a new pool.", stderr)
	path := fs.String("path", "", "the pool's directory: the mount point of the share, mounted")
	name := fs.String("name", "", "the pool's name, as in the driver's config")
	notMount := fs.Bool("not-a-mount-point-ok", false, "lay out the pool although the path is not the root of a mount (a subdirectory of the share, or a test); a missing directory is then made, if its parent exists")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" || *name == "" {
		return errors.New("pool init: --path and --name are required")
	}
	abs, err := filepath.Abs(*path)
	if err != nil {
		return err
	}
	found, err := checkMountPoint(abs)
	switch {
	case *notMount && errors.Is(err, os.ErrNotExist):
		fmt.Fprintf(out, "found: %s does not exist; pool init makes it, as --not-a-mount-point-ok says\n", abs)
	case err != nil:
		return fmt.Errorf("pool init: %w", err)
	case found.isRoot:
		fmt.Fprintf(out, "found: %s\n", found)
	case !*notMount:
		return fmt.Errorf("pool init: %s is not a mount point: %s. Mount the share there first; if the pool is meant to be there (a subdirectory of the share, or a test), say so with --not-a-mount-point-ok", abs, found)
	default:
		fmt.Fprintf(out, "found: %s is not a mount point (%s); going on, as --not-a-mount-point-ok says\n", abs, found)
	}
	p, err := pool.Initialise(pool.Config{Name: *name, Path: abs, Shared: true})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "pool %s is ready at %s\n", p.Name(), p.Path())
	return nil
}

// mountFound is what checkMountPoint found at a path.
type mountFound struct {
	path   string
	isRoot bool            // path is the root of a mount
	mount  *mountinfo.Info // the mount path is in (the topmost, if mounts are stacked)
}

func (f mountFound) String() string {
	m := f.mount
	if f.isRoot {
		return fmt.Sprintf("%s is the root of a %s mount of %s", f.path, m.FSType, m.Source)
	}
	return fmt.Sprintf("it is a directory in the %s filesystem of %s mounted at %s", m.FSType, m.Source, m.Mountpoint)
}

// checkMountPoint tells whether the existing directory path is the root of a
// mount, by the same test the driver makes of a pool that must be mounted
// (mountinfo.Mounted, which sees bind mounts too), and names the mount path is
// in, for the message. Links in path are resolved first, as mountinfo lists
// real paths.
func checkMountPoint(path string) (mountFound, error) {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return mountFound{}, fmt.Errorf("%s: %w (mount the share there first)", path, err)
	}
	if st, err := os.Stat(real); err != nil {
		return mountFound{}, err
	} else if !st.IsDir() {
		return mountFound{}, fmt.Errorf("%s is not a directory", path)
	}
	isRoot, err := mountinfo.Mounted(real)
	if err != nil {
		return mountFound{}, fmt.Errorf("cannot tell whether %s is a mount point: %w", real, err)
	}
	mounts, err := mountinfo.GetMounts(mountinfo.ParentsFilter(real))
	if err != nil {
		return mountFound{}, fmt.Errorf("read the mount table: %w", err)
	}
	var in *mountinfo.Info
	for _, m := range mounts {
		// The longest mount point holding real; of equal ones, the later in
		// the table, which is mounted over the earlier.
		if in == nil || len(m.Mountpoint) >= len(in.Mountpoint) {
			in = m
		}
	}
	if in == nil {
		return mountFound{}, fmt.Errorf("no mount holds %s", real)
	}
	return mountFound{path: path, isRoot: isRoot, mount: in}, nil
}

// leasesExpired applies the controller's force-detach rule: the records of a
// node that holds the volume read-write go only once that node's lease has
// expired (or was released), so that a node that is still running has fenced
// itself off first. With wait it watches the leases; without, it says what it
// would wait for and refuses.
func leasesExpired(ctx context.Context, out io.Writer, p *pool.Pool, id pool.VolumeID, node string, wait bool) error {
	v, err := p.Load(id)
	if err != nil {
		return err
	}
	if v.Layout != pool.LayoutImage {
		return nil // dir volumes have many writers by design: no fence to wait for
	}
	// held: the nodes holding it read-write, true for those with a stage
	// record (a released lease is no proof for those: docs/fencing.md).
	held := map[string]bool{}
	for _, r := range v.Published {
		if !r.ReadOnly && (node == "" || r.Node == node) {
			held[r.Node] = false
		}
	}
	for _, s := range v.Staged {
		if !s.ReadOnly && (node == "" || s.Node == node) {
			held[s.Node] = true
		}
	}
	t := lease.Default
	obs := lease.NewObserver()
	for n, staged := range held {
		var first *pool.Lease
		for {
			rec, ok, err := p.Leases().Read(n)
			if err != nil {
				return err
			}
			if first != nil && (rec.Counter != first.Counter || rec.Instance != first.Instance) && (!rec.Released || staged) {
				return fmt.Errorf("node %s renewed its lease in pool %s while it was watched: it is alive and may be writing; not unfencing", n, p.Name())
			}
			first = &rec
			verdict := obs.Observe(p.Name(), n, rec, ok, t, staged)
			if verdict.Expired {
				fmt.Fprintf(out, "%s: its records may go\n", verdict.Why)
				break
			}
			if !wait {
				return fmt.Errorf("volume %s is held read-write by node %s: %s. poolcsi pool unfence --wait watches the lease for %s and unfences only if it does not move (a node that still renews is alive and may be writing)",
					id, n, verdict.Why, t.Expiry(rec))
			}
			fmt.Fprintf(out, "waiting %s more: %s\n", verdict.Wait.Round(time.Second), verdict.Why)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(min(verdict.Wait, t.Interval)):
			}
		}
	}
	return nil
}
