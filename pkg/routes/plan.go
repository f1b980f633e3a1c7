package routes

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
)

// Host is one host as the planner sees it.
type Host struct {
	Name  string
	State pool.HostState
	// Addrs are where the host is reached (its agent's --addr, at most
	// one address per family); the next hop of a pool is its address of
	// the pool's family.
	Addrs []netip.Addr
	// Recorded is the address as the store holds it, for messages (set by
	// HostsFrom; one address per family separated by commas; a part may
	// fail to parse).
	Recorded string
}

// HostsFrom turns the store's host list (pool.Allocator.Hosts) into the
// planner's hosts: each address of the recorded --addr parsed as an IP
// address (a record of one address, as agents before dual-stack hosts
// wrote it, gives one).
func HostsFrom(infos []pool.HostInfo) []Host {
	out := make([]Host, 0, len(infos))
	for _, i := range infos {
		h := Host{Name: i.Name, State: i.State, Recorded: i.Addr}
		for _, s := range i.AddrList() {
			if a, err := netip.ParseAddr(s); err == nil {
				h.Addrs = append(h.Addrs, a.Unmap())
			}
		}
		out = append(out, h)
	}
	return out
}

// Pool is one pool's definition and ring, as read from the store.
type Pool struct {
	Def  pool.Def
	Ring pool.Ring
}

// Input is everything a plan is made of.
type Input struct {
	Self  string // this host's name
	Pools []Pool
	Hosts []Host
	// OnLink are the prefixes directly connected to this host (its
	// interfaces' addresses with their prefix lengths).
	OnLink []netip.Prefix
}

// Route is one desired route: Dst through Via, for Host's range in Pool.
type Route struct {
	Dst  netip.Prefix
	Via  netip.Addr
	Host string
	Pool string
}

func (r Route) String() string {
	return fmt.Sprintf("%s via %s (host %s, pool %s)", r.Dst, r.Via, r.Host, r.Pool)
}

// Refusal is a range of another live host that gets no route, and why.
type Refusal struct {
	Pool       string
	Host       string
	Start, End netip.Addr
	Reason     string
}

func (r Refusal) String() string {
	return fmt.Sprintf("pool %s: range %s-%s of host %s not routed: %s", r.Pool, r.Start, r.End, r.Host, r.Reason)
}

// Result is a plan: the routes to install and the refusals.
type Result struct {
	Routes  []Route
	Refused []Refusal
}

// interval is an inclusive address range of one family.
type interval struct{ lo, hi netip.Addr }

// Plan computes the routes of in (see the package doc for the rules).
func Plan(in Input) Result {
	hosts := map[string]Host{}
	for _, h := range in.Hosts {
		hosts[h.Name] = h
	}
	pools := slices.Clone(in.Pools)
	slices.SortFunc(pools, func(a, b Pool) int { return strings.Compare(a.Def.Name, b.Def.Name) })
	var res Result
	taken := map[netip.Prefix]Route{}
	for _, p := range pools {
		segs := segments(p.Def)
		for _, r := range p.Ring.Ranges {
			if r.Host == "" || r.Tombstone || r.Host == in.Self {
				continue
			}
			h, known := hosts[r.Host]
			if known && h.State == pool.HostOrphaned {
				continue
			}
			refuse := func(reason string) {
				res.Refused = append(res.Refused, Refusal{Pool: p.Def.Name, Host: r.Host, Start: r.Start, End: r.End, Reason: reason})
			}
			parts := clip(interval{r.Start, r.End}, segs)
			if len(parts) == 0 {
				continue
			}
			if !known {
				refuse("the host is not known to the store (no host record, liveness key or host state)")
				continue
			}
			via, reason := nextHop(in, h, r.Start.Is4())
			if reason != "" {
				refuse(reason)
				continue
			}
			for _, iv := range parts {
				for _, dst := range Prefixes(iv.lo, iv.hi) {
					rt := Route{Dst: dst, Via: via, Host: h.Name, Pool: p.Def.Name}
					if prev, ok := taken[dst]; ok {
						if prev.Via != via {
							res.Refused = append(res.Refused, Refusal{Pool: p.Def.Name, Host: r.Host, Start: dst.Addr(), End: pool.LastAddr(dst),
								Reason: fmt.Sprintf("%s is already routed via %s for host %s of pool %s (overlapping isolated pools)", dst, prev.Via, prev.Host, prev.Pool)})
						}
						continue
					}
					taken[dst] = rt
					res.Routes = append(res.Routes, rt)
				}
			}
		}
	}
	slices.SortFunc(res.Routes, func(a, b Route) int {
		return cmp.Or(a.Dst.Addr().Compare(b.Dst.Addr()), cmp.Compare(a.Dst.Bits(), b.Dst.Bits()))
	})
	return res
}

