package debian

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ulikunitz/xz"
)

// testSigner is a throw-away OpenPGP key in its own GnuPG home: the tests sign synthetic
// InRelease files with it and hand gpgv its public keyring, as Debian's keyring is handed
// in make image-lock.
type testSigner struct {
	home    string // GNUPGHOME
	Keyring string // the exported public key, what gpgv reads
}

func newTestSigner(t *testing.T) *testSigner {
	t.Helper()
	for _, tool := range []string{"gpg", "gpg-agent", "gpgv", "gpgconf"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing: the InRelease tests sign with a throw-away key (Debian packages gpg, gpg-agent, gpgv, gpgconf; hack/install-deps.sh installs them)", tool)
		}
	}
	// A short home: gpg-agent's socket path must fit in a sockaddr_un.
	home, err := os.MkdirTemp("", "gpg")
	must(t, err)
	s := &testSigner{home: home, Keyring: filepath.Join(home, "keyring.gpg")}
	t.Cleanup(func() {
		_ = exec.Command("gpgconf", "--homedir", home, "--kill", "all").Run()
		os.RemoveAll(home)
	})
	s.gpg(t, nil, "--quick-generate-key", "--passphrase", "", "poolcsi test <test@invalid>", "ed25519", "sign", "never")
	must(t, os.WriteFile(s.Keyring, s.gpg(t, nil, "--export"), 0o644))
	return s
}

func (s *testSigner) gpg(t *testing.T, stdin []byte, args ...string) []byte {
	t.Helper()
	cmd := exec.Command("gpg", append([]string{"--homedir", s.home, "--batch", "--quiet", "--pinentry-mode", "loopback"}, args...)...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("gpg %s: %v\n%s", strings.Join(args, " "), err, stderr.Bytes())
	}
	return out
}

// clearsign is content as an InRelease: signed with the clear text in it.
func (s *testSigner) clearsign(t *testing.T, content string) []byte {
	t.Helper()
	return s.gpg(t, []byte(content), "--digest-algo", "SHA256", "--clearsign")
}

// testArchive serves one suite's InRelease and main/binary-amd64/Packages.xz.
type testArchive struct {
	URL       string
	InRelease []byte
	Packages  []byte // Packages.xz
}

func newTestArchive(t *testing.T, dist string, a *testArchive) {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/dists/" + dist + "/InRelease":
			w.Write(a.InRelease)
		case "/dists/" + dist + "/main/binary-amd64/Packages.xz":
			w.Write(a.Packages)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	a.URL = srv.URL
}

func xzPackages(t *testing.T, index string) []byte {
	t.Helper()
	var b bytes.Buffer
	w, err := xz.NewWriter(&b)
	must(t, err)
	_, err = w.Write([]byte(index))
	must(t, err)
	must(t, w.Close())
	return b.Bytes()
}

func sha256Hex(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// releaseText is a synthetic InRelease's content for dist listing packagesXZ, with the
// extra fields (Date, Valid-Until) given.
func releaseText(dist string, packagesXZ []byte, fields string) string {
	return fmt.Sprintf(`Origin: Debian
Label: Debian
Suite: oldstable-updates
Codename: %s
%sArchitectures: amd64
Components: main
MD5Sum:
 0123456789abcdef0123456789abcdef %8d main/binary-amd64/Packages.xz
SHA256:
 %s %8d main/binary-amd64/Packages.xz
`, dist, fields, len(packagesXZ), sha256Hex(packagesXZ), len(packagesXZ))
}

const (
	goodPackages = `Package: mount
Version: 2.38.1-5+deb12u3
Architecture: amd64
Filename: pool/main/u/util-linux/mount_2.38.1-5+deb12u3_amd64.deb
Size: 1
SHA256: 1111111111111111111111111111111111111111111111111111111111111111
`
	forgedPackages = `Package: mount
Version: 9.9-forged
Architecture: amd64
Filename: pool/main/u/util-linux/mount_9.9_amd64.deb
Size: 1
SHA256: 6666666666666666666666666666666666666666666666666666666666666666
`
)
