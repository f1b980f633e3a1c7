package pool

import (
	"fmt"
	"net/netip"
	"slices"
)

// token marks the start of a range on the ring. The range runs to the
// address before the next token (the last one runs to the end of the pool's
// space). Host "" means unowned; Tomb marks the ranges of a host that left.
type token struct {
	Start netip.Addr `json:"s"`
	Host  string     `json:"h,omitempty"`
	Tomb  bool       `json:"t,omitempty"`
}

// ring is the ordered token list of one pool. Its zero value is not valid:
// build one with newRing. Methods never mutate the receiver's backing array
// in place; they return a new ring, so a ring read from the store can be
// compared with the changed one.
type ring struct {
	is4    bool
	space  span // first and last allocatable address of the pool
	tokens []token
}

func newRing(d Def) ring {
	segs := segmentsOf(d)
	sp := span{segs[0].lo, segs[len(segs)-1].hi}
	return ring{is4: d.is4(), space: sp, tokens: []token{{Start: sp.lo.addr(d.is4())}}}
}

// withTokens returns a ring for d carrying stored tokens.
func ringFrom(d Def, tokens []token) ring {
	r := newRing(d)
	if len(tokens) > 0 {
		r.tokens = tokens
	}
	return r
}

func (r ring) start(i int) u128 { return toU128(r.tokens[i].Start) }

// spanOf is the span of token i.
func (r ring) spanOf(i int) span {
	if i+1 < len(r.tokens) {
		return span{r.start(i), r.start(i + 1).dec()}
	}
	return span{r.start(i), r.space.hi}
}

// indexAt returns the index of the token whose range holds v.
func (r ring) indexAt(v u128) int {
	i, found := slices.BinarySearchFunc(r.tokens, v, func(t token, v u128) int { return toU128(t.Start).cmp(v) })
	if found {
		return i
	}
	return i - 1
}

// ownerOf returns the token whose range holds v.
func (r ring) ownerOf(v u128) token { return r.tokens[r.indexAt(v)] }

// ownedBy returns host's live spans clipped to the allocatable segments.
func (r ring) ownedBy(host string, segs []span) []span { return r.spansOf(host, segs, false) }

// spansOf returns host's spans clipped to the segments, its tombstoned
// ones too when withTombs (never in the product: faults.ignoreTombs).
func (r ring) spansOf(host string, segs []span, withTombs bool) []span {
	var out []span
	for i, t := range r.tokens {
		if t.Host != host || t.Tomb && !withTombs {
			continue
		}
		out = append(out, clip(r.spanOf(i), segs)...)
	}
	return out
}

// clip intersects s with the sorted segments.
func clip(s span, segs []span) []span {
	var out []span
	for _, g := range segs {
		lo, hi := maxU(s.lo, g.lo), minU(s.hi, g.hi)
		if lo.cmp(hi) <= 0 {
			out = append(out, span{lo, hi})
		}
	}
	return out
}

// assign returns a ring in which [lo, hi] belongs to host; the addresses
// after hi keep the owner they had.
func (r ring) assign(lo, hi u128, host string) ring {
	after := token{}
	hasAfter := hi.cmp(r.space.hi) < 0
	if hasAfter {
		after = r.ownerOf(hi.inc())
		after.Start = hi.inc().addr(r.is4)
	}
	var out []token
	for _, t := range r.tokens {
		v := toU128(t.Start)
		if v.cmp(lo) < 0 {
			out = append(out, t)
		}
	}
	out = append(out, token{Start: lo.addr(r.is4), Host: host})
	if hasAfter {
		out = append(out, after)
	}
	for _, t := range r.tokens {
		v := toU128(t.Start)
		if hasAfter && v.cmp(hi.inc()) > 0 {
			out = append(out, t)
		}
	}
	n := r
	n.tokens = merge(out)
	return n
}

// tombstone returns a ring in which every range of host is tombstoned.
func (r ring) tombstone(host string) ring {
	out := slices.Clone(r.tokens)
	for i := range out {
		if out[i].Host == host {
			out[i].Tomb = true
		}
	}
	n := r
	n.tokens = merge(out)
	return n
}

// merge drops tokens that start a range with the same owner as the one
// before them.
func merge(ts []token) []token {
	out := ts[:0:0]
	for _, t := range ts {
		if n := len(out); n > 0 && out[n-1].Host == t.Host && out[n-1].Tomb == t.Tomb {
			continue
		}
		out = append(out, t)
	}
	return out
}

// check verifies the ring's structure: tokens strictly increasing, the first
// at the start of the space, all inside it. Together these mean the ranges
// cover the pool exactly once.
func (r ring) check() error {
	if len(r.tokens) == 0 {
		return fmt.Errorf("ring has no tokens")
	}
	if r.start(0) != r.space.lo {
		return fmt.Errorf("first token %s is not at the start of the pool %s", r.tokens[0].Start, r.space.lo.addr(r.is4))
	}
	for i := range r.tokens {
		if !r.space.contains(r.start(i)) {
			return fmt.Errorf("token %s is outside the pool", r.tokens[i].Start)
		}
		if i > 0 && r.start(i-1).cmp(r.start(i)) >= 0 {
			return fmt.Errorf("tokens %s and %s are out of order", r.tokens[i-1].Start, r.tokens[i].Start)
		}
	}
	return nil
}

// OwnedRange is one range of the ring as shown to operators and tests.
type OwnedRange struct {
	Start, End netip.Addr
	Host       string // "" when unowned
	Tombstone  bool
}

// Ring is the ring of one pool as stored.
type Ring struct {
	Pool   string
	Ranges []OwnedRange
}

func (r ring) view(pool string) Ring {
	v := Ring{Pool: pool}
	for i, t := range r.tokens {
		s := r.spanOf(i)
		v.Ranges = append(v.Ranges, OwnedRange{Start: s.lo.addr(r.is4), End: s.hi.addr(r.is4), Host: t.Host, Tombstone: t.Tomb})
	}
	return v
}

// Owner returns the range holding addr.
func (v Ring) Owner(addr netip.Addr) (OwnedRange, bool) {
	for _, r := range v.Ranges {
		if r.Start.Compare(addr) <= 0 && addr.Compare(r.End) <= 0 {
			return r, true
		}
	}
	return OwnedRange{}, false
}
