// Package jsonscan reads and writes the small JSON documents of a plugin's
// hot path (its network configuration, the pool's records) without
// encoding/json's reflection, whose first use of each type costs a
// short-lived process more than the rest of the decode.
//
// Contract: it is a fast path, never the only path. Every reader returns
// ok=false for anything it does not handle exactly as encoding/json would
// (a string with an escape, a null, a key that matches a field only
// case-insensitively, a duplicate key, a number that is not an integer, a
// type mismatch, a document that is not valid JSON), and its caller then
// decodes the same bytes with encoding/json, which gives the canonical
// result or error. Writers likewise refuse (ok=false) a string that
// encoding/json would escape. So a caller's result with this package is
// byte for byte, field for field, what encoding/json gives; each caller
// keeps a test that compares the two on random input.
package jsonscan

import (
	"strconv"
	"unicode/utf8"
)

// Value is one JSON value of a document that Parse accepted: the exact
// bytes of the value, without surrounding white space.
type Value struct{ raw []byte }

// Parse checks that data is one valid JSON document (RFC 8259, as
// encoding/json reads it: white space around the value allowed, nothing
// else after it) and returns its value.
func Parse(data []byte) (Value, bool) {
	start := skipSpace(data, 0)
	end, ok := skipValue(data, start, 0)
	if !ok || skipSpace(data, end) != len(data) {
		return Value{}, false
	}
	return Value{raw: data[start:end]}, true
}

// ParseMembers is Parse, then Members of the object data holds: false
// when data is not one valid JSON object or Members returns false.
func ParseMembers(data []byte, fields []string, strict bool, fn func(key string, val Value) bool) bool {
	v, ok := Parse(data)
	return ok && v.Members(fields, strict, fn)
}

// Raw returns the value's bytes (not a copy).
func (v Value) Raw() []byte { return v.raw }

// IsNull reports whether the value is null.
func (v Value) IsNull() bool { return len(v.raw) == 4 && v.raw[0] == 'n' }

// String returns the value of a JSON string that has no escape sequence
// (its bytes are then its value, once checked to be valid UTF-8).
func (v Value) String() (string, bool) {
	if len(v.raw) < 2 || v.raw[0] != '"' {
		return "", false
	}
	return plainString(v.raw[1 : len(v.raw)-1])
}

// Bool returns the value of true or false.
func (v Value) Bool() (bool, bool) {
	switch string(v.raw) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// Int returns an integer number that fits in bitSize bits.
func (v Value) Int(bitSize int) (int64, bool) {
	if len(v.raw) == 0 || (v.raw[0] != '-' && (v.raw[0] < '0' || v.raw[0] > '9')) {
		return 0, false
	}
	n, err := strconv.ParseInt(string(v.raw), 10, bitSize)
	return n, err == nil
}

// Uint returns a non-negative integer number that fits in bitSize bits.
func (v Value) Uint(bitSize int) (uint64, bool) {
	if len(v.raw) == 0 || v.raw[0] < '0' || v.raw[0] > '9' {
		return 0, false
	}
	n, err := strconv.ParseUint(string(v.raw), 10, bitSize)
	return n, err == nil
}

// Object calls fn for each member of an object, in order, and returns
// false when v is not an object, a key has an escape, a key repeats, or fn
// returns false.
func (v Value) Object(fn func(key string, val Value) bool) bool {
	if len(v.raw) < 2 || v.raw[0] != '{' {
		return false
	}
	var seen []string
	i := skipSpace(v.raw, 1)
	if v.raw[i] == '}' {
		return true
	}
	for {
		kend, _ := skipValue(v.raw, i, 0) // Parse checked the document
		key, ok := plainString(v.raw[i+1 : kend-1])
		if !ok {
			return false
		}
		for _, s := range seen {
			if s == key {
				return false
			}
		}
		seen = append(seen, key)
		i = skipSpace(v.raw, skipSpace(v.raw, kend)+1) // past ':'
		vend, _ := skipValue(v.raw, i, 0)
		if !fn(key, Value{raw: v.raw[i:vend]}) {
			return false
		}
		i = skipSpace(v.raw, vend)
		if v.raw[i] == '}' {
			return true
		}
		i = skipSpace(v.raw, i+1) // past ','
	}
}

// Array calls fn for each element of an array, in order, and returns false
// when v is not an array or fn returns false.
func (v Value) Array(fn func(val Value) bool) bool {
	if len(v.raw) < 2 || v.raw[0] != '[' {
		return false
	}
	i := skipSpace(v.raw, 1)
	if v.raw[i] == ']' {
		return true
	}
	for {
		end, _ := skipValue(v.raw, i, 0)
		if !fn(Value{raw: v.raw[i:end]}) {
			return false
		}
		i = skipSpace(v.raw, end)
		if v.raw[i] == ']' {
			return true
		}
		i = skipSpace(v.raw, i+1)
	}
}

// Strings returns an array of plain strings (no null, no escape).
func (v Value) Strings() ([]string, bool) {
	var out []string
	ok := v.Array(func(e Value) bool {
		s, ok := e.String()
		out = append(out, s)
		return ok
	})
	if ok && out == nil {
		out = []string{}
	}
	return out, ok
}

// plainString returns the bytes between a string's quotes when they need
// no unescaping: no backslash, and valid UTF-8 (encoding/json replaces
// invalid bytes, which this package leaves to it).
func plainString(b []byte) (string, bool) {
	ascii := true
	for _, c := range b {
		if c == '\\' || c < 0x20 {
			return "", false
		}
		if c >= utf8.RuneSelf {
			ascii = false
		}
	}
	if !ascii && !utf8.Valid(b) {
		return "", false
	}
	return string(b), true
}

// maxDepth bounds nesting, as encoding/json does (10000); far above any
// document this package is given.
const maxDepth = 10000

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipValue checks the value starting at b[i] and returns the index just
// after it.
func skipValue(b []byte, i, depth int) (int, bool) {
	if i >= len(b) || depth > maxDepth {
		return 0, false
	}
	switch c := b[i]; {
	case c == '{':
		i = skipSpace(b, i+1)
		if i < len(b) && b[i] == '}' {
			return i + 1, true
		}
		for {
			if i >= len(b) || b[i] != '"' {
				return 0, false
			}
			end, ok := skipString(b, i)
			if !ok {
				return 0, false
			}
			i = skipSpace(b, end)
			if i >= len(b) || b[i] != ':' {
				return 0, false
			}
			if i, ok = skipValue(b, skipSpace(b, i+1), depth+1); !ok {
				return 0, false
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return 0, false
			}
			if b[i] == '}' {
				return i + 1, true
			}
			if b[i] != ',' {
				return 0, false
			}
			i = skipSpace(b, i+1)
		}
	case c == '[':
		i = skipSpace(b, i+1)
		if i < len(b) && b[i] == ']' {
			return i + 1, true
		}
		for {
			var ok bool
			if i, ok = skipValue(b, i, depth+1); !ok {
				return 0, false
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return 0, false
			}
			if b[i] == ']' {
				return i + 1, true
			}
			if b[i] != ',' {
				return 0, false
			}
			i = skipSpace(b, i+1)
		}
	case c == '"':
		return skipString(b, i)
	case c == 't':
		return literal(b, i, "true")
	case c == 'f':
		return literal(b, i, "false")
	case c == 'n':
		return literal(b, i, "null")
	case c == '-' || (c >= '0' && c <= '9'):
		return skipNumber(b, i)
	}
	return 0, false
}

func literal(b []byte, i int, lit string) (int, bool) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return 0, false
	}
	return i + len(lit), true
}

