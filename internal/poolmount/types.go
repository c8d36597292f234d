package poolmount

import (
	"errors"
	"fmt"
	"net"
	"regexp"
	"sort"
	"strings"

	"github.com/poolcsi/poolcsi/internal/pool"
)

// Mount helpers are interpreters. mount(8) hands a share to /sbin/mount.<type>,
// which parses the source and the options by its own rules: mount.fuse.ceph
// turns a source such as "a=b,c=d" and every "ceph.X=Y" option into ceph-fuse
// flags (--X=Y) and runs them through a shell; ceph-fuse, as root, then unlinks
// the file an admin_socket= names and appends to a log_file=; mount.ceph reads
// the file a secretfile= or conf= names; mount(8) itself acts on X-mount.*,
// helper=, loop and bind. So a share's source and options are request input
// that must never reach a helper unless the grammar of that share type allows
// them: each type below has a source grammar and an option allow-list written
// from what its helper and kernel client parse, and a type without one cannot
// be mounted at all. Option keys are matched exactly, in lowercase, so no
// spelling ("X-mount.mkdir", "Bind") slips past a list. ceph-fuse is never run
// through mount.fuse.ceph: the driver builds its argv itself.

// ErrShareRefused marks a share source or option that no helper is given.
var ErrShareRefused = errors.New("share refused")

// optionRule says what value an option takes: nil, none (a flag).
type optionRule = *regexp.Regexp

var (
	num        = regexp.MustCompile(`^[0-9]{1,10}$`)
	cephName   = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)
	cephSecret = regexp.MustCompile(`^[A-Za-z0-9+/]{16,256}={0,2}$`)
	ipAddr     = regexp.MustCompile(`^[0-9a-fA-F.:]{2,45}$`) // and net.ParseIP
	monAddrs   = regexp.MustCompile(`^[0-9a-fA-F.:\[\]]{2,64}(/[0-9a-fA-F.:\[\]]{2,64}){0,7}$`)
)

func oneOf(values ...string) optionRule {
	return regexp.MustCompile(`^(` + strings.Join(values, "|") + `)$`)
}

// genericOptions are mount(8)'s per-mount flags, which every type takes (the
// kernel applies them to the share's mount).
var genericOptions = map[string]optionRule{
	"ro": nil, "rw": nil, "nodev": nil, "nosuid": nil, "noexec": nil, "exec": nil,
	"noatime": nil, "relatime": nil, "strictatime": nil, "nodiratime": nil, "lazytime": nil,
	"sync": nil, "async": nil, "dirsync": nil, "defaults": nil,
}

// shareType is what the driver knows of one kind of share.
type shareType struct {
	// source checks a share's source (its ShareRef.Source).
	source func(string) error
	// options are the options a StorageClass or a volume context may give,
	// beyond genericOptions.
	options map[string]optionRule
	// secret are the options only a request's secrets may give (and that
	// are masked in every log line and never recorded).
	secret map[string]optionRule
}

var shareTypes = map[string]shareType{
	"nfs":       {source: nfsSource, options: nfsOptions},
	"nfs4":      {source: nfsSource, options: nfsOptions},
	"ceph":      {source: cephSource, options: cephOptions, secret: map[string]optionRule{"secret": cephSecret}},
	"fuse.ceph": {source: cephFuseSource, options: cephFuseOptions, secret: map[string]optionRule{"secret": cephSecret}},
	BindType:    {source: bindSource},
}

// ShareTypes are the share types the driver knows how to mount, sorted.
func ShareTypes() []string {
	out := make([]string, 0, len(shareTypes))
	for t := range shareTypes {
		out = append(out, t)
	}
	sort.Strings(out)
	return out
}

// CheckShare checks a share against its type's grammar: a known type, and a
// source its helper reads as a source and nothing else.
func CheckShare(r pool.ShareRef) error {
	if err := r.Validate(); err != nil {
		return err
	}
	st, ok := shareTypes[r.Type]
	if !ok {
		return fmt.Errorf("%w: share type %q has no grammar here (known: %s): nothing is passed to its mount helper", ErrShareRefused, r.Type, strings.Join(ShareTypes(), ", "))
	}
	if err := st.source(r.Source); err != nil {
		return fmt.Errorf("%w: %s source %q: %w", ErrShareRefused, r.Type, r.Source, err)
	}
	return nil
}