// nextHop picks h's address of the family and checks it is usable from
// this host; reason is "" when it is.
func nextHop(in Input, h Host, is4 bool) (netip.Addr, string) {
	fam := "IPv6"
	if is4 {
		fam = "IPv4"
	}
	var via netip.Addr
	for _, a := range h.Addrs {
		if a = a.Unmap(); a.Is4() == is4 {
			via = a
			break
		}
	}
	if !via.IsValid() {
		for _, s := range pool.SplitAddrs(h.Recorded) {
			if _, err := netip.ParseAddr(s); err != nil {
				return netip.Addr{}, fmt.Sprintf("the host's recorded address %q is not an IP address", s)
			}
		}
		if len(h.Addrs) == 0 {
			return netip.Addr{}, "the host has no recorded address (its agent runs without --addr)"
		}
		return netip.Addr{}, fmt.Sprintf("the host has no %s address (--addr %s); an %s pool needs a next hop of its family: "+
			"give its agent one address per family (--addr <IPv4>,<IPv6>)", fam, joinAddrs(h.Addrs), fam)
	}
	for _, p := range in.OnLink {
		if p.Addr().Unmap() == via {
			return netip.Addr{}, fmt.Sprintf("next hop %s is an address of this host (%s): two hosts record the same --addr", via, in.Self)
		}
	}
	for _, p := range in.OnLink {
		if p.Masked().Contains(via) {
			return via, ""
		}
	}
	return netip.Addr{}, fmt.Sprintf("next hop %s is not on a network directly connected to this host: "+
		"hosts on different L2 segments need an overlay or BGP, which ringipam does not provide", via)
}

func joinAddrs(as []netip.Addr) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

// segments returns d's allocatable addresses as sorted disjoint intervals:
// each range's [Start, End] minus gateways and exclusions.
func segments(d pool.Def) []interval {
	var segs []interval
	for _, r := range d.Ranges {
		if r.Start.IsValid() && r.End.IsValid() && r.Start.Compare(r.End) <= 0 {
			segs = append(segs, interval{r.Start, r.End})
		}
	}
	slices.SortFunc(segs, func(a, b interval) int { return a.lo.Compare(b.lo) })
	for _, r := range d.Ranges {
		if r.Gateway.IsValid() {
			segs = subtract(segs, interval{r.Gateway, r.Gateway})
		}
	}
	for _, p := range d.Exclude {
		p = p.Masked()
		segs = subtract(segs, interval{p.Addr(), pool.LastAddr(p)})
	}
	return segs
}

// subtract removes h from the sorted intervals.
func subtract(segs []interval, h interval) []interval {
	var out []interval
	for _, s := range segs {
		if h.hi.Compare(s.lo) < 0 || s.hi.Compare(h.lo) < 0 || s.lo.Is4() != h.lo.Is4() {
			out = append(out, s)
			continue
		}
		if s.lo.Compare(h.lo) < 0 {
			out = append(out, interval{s.lo, h.lo.Prev()})
		}
		if h.hi.Compare(s.hi) < 0 {
			out = append(out, interval{h.hi.Next(), s.hi})
		}
	}
	return out
}

// clip returns the parts of iv inside the sorted intervals segs.
func clip(iv interval, segs []interval) []interval {
	var out []interval
	for _, s := range segs {
		if s.lo.Is4() != iv.lo.Is4() || s.hi.Compare(iv.lo) < 0 || iv.hi.Compare(s.lo) < 0 {
			continue
		}
		lo, hi := iv.lo, iv.hi
		if s.lo.Compare(lo) > 0 {
			lo = s.lo
		}
		if s.hi.Compare(hi) < 0 {
			hi = s.hi
		}
		out = append(out, interval{lo, hi})
	}
	return out
}

// Prefixes splits the inclusive range [lo, hi] into the fewest CIDR
// prefixes, in address order. It returns nil when lo and hi are of
// different families, invalid, or lo > hi. (go4.org/netipx's
// IPRange.Prefixes does this; ringipam does not otherwise depend on it.)
func Prefixes(lo, hi netip.Addr) []netip.Prefix {
	lo, hi = lo.Unmap(), hi.Unmap()
	if !lo.IsValid() || !hi.IsValid() || lo.Is4() != hi.Is4() || lo.Compare(hi) > 0 {
		return nil
	}
	var out []netip.Prefix
	for {
		// The widest prefix that starts at lo and ends at or before hi.
		bits := lo.BitLen()
		for bits > 0 {
			wider := netip.PrefixFrom(lo, bits-1)
			if wider.Masked().Addr() != lo || pool.LastAddr(wider).Compare(hi) > 0 {
				break
			}
			bits--
		}
		p := netip.PrefixFrom(lo, bits)
		out = append(out, p)
		end := pool.LastAddr(p)
		if end.Compare(hi) >= 0 {
			return out
		}
		lo = end.Next()
	}
}

// Digest is a short fingerprint of routes as the kernel sees them (each
// destination and next hop, in order; the hosts and pools named are
// labels and do not count): two plans with one digest install the same
// routes. Never "" (no routes have a digest too). An agent publishes the digest of what it
// installed (pool.RoutesSummary) and ringctl compares it with the digest
// of the plan it makes from the ring.
func Digest(rs []Route) string {
	h := sha256.New()
	for _, r := range rs {
		fmt.Fprintf(h, "%s %s\n", r.Dst, r.Via)
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}