// skipString checks the string starting at b[i] (its escapes included;
// the bytes' UTF-8 is checked only when read) and returns the index after
// its closing quote.
func skipString(b []byte, i int) (int, bool) {
	for i++; i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			return i + 1, true
		case c < 0x20:
			return 0, false
		case c == '\\':
			i++
			if i >= len(b) {
				return 0, false
			}
			switch b[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if len(b)-i < 5 {
					return 0, false
				}
				for _, h := range b[i+1 : i+5] {
					if !isHex(h) {
						return 0, false
					}
				}
				i += 4
			default:
				return 0, false
			}
		}
	}
	return 0, false
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// skipNumber checks -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func skipNumber(b []byte, i int) (int, bool) {
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		i = digits(b, i)
	default:
		return 0, false
	}
	if i < len(b) && b[i] == '.' {
		j := digits(b, i+1)
		if j == i+1 {
			return 0, false
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := digits(b, i)
		if j == i {
			return 0, false
		}
		i = j
	}
	return i, true
}

func digits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

// AppendString appends s as a JSON string when encoding/json would write
// it without escapes (printable ASCII but for '"', '\\', '<', '>' and '&',
// which it escapes for HTML); ok is false otherwise, and b is then
// returned unchanged.
func AppendString(b []byte, s string) ([]byte, bool) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c >= utf8.RuneSelf || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return b, false
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"'), true
}

// Writer builds a JSON document; once any string is refused, Bytes
// reports ok=false and the caller encodes with encoding/json instead.
type Writer struct {
	buf []byte
	bad bool
}

// Raw appends bytes as they are (punctuation, keys known to be plain).
func (w *Writer) Raw(s string) { w.buf = append(w.buf, s...) }

// String appends s as a JSON string (see AppendString).
func (w *Writer) String(s string) {
	var ok bool
	if w.buf, ok = AppendString(w.buf, s); !ok {
		w.bad = true
	}
}

// Int appends an integer.
func (w *Writer) Int(n int64) { w.buf = strconv.AppendInt(w.buf, n, 10) }

// Uint appends a non-negative integer.
func (w *Writer) Uint(n uint64) { w.buf = strconv.AppendUint(w.buf, n, 10) }

// Bool appends true or false.
func (w *Writer) Bool(v bool) { w.buf = strconv.AppendBool(w.buf, v) }

// Refuse marks the document as one to leave to encoding/json (a value
// this package does not write as encoding/json would, or that
// encoding/json refuses).
func (w *Writer) Refuse() { w.bad = true }

// Bytes returns the document, or ok=false if a string was refused.
func (w *Writer) Bytes() ([]byte, bool) { return w.buf, !w.bad }

// Members calls fn for each member of an object whose key is one of
// fields, as encoding/json would decode the object into a struct with
// those field names. It returns false (decode with encoding/json instead)
// when v is not an object or fn returns false, and for any key that
// encoding/json might match differently: one equal to a field but for
// case, or one with a non-ASCII byte. Other keys are ignored, or refused
// when strict (a decoder with DisallowUnknownFields).
func (v Value) Members(fields []string, strict bool, fn func(key string, val Value) bool) bool {
	return v.Object(func(key string, val Value) bool {
		for _, f := range fields {
			if key == f {
				return fn(key, val)
			}
		}
		if strict {
			return false
		}
		for i := 0; i < len(key); i++ {
			if key[i] >= utf8.RuneSelf {
				return false
			}
		}
		for _, f := range fields {
			if asciiEqualFold(key, f) {
				return false
			}
		}
		return true
	})
}

func asciiEqualFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}
