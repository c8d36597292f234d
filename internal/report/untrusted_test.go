package report

import "testing"

func TestPrintable(t *testing.T) {
	for in, want := range map[string]string{
		"pool-a.0123 ok é …":        "pool-a.0123 ok é …",
		"a\x1b]0;t\x07b":            `a\x1b]0;t\ab`,
		"a\r\nb\tc\x7f":             `a\r\nb\tc\x7f`,
		"\u009b31m\u202eevil\u2028": `\u009b31m\u202eevil\u2028`,
		"bad\xff\xfe utf8 \uFFFD":   `bad\xff\xfe utf8 ` + "\uFFFD",
		"":                          "",
	} {
		if got := Printable(in); got != want {
			t.Errorf("Printable(%q) = %q, want %q", in, got, want)
		}
	}
	type inner struct {
		M map[string]string
		P *string
	}
	s := "p\x1b"
	orig := struct {
		A string
		L []inner
	}{"a\n", []inner{{M: map[string]string{"k\r": "v\x07"}, P: &s}}}
	got := printableCopy(orig)
	if got.A != `a\n` || got.L[0].M[`k\r`] != `v\a` || *got.L[0].P != `p\x1b` {
		t.Errorf("printableCopy = %+v", got)
	}
	if orig.A != "a\n" || orig.L[0].M["k\r"] != "v\x07" || s != "p\x1b" {
		t.Errorf("printableCopy changed its argument: %+v", orig)
	}
	if got, want := string(EscapeJSON([]byte("{\"a\":\"x\u009by\u202e\U000E0001\"}"))), `{"a":"x\u009by\u202e\udb40\udc01"}`; got != want {
		t.Errorf("EscapeJSON = %s, want %s", got, want)
	}
}
