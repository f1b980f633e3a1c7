package routes

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/ringipam/ringipam/pkg/pool"
)

func a(s string) netip.Addr   { return netip.MustParseAddr(s) }
func p(s string) netip.Prefix { return netip.MustParsePrefix(s) }
func pfx(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = p(s)
	}
	return out
}

func TestPrefixes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		lo, hi string
		want   []netip.Prefix
	}{
		{"one address", "10.0.0.5", "10.0.0.5", pfx("10.0.0.5/32")},
		{"aligned /24", "10.0.0.0", "10.0.0.255", pfx("10.0.0.0/24")},
		{"skips network and broadcast", "10.0.0.1", "10.0.0.254", pfx(
			"10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/30", "10.0.0.8/29", "10.0.0.16/28", "10.0.0.32/27", "10.0.0.64/26",
			"10.0.0.128/26", "10.0.0.192/27", "10.0.0.224/28", "10.0.0.240/29", "10.0.0.248/30", "10.0.0.252/31", "10.0.0.254/32")},
		{"half of a /24", "10.0.0.128", "10.0.0.255", pfx("10.0.0.128/25")},
		{"across an octet", "10.0.0.192", "10.0.1.63", pfx("10.0.0.192/26", "10.0.1.0/26")},
		{"whole IPv4", "0.0.0.0", "255.255.255.255", pfx("0.0.0.0/0")},
		{"to the top", "255.255.255.254", "255.255.255.255", pfx("255.255.255.254/31")},
		{"IPv6 two /65", "fd00::", "fd00::ffff:ffff:ffff:ffff", pfx("fd00::/64")},
		{"IPv6 whole", "::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", pfx("::/0")},
		{"reversed", "10.0.0.9", "10.0.0.1", nil},
		{"mixed families", "10.0.0.1", "fd00::1", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Prefixes(a(tc.lo), a(tc.hi))
			if diff := cmp.Diff(tc.want, got, cmp.Comparer(func(x, y netip.Prefix) bool { return x == y })); diff != "" {
				t.Fatalf("Prefixes(%s, %s) (-want +got):\n%s", tc.lo, tc.hi, diff)
			}
			checkCover(t, a(tc.lo), a(tc.hi), got)
		})
	}
}

// checkCover checks that ps are in order, adjacent, exactly cover [lo, hi]
// and that no two neighbours could merge into one prefix.
func checkCover(t *testing.T, lo, hi netip.Addr, ps []netip.Prefix) {
	t.Helper()
	if len(ps) == 0 {
		return
	}
	if ps[0].Addr() != lo || pool.LastAddr(ps[len(ps)-1]) != hi {
		t.Fatalf("%v does not run from %s to %s", ps, lo, hi)
	}
	for i, q := range ps {
		if q.Masked() != q {
			t.Fatalf("%s is not masked", q)
		}
		if i == 0 {
			continue
		}
		prev := ps[i-1]
		if pool.LastAddr(prev).Next() != q.Addr() {
			t.Fatalf("%s does not follow %s", q, prev)
		}
		if prev.Bits() == q.Bits() && netip.PrefixFrom(prev.Addr(), prev.Bits()-1).Masked().Addr() == prev.Addr() {
			t.Fatalf("%s and %s would merge", prev, q)
		}
	}
}

func TestPrefixesCover(t *testing.T) {
	// A /64 without its first address: one prefix per bit.
	v6 := Prefixes(a("fd00::1"), a("fd00::ffff:ffff:ffff:ffff"))
	checkCover(t, a("fd00::1"), a("fd00::ffff:ffff:ffff:ffff"), v6)
	if len(v6) != 64 {
		t.Fatalf("fd00::1-fd00::ffff:ffff:ffff:ffff: %d prefixes, want 64: %v", len(v6), v6)
	}
	// Every range inside 10.0.0.0/26: exact, minimal cover.
	base := a("10.0.0.0")
	lo := base
	for i := 0; i < 64; i++ {
		hi := lo
		for j := i; j < 64; j++ {
			ps := Prefixes(lo, hi)
			checkCover(t, lo, hi, ps)
			hi = hi.Next()
		}
		lo = lo.Next()
	}
}

