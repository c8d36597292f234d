// Package config reads poolcsi's pool configuration from --pool flags and the
// YAML config file.
package config

import (
	"fmt"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/poolcsi/poolcsi/internal/fsx"
	"github.com/poolcsi/poolcsi/internal/pool"
	"github.com/poolcsi/poolcsi/internal/poolmount"
)

// DefaultPoolPath is the local pool used when no pool is configured at all.
const DefaultPoolPath = "/var/lib/poolcsi/pools/default"

// File is the YAML config file (--config).
type File struct {
	Pools []PoolConfig `json:"pools"`
}

// PoolConfig is one pool of the config file: the pool itself and, for a shared
// pool, optionally how poolcsi mounts its filesystem.
type PoolConfig struct {
	pool.Config `json:",inline"`
	Mount       *poolmount.Spec `json:"mount,omitempty"`
}

// maxConfig bounds the config file: a pools list is a few KiB.
const maxConfig = 1 << 20

// Load reads a config file. Unknown fields are errors: a misspelt key would
// otherwise silently fall back to a default.
func Load(path string) (File, error) {
	var f File
	raw, err := fsx.ReadFileFollow(path, maxConfig)
	if err != nil {
		return f, fmt.Errorf("read config: %w", err)
	}
	if err := yaml.UnmarshalStrict(raw, &f); err != nil {
		return f, fmt.Errorf("parse config %s: %w", path, err)
	}
	for _, p := range f.Pools {
		if err := checkName(p.Name); err != nil {
			return f, fmt.Errorf("config %s: %w", path, err)
		}
		if p.Mount != nil {
			if err := p.Mount.Validate(); err != nil {
				return f, fmt.Errorf("config %s: pool %s: %w", path, p.Name, err)
			}
		}
	}
	return f, nil
}

// ParsePoolFlag parses --pool NAME=PATH[,shared][,ephemeral|,noephemeral].
func ParsePoolFlag(s string) (pool.Config, error) {
	name, rest, ok := strings.Cut(s, "=")
	if !ok || name == "" || rest == "" {
		return pool.Config{}, fmt.Errorf("--pool %q: want NAME=PATH[,shared][,ephemeral|,noephemeral]", s)
	}
	parts := strings.Split(rest, ",")
	c := pool.Config{Name: name, Path: filepath.Clean(parts[0])}
	for _, opt := range parts[1:] {
		switch opt {
		case "shared":
			c.Shared = true
		case "local":
			c.Shared = false
		case "ephemeral", "noephemeral":
			allow := opt == "ephemeral"
			c.Ephemeral = &allow
		default:
			return pool.Config{}, fmt.Errorf("--pool %q: unknown option %q (known: shared, local, ephemeral, noephemeral)", s, opt)
		}
	}
	if err := checkName(c.Name); err != nil {
		return pool.Config{}, fmt.Errorf("--pool %q: %w", s, err)
	}
	return c, nil
}

// checkName validates a configured pool's name. Names of the form of a
// share's pool ("s-" and 16 hex digits) are the driver's own: a configured
// pool of such a name could be taken for a share's.
func checkName(name string) error {
	if err := pool.ValidatePoolName(name); err != nil {
		return err
	}
	if pool.IsSharePoolName(name) {
		return fmt.Errorf("pool name %q is reserved: names of the form s-<16 hex digits> are those of the pools on shares a StorageClass names", name)
	}
	return nil
}

// Pools merges the config file's pools with the flags' (flags win on a name
// clash) and falls back to the default local pool when neither names one.
func Pools(file File, flags []pool.Config) []pool.Config {
	byName := map[string]int{}
	var out []pool.Config
	var all []pool.Config
	for _, pc := range file.Pools {
		c := pc.Config
		// A pool poolcsi mounts must be mounted before it is used at all.
		c.RequireMount = c.RequireMount || pc.Mount != nil
		all = append(all, c)
	}
	for _, c := range append(all, flags...) {
		if i, ok := byName[c.Name]; ok {
			out[i] = c
			continue
		}
		byName[c.Name] = len(out)
		out = append(out, c)
	}
	if len(out) == 0 {
		out = append(out, pool.Config{Name: "default", Path: DefaultPoolPath})
	}
	return out
}

// Mounts returns the mount stanzas of the file's pools, by pool name, leaving out
// pools a --pool flag redefines (the flag wins, and it has no stanza).
func Mounts(file File, flags []pool.Config) map[string]poolmount.Spec {
	out := map[string]poolmount.Spec{}
	for _, pc := range file.Pools {
		if pc.Mount != nil {
			out[pc.Name] = *pc.Mount
		}
	}
	for _, c := range flags {
		delete(out, c.Name)
	}
	return out
}
