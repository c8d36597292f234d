package config

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzLoad: the config file and --pool flags never panic the parser, and a
// mount stanza that loads has been validated.
func FuzzLoad(f *testing.F) {
	f.Add([]byte("pools:\n- name: a\n  path: /srv/a\n"), "a=/srv/a,shared")
	f.Add([]byte("pools:\n- name: s\n  path: /srv/s\n  shared: true\n  mount: {type: nfs, source: 'h:/e', options: [hard]}\n"), "b=")
	f.Add([]byte("pools: [{name: x, unknown: 1}]"), "=/x")
	dir := f.TempDir()
	path := filepath.Join(dir, "config.yaml")
	f.Fuzz(func(t *testing.T, raw []byte, flag string) {
		// A config file is the operator's, a few hundred bytes: large inputs
		// only find the YAML library's own slow paths.
		if len(raw) > 4096 {
			return
		}
		if err := os.WriteFile(path, raw, 0o600); err != nil {
			t.Fatal(err)
		}
		file, err := Load(path)
		if err == nil {
			for _, p := range file.Pools {
				if p.Mount != nil && p.Mount.Validate() != nil {
					t.Fatalf("loaded an invalid mount stanza: %+v", p.Mount)
				}
			}
		}
		_, _ = ParsePoolFlag(flag)
	})
}