// def4 is pool p4: 10.0.0.0/24 with gateway 10.0.0.1, allocatable
// 10.0.0.2-10.0.0.254.
var def4 = pool.Def{Name: "p4", Ranges: []pool.Range{{Subnet: p("10.0.0.0/24"), Start: a("10.0.0.1"), End: a("10.0.0.254"), Gateway: a("10.0.0.1")}}}

// def6 is pool p6: fd00:1::/120 with gateway fd00:1::1.
var def6 = pool.Def{Name: "p6", Ranges: []pool.Range{{Subnet: p("fd00:1::/120"), Start: a("fd00:1::1"), End: a("fd00:1::ff"), Gateway: a("fd00:1::1")}}}

func ring(name string, rs ...pool.OwnedRange) pool.Ring { return pool.Ring{Pool: name, Ranges: rs} }

func own(lo, hi, host string) pool.OwnedRange {
	return pool.OwnedRange{Start: a(lo), End: a(hi), Host: host}
}

func tomb(lo, hi, host string) pool.OwnedRange {
	return pool.OwnedRange{Start: a(lo), End: a(hi), Host: host, Tombstone: true}
}

func host(name string, st pool.HostState, addrs ...string) Host {
	h := Host{Name: name, State: st, Recorded: strings.Join(addrs, ",")}
	for _, s := range addrs {
		h.Addrs = append(h.Addrs, a(s))
	}
	return h
}

var lan = pfx("192.168.1.10/24", "fd99::10/64")

func rt(dst, via, h, pl string) Route { return Route{Dst: p(dst), Via: a(via), Host: h, Pool: pl} }

