package pool

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/ringipam/ringipam/pkg/names"
)

// validName accepts 1-200 characters of letters, digits, '.', '_', ':' or
// '-', the first a letter or digit. (A loop, not a regular expression: a
// compiled {0,199} costs every plugin process milliseconds at start.)
func validName(what, name string) error {
	if names.Pool(name) != nil {
		return fmt.Errorf("%w: %s %q must be 1-200 characters of letters, digits, '.', '_', ':' or '-'", ErrInvalid, what, name)
	}
	return nil
}

// Normalize returns d in canonical form (masked subnets, defaulted range
// bounds, sorted exclusions) or an error wrapping ErrInvalid that says what
// is wrong. Two hosts given the same pool produce byte-identical canonical
// forms.
func (d Def) Normalize() (Def, error) {
	if err := validName("pool name", d.Name); err != nil {
		return Def{}, err
	}
	if len(d.Ranges) == 0 {
		return Def{}, fmt.Errorf("%w: pool %s has no ranges", ErrInvalid, d.Name)
	}
	out := Def{Name: d.Name, Isolated: d.Isolated}
	is4 := d.Ranges[0].Subnet.Addr().Is4()
	for i, r := range d.Ranges {
		if !r.Subnet.IsValid() {
			return Def{}, fmt.Errorf("%w: pool %s range %d: missing or invalid subnet", ErrInvalid, d.Name, i)
		}
		r.Subnet = r.Subnet.Masked()
		if r.Subnet.Addr().Is4() != is4 || r.Subnet.Addr().Is4In6() {
			return Def{}, fmt.Errorf("%w: pool %s mixes IPv4 and IPv6 ranges; use one pool per family", ErrInvalid, d.Name)
		}
		first, last := subnetBounds(r.Subnet)
		if first.cmp(last) > 0 {
			return Def{}, fmt.Errorf("%w: pool %s: subnet %s has no usable address", ErrInvalid, d.Name, r.Subnet)
		}
		if !r.Start.IsValid() {
			r.Start = first.addr(is4)
		}
		if !r.End.IsValid() {
			r.End = last.addr(is4)
		}
		for _, a := range []struct {
			name string
			v    netip.Addr
		}{{"rangeStart", r.Start}, {"rangeEnd", r.End}} {
			if !r.Subnet.Contains(a.v) {
				return Def{}, fmt.Errorf("%w: pool %s: %s %s is outside subnet %s", ErrInvalid, d.Name, a.name, a.v, r.Subnet)
			}
		}
		if r.Start.Compare(r.End) > 0 {
			return Def{}, fmt.Errorf("%w: pool %s: rangeStart %s is after rangeEnd %s", ErrInvalid, d.Name, r.Start, r.End)
		}
		if r.Gateway.IsValid() && !r.Subnet.Contains(r.Gateway) {
			return Def{}, fmt.Errorf("%w: pool %s: gateway %s is outside subnet %s", ErrInvalid, d.Name, r.Gateway, r.Subnet)
		}
		out.Ranges = append(out.Ranges, r)
	}
	slices.SortFunc(out.Ranges, func(a, b Range) int { return a.Start.Compare(b.Start) })
	for i := 1; i < len(out.Ranges); i++ {
		if out.Ranges[i-1].End.Compare(out.Ranges[i].Start) >= 0 {
			return Def{}, fmt.Errorf("%w: pool %s: ranges %s-%s and %s-%s overlap", ErrInvalid, d.Name,
				out.Ranges[i-1].Start, out.Ranges[i-1].End, out.Ranges[i].Start, out.Ranges[i].End)
		}
	}
	for _, p := range d.Exclude {
		if !p.IsValid() || p.Addr().Is4() != is4 {
			return Def{}, fmt.Errorf("%w: pool %s: exclusion %v is invalid or of the other family", ErrInvalid, d.Name, p)
		}
		out.Exclude = append(out.Exclude, p.Masked())
	}
	slices.SortFunc(out.Exclude, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	out.Exclude = slices.Compact(out.Exclude)
	if segmentsOf(out) == nil {
		return Def{}, fmt.Errorf("%w: pool %s has no allocatable address once gateways and exclusions are removed", ErrInvalid, d.Name)
	}
	return out, nil
}

// subnetBounds returns the first and last address a subnet may hand out: the
// network address is skipped, and for IPv4 subnets larger than /31 the
// broadcast address too.
func subnetBounds(p netip.Prefix) (u128, u128) {
	lo := toU128(p.Addr())
	hostBits := p.Addr().BitLen() - p.Bits()
	var size u128
	if hostBits >= 64 {
		size = u128{hi: 1<<(hostBits-64) - 1, lo: ^uint64(0)}
		if hostBits == 128 {
			size = u128{hi: ^uint64(0), lo: ^uint64(0)}
		}
	} else {
		size = u128{lo: 1<<hostBits - 1}
	}
	hi := lo.add(size)
	if hostBits == 0 {
		return lo, hi
	}
	if p.Addr().Is4() && hostBits == 1 {
		return lo, hi
	}
	first := lo.inc()
	if p.Addr().Is4() {
		return first, hi.dec()
	}
	return first, hi
}

// segmentsOf returns d's allocatable addresses as sorted disjoint spans:
// every range's [Start, End] minus its gateway and minus the exclusions.
func segmentsOf(d Def) []span {
	var segs []span
	for _, r := range d.Ranges {
		segs = append(segs, span{toU128(r.Start), toU128(r.End)})
	}
	var holes []span
	for _, r := range d.Ranges {
		if r.Gateway.IsValid() {
			g := toU128(r.Gateway)
			holes = append(holes, span{g, g})
		}
	}
	for _, p := range d.Exclude {
		lo := toU128(p.Addr())
		hostBits := p.Addr().BitLen() - p.Bits()
		var size u128
		switch {
		case hostBits >= 128:
			size = u128{^uint64(0), ^uint64(0)}
		case hostBits >= 64:
			size = u128{hi: 1<<(hostBits-64) - 1, lo: ^uint64(0)}
		default:
			size = u128{lo: 1<<hostBits - 1}
		}
		holes = append(holes, span{lo, lo.add(size)})
	}
	for _, h := range holes {
		segs = subtract(segs, h)
	}
	return segs
}

// dynamicSegmentsOf returns the addresses of d that dynamic allocation may
// hand out: segmentsOf(d) minus the Static ranges.
func dynamicSegmentsOf(d Def) []span {
	segs := segmentsOf(d)
	for _, r := range d.Ranges {
		if r.Static {
			segs = subtract(segs, span{toU128(r.Start), toU128(r.End)})
		}
	}
	return segs
}

// subtract removes h from the sorted spans.
func subtract(segs []span, h span) []span {
	var out []span
	for _, s := range segs {
		if h.hi.cmp(s.lo) < 0 || h.lo.cmp(s.hi) > 0 {
			out = append(out, s)
			continue
		}
		if h.lo.cmp(s.lo) > 0 {
			out = append(out, span{s.lo, h.lo.dec()})
		}
		if h.hi.cmp(s.hi) < 0 {
			out = append(out, span{h.hi.inc(), s.hi})
		}
	}
	return out
}

// capacityOf is the number of allocatable addresses in spans.
func capacityOf(spans []span) u128 {
	var n u128
	for _, s := range spans {
		n = n.add(s.size())
	}
	return n
}

// Contains reports whether addr is one the pool may hand out (inside a range,
// not a gateway, not excluded). d must be normalized.
func (d Def) Contains(addr netip.Addr) bool {
	if !addr.IsValid() || addr.Is4() != d.is4() {
		return false
	}
	v := toU128(addr)
	for _, s := range segmentsOf(d) {
		if s.contains(v) {
			return true
		}
	}
	return false
}

// RangeFor returns the range whose subnet holds addr.
func (d Def) RangeFor(addr netip.Addr) (Range, bool) {
	for _, r := range d.Ranges {
		if r.Subnet.Contains(addr) {
			return r, true
		}
	}
	return Range{}, false
}

// Capacity is the number of addresses the pool may hand out, in decimal.
func (d Def) Capacity() string { return capacityOf(segmentsOf(d)).String() }

func (d Def) is4() bool { return len(d.Ranges) > 0 && d.Ranges[0].Subnet.Addr().Is4() }
