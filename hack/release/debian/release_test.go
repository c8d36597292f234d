package debian

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// FetchIndex trusts only a current InRelease signed by a key of the keyring it is given,
// and only the signed text of it.
func TestFetchIndexSignedOnly(t *testing.T) {
	const dist = "bookworm-updates"
	s := newTestSigner(t)
	other := newTestSigner(t) // a key the keyring does not hold
	now := time.Date(2026, 11, 27, 9, 0, 0, 0, time.UTC)
	date := func(t time.Time) string { return t.Format(time.RFC1123) }
	good, forged := xzPackages(t, goodPackages), xzPackages(t, forgedPackages)
	current := releaseText(dist, good, "Date: "+date(now.Add(-time.Hour))+"\n")
	signed := s.clearsign(t, current)
	for _, tt := range []struct {
		name      string
		inRelease []byte
		packages  []byte
		v         Verifier
		want      string // the error, or "" for the good packages
	}{
		{name: "signed and current", inRelease: signed, packages: good},
		{name: "valid until later", packages: good,
			inRelease: s.clearsign(t, releaseText(dist, good, "Date: "+date(now.Add(-time.Hour))+"\nValid-Until: "+date(now.Add(time.Hour))+"\n"))},
		{name: "a forged SHA256 section before the signed message", packages: forged, want: "not signed: text before",
			inRelease: append([]byte(releaseText(dist, forged, "Date: "+date(now)+"\n")+"\n"), signed...)},
		{name: "a forged section after the signature", packages: forged, want: "not signed: text after",
			inRelease: append(append([]byte{}, signed...), []byte("\n"+releaseText(dist, forged, ""))...)},
		{name: "two signed messages", packages: good, want: "not one clear-signed message",
			inRelease: append(append([]byte{}, signed...), signed...)},
		{name: "expired", packages: good, want: "expired",
			inRelease: s.clearsign(t, releaseText(dist, good, "Date: "+date(now.Add(-30*24*time.Hour))+"\nValid-Until: "+date(now.Add(-23*24*time.Hour))+"\n"))},
		{name: "dated in the future", packages: good, want: "in the future",
			inRelease: s.clearsign(t, releaseText(dist, good, "Date: "+date(now.Add(2*time.Hour))+"\n"))},
		{name: "no date", packages: good, want: "no Date", inRelease: s.clearsign(t, releaseText(dist, good, ""))},
		{name: "another suite's index", packages: good, want: `signed for suite "bookworm-security"`,
			inRelease: s.clearsign(t, strings.Replace(current, "Codename: "+dist, "Codename: bookworm-security", 1))},
		{name: "signed by another key", packages: good, want: "bad signature", inRelease: other.clearsign(t, current)},
		{name: "signed text altered", packages: forged, want: "bad signature",
			inRelease: bytes.Replace(signed, []byte(sha256Hex(good)), []byte(sha256Hex(forged)), 1)},
		{name: "Packages not the signed one", packages: forged, want: "the signed InRelease says", inRelease: signed},
		{name: "no gpgv", packages: good, want: "gpgv is missing", inRelease: signed, v: Verifier{Gpgv: "/nonexistent/gpgv"}},
		{name: "no keyring", packages: good, want: "no keyring", inRelease: signed, v: Verifier{Keyring: filepath.Join(t.TempDir(), "none.gpg")}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a := &testArchive{InRelease: tt.inRelease, Packages: tt.packages}
			newTestArchive(t, dist, a)
			v := tt.v
			if v.Keyring == "" {
				v.Keyring = s.Keyring
			}
			v.Now = func() time.Time { return now }
			if tt.name == "no gpgv" {
				t.Setenv("PATH", "/nonexistent") // and none found on $PATH either
				v.Gpgv = ""
			}
			idx, err := FetchIndex(context.Background(), "amd64", []Suite{{a.URL, dist}}, v)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("FetchIndex: %v", err)
			case tt.want == "" && idx["mount"].Version != "2.38.1-5+deb12u3":
				t.Fatalf("FetchIndex = %+v", idx)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("FetchIndex = %+v, %v; want an error with %q", idx, err, tt.want)
			}
		})
	}
}

// gpgv's --output is the signed text alone: even a file the shape check did not refuse
// could not bring unsigned text to the parser.
func TestGpgvOutputIsSignedTextOnly(t *testing.T) {
	s := newTestSigner(t)
	signed := s.clearsign(t, "Codename: x\n")
	out, err := Verifier{Keyring: s.Keyring}.gpgv(context.Background(), append([]byte("SHA256:\n forged 1 x\n\n"), signed...))
	must(t, err)
	if string(out) != "Codename: x\n" && string(out) != "Codename: x" {
		t.Fatalf("gpgv's signed text = %q", out)
	}
}
