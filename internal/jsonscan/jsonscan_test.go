package jsonscan

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"
)

// randDoc writes a random JSON value, with random white space.
func randDoc(r *rand.Rand, b *bytes.Buffer, depth int) {
	ws := func() {
		for range r.IntN(3) {
			b.WriteByte(" \t\n\r"[r.IntN(4)])
		}
	}
	ws()
	k := r.IntN(8)
	if depth > 3 && k < 2 {
		k += 2
	}
	switch k {
	case 0:
		b.WriteByte('{')
		for i := range r.IntN(4) {
			if i > 0 {
				b.WriteByte(',')
			}
			ws()
			b.WriteString(quote(randString(r)))
			ws()
			b.WriteByte(':')
			randDoc(r, b, depth+1)
		}
		ws()
		b.WriteByte('}')
	case 1:
		b.WriteByte('[')
		for i := range r.IntN(4) {
			if i > 0 {
				b.WriteByte(',')
			}
			randDoc(r, b, depth+1)
		}
		ws()
		b.WriteByte(']')
	case 2, 3:
		b.WriteString(randStringLiteral(r))
	case 4:
		b.WriteString([]string{"true", "false", "null"}[r.IntN(3)])
	default:
		b.WriteString(randNumber(r))
	}
	ws()
}

func randString(r *rand.Rand) string {
	parts := []string{"a", "subnet", "Subnet", "é", "\xff", "<", "&", "\"", "\\", "/", "\n", "\u2028", "0", " ", "x-y.z"}
	var s strings.Builder
	for range r.IntN(5) {
		s.WriteString(parts[r.IntN(len(parts))])
	}
	return s.String()
}

// randStringLiteral is a JSON string literal, sometimes with escapes that
// strconv.Quote would not write.
func randStringLiteral(r *rand.Rand) string {
	if r.IntN(4) == 0 {
		esc := []string{`\u0041`, `\/`, `\ud83d\ude00`, `\ud800`, `\t`, `\"`}
		return `"a` + esc[r.IntN(len(esc))] + `b"`
	}
	if r.IntN(4) == 0 {
		return `"` + randString(r) + `"` // raw bytes: control characters, invalid UTF-8 included
	}
	return quote(randString(r))
}

// quote writes s as encoding/json does.
func quote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

func randNumber(r *rand.Rand) string {
	nums := []string{"0", "-0", "12", "-7", "1.5", "1e3", "1E+2", "2e-1", "18446744073709551615",
		"18446744073709551616", "9223372036854775807", "-9223372036854775808", "-9223372036854775809", "4294967296"}
	return nums[r.IntN(len(nums))]
}

func mutate(r *rand.Rand, b []byte) []byte {
	b = bytes.Clone(b)
	if len(b) == 0 {
		const alphabet = "{}[]\",:0-ntf"
		return []byte{alphabet[r.IntN(len(alphabet))]}
	}
	i := r.IntN(len(b))
	switch r.IntN(3) {
	case 0:
		return append(b[:i], b[i+1:]...)
	case 1:
		const alphabet = "{}[]\",:0-.eE+ntfu\\ "
		b[i] = alphabet[r.IntN(len(alphabet))]
		return b
	default:
		const alphabet = "{}[]\",:0-.eE+\\ "
		return append(b[:i], append([]byte{alphabet[r.IntN(len(alphabet))]}, b[i:]...)...)
	}
}

func TestParseAcceptsWhatEncodingJSONAccepts(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	valid, invalid := 0, 0
	for range 40000 {
		var b bytes.Buffer
		randDoc(r, &b, 0)
		doc := b.Bytes()
		if r.IntN(2) == 0 {
			doc = mutate(r, doc)
		}
		_, ok := Parse(doc)
		if want := json.Valid(doc); ok != want {
			t.Fatalf("Parse(%q) ok=%v, json.Valid %v", doc, ok, want)
		}
		if ok {
			valid++
		} else {
			invalid++
		}
	}
	if valid < 1000 || invalid < 1000 {
		t.Fatalf("generator too narrow: %d valid, %d invalid", valid, invalid)
	}
}

func TestReadersAgreeWithEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	var strs, ints, uints, objs int
	for range 40000 {
		var b bytes.Buffer
		randDoc(r, &b, 2)
		v, ok := Parse(b.Bytes())
		if !ok {
			if json.Valid(b.Bytes()) {
				t.Fatalf("Parse refused %q", b.Bytes())
			}
			continue
		}
		if s, ok := v.String(); ok {
			var want string
			if err := json.Unmarshal(v.Raw(), &want); err != nil || s != want {
				t.Fatalf("String(%q) = %q, encoding/json %q (%v)", v.Raw(), s, want, err)
			}
			strs++
		}
		if n, ok := v.Int(64); ok {
			var want int64
			if err := json.Unmarshal(v.Raw(), &want); err != nil || n != want {
				t.Fatalf("Int(%q) = %d, encoding/json %d (%v)", v.Raw(), n, want, err)
			}
			ints++
		} else {
			var x int64
			if string(v.Raw()) != "null" && json.Unmarshal(v.Raw(), &x) == nil {
				t.Fatalf("Int(%q) refused what encoding/json reads as %d", v.Raw(), x)
			}
		}
		if n, ok := v.Uint(64); ok {
			var want uint64
			if err := json.Unmarshal(v.Raw(), &want); err != nil || n != want {
				t.Fatalf("Uint(%q) = %d, encoding/json %d (%v)", v.Raw(), n, want, err)
			}
			uints++
		}
		if bv, ok := v.Bool(); ok {
			var want bool
			if err := json.Unmarshal(v.Raw(), &want); err != nil || bv != want {
				t.Fatalf("Bool(%q) = %v, encoding/json %v", v.Raw(), bv, want)
			}
		}
		got := map[string]json.RawMessage{}
		if v.Object(func(k string, e Value) bool { got[k] = e.Raw(); return true }) {
			var want map[string]json.RawMessage
			if err := json.Unmarshal(v.Raw(), &want); err != nil || len(want) != len(got) {
				t.Fatalf("Object(%q) = %q, encoding/json %q (%v)", v.Raw(), got, want, err)
			}
			for k, raw := range want {
				if !bytes.Equal(got[k], raw) {
					t.Fatalf("Object(%q)[%q] = %q, encoding/json %q", v.Raw(), k, got[k], raw)
				}
			}
			objs++
		}
		var elems []json.RawMessage
		if v.Array(func(e Value) bool { elems = append(elems, e.Raw()); return true }) {
			var want []json.RawMessage
			if err := json.Unmarshal(v.Raw(), &want); err != nil || len(want) != len(elems) {
				t.Fatalf("Array(%q) = %q, encoding/json %q", v.Raw(), elems, want)
			}
			for i := range want {
				if !bytes.Equal(elems[i], want[i]) {
					t.Fatalf("Array(%q)[%d] = %q, encoding/json %q", v.Raw(), i, elems[i], want[i])
				}
			}
		}
	}
	if strs < 1000 || ints < 500 || uints < 300 || objs < 300 {
		t.Fatalf("generator too narrow: %d strings, %d ints, %d uints, %d objects", strs, ints, uints, objs)
	}
}

func TestAppendStringMatchesMarshal(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	wrote := 0
	for range 20000 {
		s := randString(r)
		got, ok := AppendString([]byte("x"), s)
		if !ok {
			if string(got) != "x" {
				t.Fatalf("refused %q but wrote %q", s, got)
			}
			continue
		}
		want, _ := json.Marshal(s)
		if string(got) != "x"+string(want) {
			t.Fatalf("AppendString(%q) = %q, json.Marshal %q", s, got[1:], want)
		}
		wrote++
	}
	if wrote < 1000 {
		t.Fatalf("only %d strings written", wrote)
	}
}

func TestMembersRefusesWhatEncodingJSONMightMatchOtherwise(t *testing.T) {
	fields := []string{"subnet", "gateway"}
	for doc, want := range map[string]bool{
		`{"subnet":"a","other":1}`:    true,
		`{"Subnet":"a"}`:              false, // encoding/json matches it case-insensitively
		`{"subnet":"a","subnet":"b"}`: false, // duplicate
		`{"sub\u006eet":"a"}`:         false, // escaped key
		`{"ſubnet":"a"}`:              false, // non-ASCII key (Unicode folding)
		`[]`:                          false,
	} {
		v, ok := Parse([]byte(doc))
		if !ok {
			t.Fatalf("Parse(%s) failed", doc)
		}
		if got := v.Members(fields, false, func(string, Value) bool { return true }); got != want {
			t.Errorf("Members(%s) = %v, want %v", doc, got, want)
		}
	}
	v, _ := Parse([]byte(`{"subnet":"a","other":1}`))
	if v.Members(fields, true, func(string, Value) bool { return true }) {
		t.Error("strict Members accepted an unknown key")
	}
}