// CheckOption checks one mount option of a share of type typ against the
// type's allow-list; sensitive tells whether it comes from a request's secrets
// (then its value is never shown in the error).
func CheckOption(typ, o string, sensitive bool) error {
	st, ok := shareTypes[typ]
	if !ok {
		return fmt.Errorf("%w: share type %q has no grammar here", ErrShareRefused, typ)
	}
	shown := fmt.Sprintf("%q", o)
	key, val, hasVal := strings.Cut(o, "=")
	if sensitive {
		shown = fmt.Sprintf("%q (value not shown)", key)
	}
	if o == "" || strings.ContainsAny(o, ",\x00\n") {
		return fmt.Errorf("%w: mount option %s is not one option", ErrShareRefused, shown)
	}
	if key != strings.ToLower(key) {
		return fmt.Errorf("%w: mount option %s: option names are lowercase", ErrShareRefused, shown)
	}
	rule, known := genericOptions[key]
	if !known {
		rule, known = st.options[key]
	}
	if !known && sensitive {
		rule, known = st.secret[key]
	}
	if !known {
		if _, secret := st.secret[key]; secret {
			return fmt.Errorf("%w: mount option %s of a %s share belongs in the secret's %s, never in a StorageClass or volume context", ErrShareRefused, shown, typ, "mountOptions")
		}
		return fmt.Errorf("%w: mount option %s is not one a %s share takes here (allowed: %s)", ErrShareRefused, shown, typ, strings.Join(st.allowed(sensitive), ", "))
	}
	switch {
	case rule == nil && hasVal:
		return fmt.Errorf("%w: mount option %s takes no value", ErrShareRefused, shown)
	case rule != nil && (!hasVal || !rule.MatchString(val)):
		return fmt.Errorf("%w: mount option %s: the value must match %s", ErrShareRefused, shown, rule)
	case rule != nil && rule == ipAddr && net.ParseIP(val) == nil:
		return fmt.Errorf("%w: mount option %s: not an IP address", ErrShareRefused, shown)
	}
	return nil
}

