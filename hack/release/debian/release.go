package debian

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Keyring is the Debian archive keyring of the debian-archive-keyring package.
const Keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"

// Verifier checks an InRelease the way apt does before anything in it is used: the file
// is one clear-signed message and nothing else, gpgv finds a good signature by a key of
// the keyring, and only the text gpgv says is signed is parsed; that text must name the
// suite asked for (Codename), be dated no later than now, and, where it says until when
// it is valid, not have expired. Without gpgv or the keyring nothing is trusted.
type Verifier struct {
	Keyring string           // an OpenPGP keyring for gpgv; Keyring when empty
	Gpgv    string           // the gpgv to run; found on $PATH when empty
	Now     func() time.Time // time.Now when nil
}

// Release is what the signed part of an InRelease says.
type Release struct {
	Codename         string
	Date, ValidUntil time.Time // ValidUntil is zero when the file gives none
	SHA256           map[string]FileSum
}

// FileSum is one line of a Release file's SHA256 list.
type FileSum struct {
	SHA256 string
	Size   int64
}

// dateSkew is how far in the future a Release's Date may lie: clocks differ a little.
const dateSkew = 10 * time.Minute

// Verify checks inRelease, a suite's InRelease, and returns what its signed part says;
// dist is the suite (bookworm-updates), which the signed Codename must be.
func (v Verifier) Verify(ctx context.Context, inRelease []byte, dist string) (*Release, error) {
	if err := checkClearsigned(inRelease); err != nil {
		return nil, err
	}
	signed, err := v.gpgv(ctx, inRelease)
	if err != nil {
		return nil, err
	}
	rel, err := parseRelease(signed)
	if err != nil {
		return nil, fmt.Errorf("the signed text: %w", err)
	}
	if rel.Codename != dist {
		return nil, fmt.Errorf("signed for suite %q, not %q", rel.Codename, dist)
	}
	now := time.Now()
	if v.Now != nil {
		now = v.Now()
	}
	if rel.Date.IsZero() {
		return nil, errors.New("the signed text has no Date")
	}
	if rel.Date.After(now.Add(dateSkew)) {
		return nil, fmt.Errorf("dated %s, in the future (is this machine's clock right?)", rel.Date.Format(time.RFC1123))
	}
	if !rel.ValidUntil.IsZero() && !now.Before(rel.ValidUntil) {
		return nil, fmt.Errorf("expired: valid until %s, an old index replayed or a mirror that stopped updating", rel.ValidUntil.Format(time.RFC1123))
	}
	return rel, nil
}

// gpgv runs gpgv on inRelease and returns the text it says is signed (--output): only
// that text, never the file gpgv was given, is parsed.
func (v Verifier) gpgv(ctx context.Context, inRelease []byte) ([]byte, error) {
	gpgv := v.Gpgv
	if gpgv == "" {
		p, err := exec.LookPath("gpgv")
		if err != nil {
			return nil, fmt.Errorf("cannot check the signature: gpgv is missing (Debian package gpgv): %w", err)
		}
		gpgv = p
	}
	keyring := v.Keyring
	if keyring == "" {
		keyring = Keyring
	}
	if st, err := os.Stat(keyring); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("cannot check the signature: no keyring %s (Debian package debian-archive-keyring)", keyring)
	}
	dir, err := os.MkdirTemp("", "inrelease")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(dir) }() // a temp dir: nothing to lose if it stays
	in, out := filepath.Join(dir, "InRelease"), filepath.Join(dir, "signed")
	if err := os.WriteFile(in, inRelease, 0o600); err != nil {
		return nil, err
	}
	var status, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, gpgv, "--keyring", keyring, "--status-fd", "1", "--output", out, in)
	cmd.Stdout, cmd.Stderr = &status, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("bad signature (gpgv: %w):\n%s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	// Exit 0 is a good signature by a key of the keyring; the status lines say so too.
	if !bytes.Contains(status.Bytes(), []byte("[GNUPG:] VALIDSIG ")) ||
		bytes.Count(status.Bytes(), []byte("[GNUPG:] PLAINTEXT ")) != 1 {
		return nil, fmt.Errorf("gpgv reports no single signed text:\n%s", status.Bytes())
	}
	return os.ReadFile(out)
}

