package pool

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"
)

type codecGen struct{ r *rand.Rand }

func (g codecGen) pick(xs ...string) string { return xs[g.r.IntN(len(xs))] }

func (g codecGen) str() string {
	return g.pick("", "h1", "cni", "net-1", "c0ffee", "eth0", "ns/pod", "a<b", "x&y", `q"uote`, `back\slash`, "é", "\x01", "\xff", "tab\t", "\u2028")
}

func (g codecGen) addr() netip.Addr {
	switch g.r.IntN(6) {
	case 0:
		return netip.Addr{}
	case 1:
		return netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(g.r.IntN(256))})
	case 2:
		return netip.AddrFrom16(netip.AddrFrom4([4]byte{198, 18, 0, byte(g.r.IntN(256))}).As16()) // 4-in-6
	case 3:
		return netip.MustParseAddr("fe80::1%eth0")
	}
	return netip.AddrFrom4([4]byte{198, 18, byte(g.r.IntN(256)), byte(g.r.IntN(256))})
}

func (g codecGen) prefix() netip.Prefix {
	if g.r.IntN(8) == 0 {
		return netip.Prefix{}
	}
	a := g.addr()
	if !a.IsValid() || a.Zone() != "" {
		a = netip.AddrFrom4([4]byte{198, 18, 0, 0})
	}
	return netip.PrefixFrom(a, g.r.IntN(a.BitLen()+1))
}

func (g codecGen) u64() uint64 {
	return []uint64{0, 1, 42, 1 << 32, 1<<64 - 1}[g.r.IntN(5)]
}

func (g codecGen) i64() int64 {
	return []int64{0, 1, -1, 1764000000, -1 << 63, 1<<63 - 1}[g.r.IntN(6)]
}

func (g codecGen) hostState() hostState {
	return hostState{Cursor: g.addr(), Used: g.u64(), Next: g.addr(), Run: g.u64(), Seen: g.i64()}
}

func (g codecGen) tokens() []token {
	if g.r.IntN(8) == 0 {
		return nil
	}
	ts := []token{}
	for range g.r.IntN(4) {
		ts = append(ts, token{Start: g.addr(), Host: g.str(), Tomb: g.r.IntN(2) == 0})
	}
	return ts
}

func (g codecGen) allocation() Allocation {
	a := Allocation{Owner: Owner{Kind: Kind(g.pick("cni", "docker", "port", "")), Network: g.str(), ContainerID: g.str(), IfName: g.str()}, Host: g.str(), Reservation: g.str()}
	if g.r.IntN(6) > 0 {
		a.Addrs = []Assigned{}
		for range g.r.IntN(3) {
			a.Addrs = append(a.Addrs, Assigned{Pool: g.str(), Role: Role(g.pick("container", "gateway", "")), Addr: g.addr()})
		}
	}
	return a
}

func (g codecGen) def() Def {
	d := Def{Name: g.str(), Isolated: g.r.IntN(2) == 0}
	if g.r.IntN(6) > 0 {
		d.Ranges = []Range{}
		for range g.r.IntN(3) {
			d.Ranges = append(d.Ranges, Range{Subnet: g.prefix(), Start: g.addr(), End: g.addr(), Gateway: g.addr()})
		}
	}
	if g.r.IntN(3) == 0 {
		d.Exclude = []netip.Prefix{}
		for range g.r.IntN(3) {
			d.Exclude = append(d.Exclude, g.prefix())
		}
	}
	return d
}

func (g codecGen) event() Event {
	times := []time.Time{
		time.Unix(1764000000, int64(g.r.IntN(1e9))),
		time.Unix(1764000000, 0).UTC(),
		time.Date(2026, 11, 24, 10, 0, 0, 500, time.FixedZone("x", 3600)),
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC), // encoding/json refuses it
		{},
	}
	return Event{Time: times[g.r.IntN(len(times))], What: g.pick(EventAlloc, EventRelease, EventHold), Owner: g.str(), Host: g.str(), Reserv: g.str(), Addr: g.addr()}
}

