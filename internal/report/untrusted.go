package report

import (
	"bytes"
	"fmt"
	"reflect"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// What a driver answers is untrusted text: status and call print it on an operator's
// terminal, where an escape sequence could set the window title, write the clipboard
// (OSC 52), or overwrite a line (a carriage return, a cursor move) with one of the
// driver's making. Text output escapes what is not printable; JSON output escapes the
// same runes as \u sequences, which decode to the driver's exact strings.

// unprintable says whether r must not reach a terminal as it is: C0 and C1 controls,
// DEL, format characters (bidi overrides, which reorder what is shown) and the Unicode
// line and paragraph separators.
func unprintable(r rune) bool {
	return unicode.IsControl(r) || unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp)
}

// Printable is s with every unprintable rune written as a Go escape (\n, \x1b, \u202e)
// and every byte that is not UTF-8 as \xNN: one line, showing all it holds.
func Printable(s string) string {
	clean := true
	for i, r := range s {
		if unprintable(r) || (r == utf8.RuneError && !strings.HasPrefix(s[i:], "\uFFFD")) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r < 0x80 && unprintable(r):
			q := strings.Trim(fmt.Sprintf("%+q", string(r)), `"`) // \a, \n, \r, \t or \x1b
			b.WriteString(q)
		case unprintable(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// printableCopy is a deep copy of v (a struct, or a pointer to one, of exported fields)
// with every string in it, map keys too, made printable: the text output renders the
// copy, so a field added later cannot be missed.
func printableCopy[T any](v T) T {
	return printableValue(reflect.ValueOf(v)).Interface().(T)
}

func printableValue(v reflect.Value) reflect.Value {
	switch v.Kind() {
	case reflect.String:
		out := reflect.New(v.Type()).Elem()
		out.SetString(Printable(v.String()))
		return out
	case reflect.Pointer:
		if v.IsNil() {
			return v
		}
		out := reflect.New(v.Type().Elem())
		out.Elem().Set(printableValue(v.Elem()))
		return out
	case reflect.Struct:
		out := reflect.New(v.Type()).Elem()
		for i := range v.NumField() {
			if out.Field(i).CanSet() {
				out.Field(i).Set(printableValue(v.Field(i)))
			}
		}
		return out
	case reflect.Slice:
		if v.IsNil() {
			return v
		}
		out := reflect.MakeSlice(v.Type(), v.Len(), v.Len())
		for i := range v.Len() {
			out.Index(i).Set(printableValue(v.Index(i)))
		}
		return out
	case reflect.Map:
		if v.IsNil() {
			return v
		}
		out := reflect.MakeMapWithSize(v.Type(), v.Len())
		for it := v.MapRange(); it.Next(); {
			out.SetMapIndex(printableValue(it.Key()), printableValue(it.Value()))
		}
		return out
	}
	return v
}

// EscapeJSON is JSON text b with every unprintable rune that encoders leave as it is
// (C1 controls, bidi overrides; they can only be inside strings) written as a \u escape:
// the same JSON to a parser, nothing a terminal acts on.
func EscapeJSON(b []byte) []byte {
	if !bytes.ContainsFunc(b, func(r rune) bool { return r >= 0x80 && unprintable(r) }) {
		return b
	}
	var out bytes.Buffer
	for len(b) > 0 {
		r, size := utf8.DecodeRune(b)
		if r >= 0x80 && unprintable(r) {
			if r1, r2 := utf16.EncodeRune(r); r1 != unicode.ReplacementChar { // outside the BMP: a pair
				fmt.Fprintf(&out, `\u%04x\u%04x`, r1, r2)
			} else {
				fmt.Fprintf(&out, `\u%04x`, r)
			}
		} else {
			out.Write(b[:size])
		}
		b = b[size:]
	}
	return out.Bytes()
}