// checkClearsigned refuses a file that is more than one clear-signed message, as apt's
// SplitClearSignedFile does: gpgv would check the signed part and ignore text around it,
// so text before the message's header or after its signature, or a second message, is
// refused rather than left for a parser to find.
func checkClearsigned(b []byte) error {
	lines := strings.Split(string(b), "\n")
	const (
		begin    = "-----BEGIN PGP SIGNED MESSAGE-----"
		sigBegin = "-----BEGIN PGP SIGNATURE-----"
		sigEnd   = "-----END PGP SIGNATURE-----"
	)
	want := []string{begin, sigBegin, sigEnd}
	var seen []string
	last := -1
	for i, l := range lines {
		l = strings.TrimRight(l, "\r")
		if strings.HasPrefix(l, "-----") {
			seen = append(seen, l)
			if l == sigEnd {
				last = i
			}
			continue
		}
		if len(seen) == 0 && strings.TrimSpace(l) != "" {
			return fmt.Errorf("not signed: text before %s (line %d)", begin, i+1)
		}
		if len(seen) == 3 && strings.TrimSpace(l) != "" {
			return fmt.Errorf("not signed: text after %s (line %d)", sigEnd, i+1)
		}
	}
	if strings.Join(seen, "\n") != strings.Join(want, "\n") || last < 0 {
		return fmt.Errorf("not one clear-signed message: armor lines %q", seen)
	}
	return nil
}

var hexSHA256 = regexp.MustCompile(`^[0-9a-f]{64}$`)

// parseRelease reads a Release file's fields (the deb822 format, one paragraph). A field
// given twice, or a file listed twice in SHA256, is refused: which one a reader took
// would be a choice an attacker could make.
func parseRelease(b []byte) (*Release, error) {
	rel := &Release{SHA256: map[string]FileSum{}}
	seen := map[string]bool{}
	field := ""
	for i, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		line = strings.TrimRight(line, "\r")
		if line == "" {
			return nil, fmt.Errorf("line %d: an empty line: one paragraph expected", i+1)
		}
		if line[0] == ' ' || line[0] == '\t' {
			if field != "sha256" {
				continue // a continued field we do not read
			}
			f := strings.Fields(line)
			if len(f) != 3 || !hexSHA256.MatchString(f[0]) {
				return nil, fmt.Errorf("line %d: SHA256 entry %q", i+1, line)
			}
			size, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil || size < 0 {
				return nil, fmt.Errorf("line %d: size in %q", i+1, line)
			}
			if _, dup := rel.SHA256[f[2]]; dup {
				return nil, fmt.Errorf("line %d: %s listed twice", i+1, f[2])
			}
			rel.SHA256[f[2]] = FileSum{SHA256: f[0], Size: size}
			continue
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("line %d: %q is not a field", i+1, line)
		}
		field = strings.ToLower(k) // deb822 field names are case-insensitive
		if seen[field] {
			return nil, fmt.Errorf("line %d: field %s given twice", i+1, k)
		}
		seen[field] = true
		v = strings.TrimSpace(v)
		var err error
		switch field {
		case "codename":
			rel.Codename = v
		case "date":
			rel.Date, err = parseReleaseDate(v)
		case "valid-until":
			rel.ValidUntil, err = parseReleaseDate(v)
		}
		if err != nil {
			return nil, fmt.Errorf("line %d: %s: %w", i+1, k, err)
		}
	}
	return rel, nil
}

// parseReleaseDate reads a Release file's Date or Valid-Until: RFC 1123 in UTC as Debian
// writes it ("Sat, 11 Jul 2026 10:16:37 UTC"); apt also accepts GMT, a numeric zone and
// a one-digit day. Any other zone name is refused: Go would take an unknown one as UTC.
func parseReleaseDate(s string) (time.Time, error) {
	for _, layout := range []string{"Mon, 2 Jan 2006 15:04:05 -0700", "Mon, 2 Jan 2006 15:04:05 MST"} {
		t, err := time.Parse(layout, s)
		if err != nil {
			continue
		}
		if strings.HasSuffix(layout, "MST") && !strings.HasSuffix(s, " UTC") && !strings.HasSuffix(s, " GMT") {
			break
		}
		return t.UTC(), nil
	}
	return time.Time{}, fmt.Errorf("%q is not a date like \"Sat, 11 Jul 2026 10:16:37 UTC\"", s)
}