func TestPlan(t *testing.T) {
	up := pool.HostUp
	for _, tc := range []struct {
		name    string
		in      Input
		want    []Route
		refused []string // substrings of each refusal's String, in order
	}{
		{
			name: "claims: each other host's ranges, own skipped, gateway clipped",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.63", "a"), own("10.0.0.64", "10.0.0.127", "b"), own("10.0.0.128", "10.0.0.254", "c"))}},
				Hosts: []Host{host("a", up, "192.168.1.10"), host("b", up, "192.168.1.11"), host("c", up, "192.168.1.12")}},
			want: []Route{
				rt("10.0.0.64/26", "192.168.1.11", "b", "p4"),
				rt("10.0.0.128/26", "192.168.1.12", "c", "p4"),
				rt("10.0.0.192/27", "192.168.1.12", "c", "p4"),
				rt("10.0.0.224/28", "192.168.1.12", "c", "p4"),
				rt("10.0.0.240/29", "192.168.1.12", "c", "p4"),
				rt("10.0.0.248/30", "192.168.1.12", "c", "p4"),
				rt("10.0.0.252/31", "192.168.1.12", "c", "p4"),
				rt("10.0.0.254/32", "192.168.1.12", "c", "p4"),
			},
		},
		{
			name: "gateway inside another host's range is never routed",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.1", "10.0.0.7", "b"), pool.OwnedRange{Start: a("10.0.0.8"), End: a("10.0.0.254")})}},
				Hosts: []Host{host("b", up, "192.168.1.11")}},
			want: []Route{rt("10.0.0.2/31", "192.168.1.11", "b", "p4"), rt("10.0.0.4/30", "192.168.1.11", "b", "p4")},
		},
		{
			name: "donation: a single address moved to b inside a's space",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.9", "a"), own("10.0.0.10", "10.0.0.10", "b"), own("10.0.0.11", "10.0.0.254", "a"))}},
				Hosts: []Host{host("b", up, "192.168.1.11")}},
			want: []Route{rt("10.0.0.10/32", "192.168.1.11", "b", "p4")},
		},
		{
			name: "tombstones and unowned space get no route; the reclaiming owner's do",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", tomb("10.0.0.2", "10.0.0.63", "b"), own("10.0.0.64", "10.0.0.127", "c"), pool.OwnedRange{Start: a("10.0.0.128"), End: a("10.0.0.254")})}},
				Hosts: []Host{host("b", pool.HostDown, "192.168.1.11"), host("c", up, "192.168.1.12")}},
			want: []Route{rt("10.0.0.64/26", "192.168.1.12", "c", "p4")},
		},
		{
			name: "down keeps its routes, orphaned loses them",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.63", "a"), own("10.0.0.64", "10.0.0.127", "b"), own("10.0.0.128", "10.0.0.191", "c"), own("10.0.0.192", "10.0.0.254", "a"))}},
				Hosts: []Host{host("b", pool.HostDown, "192.168.1.11"), host("c", pool.HostOrphaned, "192.168.1.12")}},
			want: []Route{rt("10.0.0.64/26", "192.168.1.11", "b", "p4")},
		},
		{
			name: "both families, next hop of the pool's family",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{
					{def6, ring("p6", own("fd00:1::2", "fd00:1::7f", "a"), own("fd00:1::80", "fd00:1::ff", "b"))},
					{def4, ring("p4", own("10.0.0.2", "10.0.0.127", "a"), own("10.0.0.128", "10.0.0.254", "b"))}},
				Hosts: []Host{host("b", up, "192.168.1.11", "fd99::11")}},
			want: []Route{
				rt("10.0.0.128/26", "192.168.1.11", "b", "p4"), rt("10.0.0.192/27", "192.168.1.11", "b", "p4"),
				rt("10.0.0.224/28", "192.168.1.11", "b", "p4"), rt("10.0.0.240/29", "192.168.1.11", "b", "p4"),
				rt("10.0.0.248/30", "192.168.1.11", "b", "p4"), rt("10.0.0.252/31", "192.168.1.11", "b", "p4"),
				rt("10.0.0.254/32", "192.168.1.11", "b", "p4"),
				rt("fd00:1::80/121", "fd99::11", "b", "p6"),
			},
		},
		{
			name: "dual-stack hosts from the store: one address per family, either order",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{
					{def6, ring("p6", own("fd00:1::2", "fd00:1::7f", "b"), own("fd00:1::80", "fd00:1::ff", "c"))},
					{def4, ring("p4", own("10.0.0.2", "10.0.0.127", "c"), own("10.0.0.128", "10.0.0.254", "a"))}},
				Hosts: HostsFrom([]pool.HostInfo{
					{Name: "b", State: up, Addr: "192.168.1.11,fd99::11"},
					{Name: "c", State: pool.HostDown, Addr: "fd99::12,192.168.1.12"}})},
			want: []Route{
				rt("10.0.0.2/31", "192.168.1.12", "c", "p4"), rt("10.0.0.4/30", "192.168.1.12", "c", "p4"),
				rt("10.0.0.8/29", "192.168.1.12", "c", "p4"), rt("10.0.0.16/28", "192.168.1.12", "c", "p4"),
				rt("10.0.0.32/27", "192.168.1.12", "c", "p4"), rt("10.0.0.64/26", "192.168.1.12", "c", "p4"),
				rt("fd00:1::2/127", "fd99::11", "b", "p6"), rt("fd00:1::4/126", "fd99::11", "b", "p6"),
				rt("fd00:1::8/125", "fd99::11", "b", "p6"), rt("fd00:1::10/124", "fd99::11", "b", "p6"),
				rt("fd00:1::20/123", "fd99::11", "b", "p6"), rt("fd00:1::40/122", "fd99::11", "b", "p6"),
				rt("fd00:1::80/121", "fd99::12", "c", "p6"),
			},
		},
		{
			name: "old single-address record: its family routed, the other refused",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{
					{def6, ring("p6", own("fd00:1::2", "fd00:1::ff", "b"))},
					{def4, ring("p4", own("10.0.0.2", "10.0.0.63", "a"), own("10.0.0.64", "10.0.0.127", "b"), own("10.0.0.128", "10.0.0.254", "a"))}},
				Hosts: HostsFrom([]pool.HostInfo{{Name: "b", State: up, Addr: "192.168.1.11"}})},
			want:    []Route{rt("10.0.0.64/26", "192.168.1.11", "b", "p4")},
			refused: []string{"host b not routed: the host has no IPv6 address (--addr 192.168.1.11); an IPv6 pool needs a next hop of its family: give its agent one address per family (--addr <IPv4>,<IPv6>)"},
		},
		{
			name: "dual-stack record with an IPv6 part that is not an IP: IPv4 routed, IPv6 refused",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{
					{def6, ring("p6", own("fd00:1::2", "fd00:1::ff", "b"))},
					{def4, ring("p4", own("10.0.0.64", "10.0.0.127", "b"))}},
				Hosts: HostsFrom([]pool.HostInfo{{Name: "b", State: up, Addr: "192.168.1.11,fd99::zz"}})},
			want:    []Route{rt("10.0.0.64/26", "192.168.1.11", "b", "p4")},
			refused: []string{`the host's recorded address "fd99::zz" is not an IP address`},
		},
		{
			name: "IPv6 pool, host with only an IPv4 address: refused",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def6, ring("p6", own("fd00:1::2", "fd00:1::ff", "b"))}},
				Hosts: []Host{host("b", up, "192.168.1.11")}},
			refused: []string{"host b not routed: the host has no IPv6 address (--addr 192.168.1.11)"},
		},
		{
			name: "next hop off-link: refused, nothing installed for that host",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.127", "b"), own("10.0.0.128", "10.0.0.191", "c"))}},
				Hosts: []Host{host("b", up, "172.16.0.11"), host("c", up, "192.168.1.12")}},
			want:    []Route{rt("10.0.0.128/26", "192.168.1.12", "c", "p4")},
			refused: []string{"range 10.0.0.2-10.0.0.127 of host b not routed: next hop 172.16.0.11 is not on a network directly connected to this host: hosts on different L2 segments need an overlay or BGP"},
		},
		{
			name: "host without --addr: refused",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.127", "b"))}},
				Hosts: []Host{{Name: "b", State: up}}},
			refused: []string{"host b not routed: the host has no recorded address (its agent runs without --addr)"},
		},
		{
			name: "recorded address not an IP: refused",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.127", "b"))}},
				Hosts: HostsFrom([]pool.HostInfo{{Name: "b", State: up, Addr: "nohost"}})},
			refused: []string{`the host's recorded address "nohost" is not an IP address`},
		},
		{
			name: "next hop is this host's own address: refused",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.127", "b"))}},
				Hosts: []Host{host("b", up, "192.168.1.10")}},
			refused: []string{"next hop 192.168.1.10 is an address of this host (a)"},
		},
		{
			name: "host only in the ring: refused",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{def4, ring("p4", own("10.0.0.2", "10.0.0.127", "b"))}}},
			refused: []string{"the host is not known to the store"},
		},
		{
			name: "exclusions are not routed",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{{pool.Def{Name: "px", Ranges: def4.Ranges, Exclude: pfx("10.0.0.64/27")}, ring("px", own("10.0.0.64", "10.0.0.127", "b"))}},
				Hosts: []Host{host("b", up, "192.168.1.11")}},
			want: []Route{rt("10.0.0.96/27", "192.168.1.11", "b", "px")},
		},
		{
			name: "overlapping isolated pools: first pool keeps the prefix",
			in: Input{Self: "a", OnLink: lan,
				Pools: []Pool{
					{pool.Def{Name: "q2", Ranges: def4.Ranges, Isolated: true}, ring("q2", own("10.0.0.64", "10.0.0.127", "c"))},
					{pool.Def{Name: "q1", Ranges: def4.Ranges, Isolated: true}, ring("q1", own("10.0.0.64", "10.0.0.127", "b"))}},
				Hosts: []Host{host("b", up, "192.168.1.11"), host("c", up, "192.168.1.12")}},
			want:    []Route{rt("10.0.0.64/26", "192.168.1.11", "b", "q1")},
			refused: []string{"10.0.0.64/26 is already routed via 192.168.1.11 for host b of pool q1"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Plan(tc.in)
			if diff := cmp.Diff(tc.want, got.Routes, cmp.Comparer(func(x, y netip.Addr) bool { return x == y }), cmp.Comparer(func(x, y netip.Prefix) bool { return x == y })); diff != "" {
				t.Errorf("routes (-want +got):\n%s", diff)
			}
			if len(got.Refused) != len(tc.refused) {
				t.Fatalf("refused %d, want %d: %v", len(got.Refused), len(tc.refused), got.Refused)
			}
			for i, r := range got.Refused {
				if !strings.Contains(r.String(), tc.refused[i]) {
					t.Errorf("refusal %d = %q, want it to contain %q", i, r, tc.refused[i])
				}
			}
		})
	}
}
