package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

const goodShareKey = "mWq3Zr8bYv1TgK0pX7sNcLh2UeJd5AoF9iRw4QyE6nBa" // 44 bytes, as the chart's

// secretVolume lays out dir as kubelet's atomic writer does for a Secret
// holding key: ..2026_…/key, ..data -> that directory, key -> ..data/key.
func secretVolume(t *testing.T, dir, content string, mode os.FileMode) string {
	t.Helper()
	ts := filepath.Join(dir, "..2026_11_27_08_00_00.123")
	must0(t, os.Mkdir(ts, 0o755))
	must0(t, os.WriteFile(filepath.Join(ts, "key"), []byte(content), mode))
	must0(t, os.Chmod(filepath.Join(ts, "key"), mode))
	must0(t, os.Symlink(filepath.Base(ts), filepath.Join(dir, "..data")))
	must0(t, os.Symlink("..data/key", filepath.Join(dir, "key")))
	return filepath.Join(dir, "key")
}

func must0(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestReadShareKeys(t *testing.T) {
	plain := func(content string, mode os.FileMode) func(t *testing.T, dir string) string {
		return func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "key")
			must0(t, os.WriteFile(p, []byte(content), mode))
			must0(t, os.Chmod(p, mode)) // past the umask
			return p
		}
	}
	for _, tt := range []struct {
		name string
		file func(t *testing.T, dir string) string
		keys int
		want string // in the error; "" for keys
	}{
		{"0600", plain(goodShareKey+"\n", 0o600), 1, ""},
		{"0400, two keys", plain(goodShareKey+"\n\n  "+strings.ToLower(goodShareKey)+"  \n", 0o400), 2, ""},
		{"a secret volume's default 0644", func(t *testing.T, d string) string { return secretVolume(t, d, goodShareKey, 0o644) }, 1, ""},
		{"a secret volume at 0400", func(t *testing.T, d string) string { return secretVolume(t, d, goodShareKey, 0o400) }, 1, ""},

		{"readable by all", plain(goodShareKey, 0o644), 0, "readable by others (mode 0644)"},
		{"readable by the group", plain(goodShareKey, 0o640), 0, "readable by others (mode 0640)"},
		{"writable by all", plain(goodShareKey, 0o606), 0, "writable by others (mode 0606)"},
		{"writable by the group", plain(goodShareKey, 0o620), 0, "writable by others"},
		{"a secret volume writable by all", func(t *testing.T, d string) string { return secretVolume(t, d, goodShareKey, 0o666) }, 0, "writable by others"},
		{"a link that only looks like a secret volume", func(t *testing.T, d string) string {
			p := plain(goodShareKey, 0o644)(t, d)
			must0(t, os.Rename(p, filepath.Join(d, "elsewhere")))
			must0(t, os.Symlink("elsewhere", p))
			return p
		}, 0, "readable by others"},
		{"a FIFO", func(t *testing.T, d string) string {
			p := filepath.Join(d, "key")
			must0(t, syscall.Mkfifo(p, 0o600))
			return p
		}, 0, "not a regular file"},
		{"too short", plain("abcdefghijklmnopqrstuvwxyz01234\n", 0o600), 0, "line 1: a key of 31 bytes, want at least 32"},
		{"one byte repeated", plain(strings.Repeat("a", 48), 0o600), 0, "not a random key"},
		{"a short pattern", plain(strings.Repeat("0123456", 8), 0o600), 0, "7 different bytes"},
		{"a weak second key", plain(goodShareKey+"\n"+strings.Repeat("x", 40)+"\n", 0o600), 0, "line 2"},
		{"no key", plain("\n \n", 0o600), 0, "holds no key"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := tt.file(t, t.TempDir())
			keys, err := readShareKeys(path)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("readShareKeys: %v", err)
			case tt.want == "" && len(keys) != tt.keys:
				t.Fatalf("readShareKeys: %d keys, want %d", len(keys), tt.keys)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("readShareKeys = %d keys, %v; want an error with %q", len(keys), err, tt.want)
			}
			if err != nil && strings.Contains(err.Error(), goodShareKey) {
				t.Fatalf("the error shows the key: %v", err)
			}
		})
	}
}

func TestShareKeyOwner(t *testing.T) {
	st := &unix.Stat_t{Mode: unix.S_IFREG | 0o400, Uid: uint32(os.Geteuid()) + 1000}
	if err := checkShareKeyMode("key", st, true); err == nil || !strings.Contains(err.Error(), "owned by uid") {
		t.Fatalf("a key file of another user: %v", err)
	}
	st.Uid = 0
	if err := checkShareKeyMode("key", st, false); err != nil {
		t.Fatalf("root's key file: %v", err)
	}
}
