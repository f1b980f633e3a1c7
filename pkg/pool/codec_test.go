package pool

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
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

// roundTrip encodes v, decodes the bytes into a zero T and wants v back:
// what a commit writes is what the next read sees.
func roundTrip[T any](t *testing.T, v T, enc func(T) ([]byte, error), dec func([]byte, *T) error) {
	t.Helper()
	b, err := enc(v)
	if err != nil {
		t.Fatalf("encoding %#v: %v", v, err)
	}
	var got T
	if err := dec(b, &got); err != nil {
		t.Fatalf("decoding %s: %v", b, err)
	}
	if bytes.Contains(b, []byte(`\ufffd`)) {
		return // invalid UTF-8 (the generator makes some) comes back as U+FFFD
	}
	// An empty list is written as none (omitempty): nil and empty are one.
	if diff := cmp.Diff(v, got, cmpopts.EquateEmpty(), cmp.Comparer(func(a, b netip.Addr) bool { return a.Compare(b) == 0 }),
		cmp.Comparer(func(a, b netip.Prefix) bool { return a.Addr().Compare(b.Addr()) == 0 && a.Bits() == b.Bits() })); diff != "" {
		t.Fatalf("round trip of %s (-want +got):\n%s", b, diff)
	}
}

// defRecord is Def without its methods.
type defRecord Def

// TestCodecRoundTrip writes and reads random records of every kind.
func TestCodecRoundTrip(t *testing.T) {
	g := codecGen{rand.New(rand.NewPCG(7, 8))}
	for range 3000 {
		roundTrip(t, g.hostState(), func(h hostState) ([]byte, error) { return encodeHostState(h), nil }, decodeHostState)
		roundTrip(t, g.tokens(), func(ts []token) ([]byte, error) { return encodeTokens(ts), nil }, decodeTokens)
		roundTrip(t, g.allocation(), encodeAllocation, decodeAllocation)
		// As defRecord: cmp would otherwise use Def.Equal, which compares
		// normalized definitions (and the generator's are not all valid).
		roundTrip(t, defRecord(g.def()), func(d defRecord) ([]byte, error) { return json.Marshal(Def(d)) },
			func(b []byte, d *defRecord) error { return decodeDefJSON(b, (*Def)(d)) })
		if rs := g.def().Ranges; !bytes.Equal(RangesJSON(rs), must(json.Marshal(rs))) {
			t.Fatalf("RangesJSON(%#v) is not json.Marshal's", rs)
		}
	}
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}