// variants returns doc and documents made from it that the fast decoders
// must hand to encoding/json, or read as it does: a key in other case,
// a null, an escape, an unknown or repeated key, a wrong type, spaces.
func (g codecGen) variants(doc []byte) [][]byte {
	out := [][]byte{doc}
	s := string(doc)
	for _, k := range []string{`"u":`, `"c":`, `"s":`, `"h":`, `"owner":`, `"kind":`, `"addrs":`, `"addr":`, `"name":`, `"ranges":`, `"subnet":`, `"exclude":`} {
		if !strings.Contains(s, k) {
			continue
		}
		up := `"` + strings.ToUpper(k[1:2]) + k[2:]
		out = append(out,
			[]byte(strings.Replace(s, k, up, 1)),
			[]byte(strings.Replace(s, k, k+`null,"zz":`, 1)),
			[]byte(strings.Replace(s, k, k+`"\u0031","zz":`, 1)),
			[]byte(strings.Replace(s, k, k+`7,"zz":`, 1)),
			[]byte(strings.Replace(s, k, k+`[],"zz":`, 1)),
			[]byte(strings.Replace(s, k, ` `+k+` `, 1)),
		)
	}
	if strings.HasPrefix(s, "{") {
		out = append(out, []byte(`{"unknown":[1,{"a":null}],`+s[1:]), []byte(s[:len(s)-1]+`,"extra":true}`))
	}
	out = append(out, []byte(s+"x"), []byte("null"), []byte(`"x"`))
	return out
}

// checkCodec compares a fast encoder with json.Marshal, and a fast decoder
// with json.Unmarshal on the encoding and its variants, into zero and into
// prefilled targets.
func checkCodec[T any](t *testing.T, g codecGen, v T, prefill func() T, enc func(T) ([]byte, error), dec func([]byte, *T) error) (fast int) {
	t.Helper()
	got, gotErr := enc(v)
	want, wantErr := json.Marshal(v)
	if (gotErr != nil) != (wantErr != nil) || !bytes.Equal(got, want) {
		t.Fatalf("encoding %#v:\nfast          %s (%v)\nencoding/json %s (%v)", v, got, gotErr, want, wantErr)
	}
	if wantErr != nil {
		return 0
	}
	for _, doc := range g.variants(want) {
		for _, start := range []func() T{func() T { var z T; return z }, prefill} {
			a, b := start(), start()
			errA := dec(doc, &a)
			fastCodec = false
			errB := dec(doc, &b)
			fastCodec = true
			if fmt.Sprint(errA) != fmt.Sprint(errB) || !reflect.DeepEqual(a, b) {
				t.Fatalf("decoding %s:\nfast          %#v (%v)\nencoding/json %#v (%v)", doc, a, errA, b, errB)
			}
			if errA == nil {
				fast++
			}
		}
	}
	return fast
}

func TestCodecMatchesEncodingJSON(t *testing.T) {
	g := codecGen{rand.New(rand.NewPCG(7, 8))}
	var n [5]int
	for range 3000 {
		n[0] += checkCodec(t, g, g.hostState(), func() hostState { return hostState{Used: 3, Seen: 9} },
			func(h hostState) ([]byte, error) { return encodeHostState(h), nil }, decodeHostState)
		n[1] += checkCodec(t, g, g.tokens(), func() []token { return nil },
			func(ts []token) ([]byte, error) { return encodeTokens(ts), nil }, decodeTokens)
		n[2] += checkCodec(t, g, g.allocation(), func() Allocation {
			return Allocation{Owner: Owner{Kind: KindCNI, Network: "pre", ContainerID: "c"}, Host: "h0", Reservation: "r0"}
		}, encodeAllocation, decodeAllocation)
		n[3] += checkCodec(t, g, g.def(), func() Def { return Def{Name: "pre", Isolated: true} },
			func(d Def) ([]byte, error) { b, err := json.Marshal(d); return b, err }, decodeDefJSON)
		ev := g.event()
		got := encodeEvent(ev)
		want, _ := json.Marshal(ev)
		if !bytes.Equal(got, want) {
			t.Fatalf("event %#v:\nfast          %s\nencoding/json %s", ev, got, want)
		}
		rs := g.def().Ranges
		if got, want := RangesJSON(rs), must(json.Marshal(rs)); !bytes.Equal(got, want) {
			t.Fatalf("ranges %#v:\nfast          %s\nencoding/json %s", rs, got, want)
		}
		n[4]++
	}
	for i, c := range n[:4] {
		if c < 3000 {
			t.Fatalf("codec %d: only %d successful decodes compared", i, c)
		}
	}
	t.Logf("successful decodes compared: hostState %d, tokens %d, Allocation %d, Def %d", n[0], n[1], n[2], n[3])
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}