func (st shareType) allowed(sensitive bool) []string {
	var out []string
	for k := range genericOptions {
		out = append(out, k)
	}
	for k := range st.options {
		out = append(out, k)
	}
	if sensitive {
		for k := range st.secret {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

var nfsOptions = map[string]optionRule{
	"hard": nil, "soft": nil, "softerr": nil, "intr": nil, "nointr": nil, "ac": nil, "noac": nil,
	"cto": nil, "nocto": nil, "lock": nil, "nolock": nil, "acl": nil, "noacl": nil,
	"rdirplus": nil, "nordirplus": nil, "sharecache": nil, "nosharecache": nil,
	"resvport": nil, "noresvport": nil, "fsc": nil, "nofsc": nil, "posix": nil, "noposix": nil,
	"tcp": nil, "udp": nil, "rdma": nil, "softreval": nil, "nosoftreval": nil,
	"trunkdiscovery": nil, "notrunkdiscovery": nil, "fg": nil,
	"vers": oneOf(`3`, `4`, `4\.0`, `4\.1`, `4\.2`), "nfsvers": oneOf(`3`, `4`, `4\.0`, `4\.1`, `4\.2`),
	"minorversion": oneOf(`0`, `1`, `2`),
	"proto":        oneOf("tcp", "tcp6", "udp", "udp6", "rdma", "rdma6"),
	"mountproto":   oneOf("tcp", "tcp6", "udp", "udp6"),
	"port":         num, "mountport": num, "mountvers": num, "rsize": num, "wsize": num, "timeo": num,
	"retrans": num, "retry": num, "acregmin": num, "acregmax": num, "acdirmin": num, "acdirmax": num,
	"actimeo": num, "namlen": num, "nconnect": num, "max_connect": num,
	"lookupcache": oneOf("all", "none", "pos", "positive"),
	"local_lock":  oneOf("all", "flock", "posix", "none"),
	"sec":         regexp.MustCompile(`^(sys|none|krb5|krb5i|krb5p)(:(sys|none|krb5|krb5i|krb5p)){0,4}$`),
	"clientaddr":  ipAddr, "mountaddr": ipAddr,
	"write":   oneOf("eager", "wait", "lazy"),
	"xprtsec": oneOf("none", "tls", "mtls"),
	// Not "bg": mount.nfs would fork and go on retrying in the background,
	// past the driver's timeout and its one-mount-at-a-time rule.
}

var cephOptions = map[string]optionRule{
	"name": cephName, "fs": cephName, "mds_namespace": cephName, "snapdirname": cephName,
	"mon_addr":        monAddrs,
	"ms_mode":         oneOf("legacy", "crc", "secure", "prefer-crc", "prefer-secure"),
	"recover_session": oneOf("no", "clean"),
	"rsize":           num, "wsize": num, "rasize": num, "caps_max": num, "readdir_max_entries": num,
	"readdir_max_bytes": num, "write_congestion_kb": num, "mount_timeout": num, "osdkeepalive": num,
	"osd_idle_ttl": num, "caps_wanted_delay_min": num, "caps_wanted_delay_max": num,
	"rbytes": nil, "norbytes": nil, "dcache": nil, "nodcache": nil, "dirstat": nil, "nodirstat": nil,
	"noasyncreaddir": nil, "noquotadf": nil, "nocopyfrom": nil, "wsync": nil, "nowsync": nil,
	"acl": nil, "noacl": nil,
	// Not secretfile= nor conf=: mount.ceph reads the file they name, as root.
}

// cephFuseOptions are what the driver turns into ceph-fuse's argv (name, fs)
// or passes to FUSE with -o.
var cephFuseOptions = map[string]optionRule{
	"name": cephName, "fs": cephName,
	"allow_other": nil, "default_permissions": nil,
}

var (
	hostname   = regexp.MustCompile(`^([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$`)
	exportPath = regexp.MustCompile(`^/[A-Za-z0-9._+@=/-]*$`)
	port       = regexp.MustCompile(`^[0-9]{1,5}$`)
)

// host checks a server: a host name, an IPv4 address, or an IPv6 address in
// brackets. Nothing that starts with '-'.
func host(h string) error {
	if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		if ip := net.ParseIP(h[1 : len(h)-1]); ip == nil || ip.To4() != nil {
			return fmt.Errorf("%q is not an IPv6 address in brackets", h)
		}
		return nil
	}
	if net.ParseIP(h) != nil && !strings.Contains(h, ":") || hostname.MatchString(h) && len(h) <= 253 {
		return nil
	}
	return fmt.Errorf("%q is not a host name, an IPv4 address or a bracketed IPv6 address", h)
}

// path checks the path of an export: absolute, of plain characters, no ".."
// component, no "//".
func path(p string) error {
	if !exportPath.MatchString(p) {
		return fmt.Errorf("path %q must start with / and hold only letters, digits and . _ + @ = / -", p)
	}
	for _, c := range strings.Split(p, "/") {
		if c == ".." || c == "." {
			return fmt.Errorf("path %q has a %q component", p, c)
		}
	}
	if strings.Contains(p, "//") {
		return fmt.Errorf("path %q has an empty component", p)
	}
	return nil
}

// nfsSource is what mount.nfs reads as a source: server:/path.
func nfsSource(s string) error {
	i := strings.LastIndex(s, ":/")
	if i <= 0 {
		return errors.New("want server:/path")
	}
	if err := host(s[:i]); err != nil {
		return err
	}
	return path(s[i+1:])
}

// monitors checks a comma-separated list of Ceph monitors: host[:port], each
// with an optional v1: or v2: (the messenger protocol, as Ceph writes them).
func monitors(s string) error {
	if s == "" {
		return errors.New("no monitor")
	}
	mons := strings.Split(s, ",")
	if len(mons) > 8 {
		return errors.New("more than 8 monitors")
	}
	for _, m := range mons {
		m = strings.TrimPrefix(strings.TrimPrefix(m, "v1:"), "v2:")
		h := m
		if i := strings.LastIndex(m, ":"); i > 0 && !strings.HasSuffix(m, "]") {
			h = m[:i]
			if !port.MatchString(m[i+1:]) {
				return fmt.Errorf("monitor %q: port %q is not a number", m, m[i+1:])
			}
		}
		if err := host(h); err != nil {
			return fmt.Errorf("monitor %q: %w", m, err)
		}
	}
	return nil
}

var cephNewSource = regexp.MustCompile(`^([A-Za-z0-9][A-Za-z0-9._-]{0,63})?@([0-9a-f-]{36})?\.([A-Za-z0-9][A-Za-z0-9._-]{0,63})=(/.*)$`)

// cephSource is what mount.ceph reads as a source: monitors:/path, or the
// newer name@fsid.fsname=/path.
func cephSource(s string) error {
	if m := cephNewSource.FindStringSubmatch(s); m != nil {
		return path(m[4])
	}
	i := strings.LastIndex(s, ":/")
	if i <= 0 {
		return errors.New("want monitors:/path or name@fsid.fsname=/path")
	}
	if err := monitors(s[:i]); err != nil {
		return err
	}
	return path(s[i+1:])
}

// cephFuseSource is monitors:/path: the driver gives ceph-fuse the monitors
// (-m) and the path (-r) itself.
func cephFuseSource(s string) error {
	i := strings.LastIndex(s, ":/")
	if i <= 0 {
		return errors.New("want monitors:/path")
	}
	if err := monitors(s[:i]); err != nil {
		return err
	}
	return path(s[i+1:])
}

// bindSource is a directory of the node: a clean absolute path other than /.
func bindSource(s string) error {
	if s == "/" {
		return errors.New("not /")
	}
	return path(s)
}
