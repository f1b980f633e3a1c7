package pool

import (
	"encoding/binary"
	"math/big"
	"math/bits"
	"net/netip"
)

// u128 is an address as an unsigned 128-bit number (IPv4 in the low 32 bits).
type u128 struct{ hi, lo uint64 }

func toU128(a netip.Addr) u128 {
	if a.Is4() {
		b := a.As4()
		return u128{lo: uint64(binary.BigEndian.Uint32(b[:]))}
	}
	b := a.As16()
	return u128{hi: binary.BigEndian.Uint64(b[:8]), lo: binary.BigEndian.Uint64(b[8:])}
}

func (v u128) addr(is4 bool) netip.Addr {
	if is4 {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], uint32(v.lo))
		return netip.AddrFrom4(b)
	}
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], v.hi)
	binary.BigEndian.PutUint64(b[8:], v.lo)
	return netip.AddrFrom16(b)
}

func (v u128) cmp(w u128) int {
	switch {
	case v.hi < w.hi:
		return -1
	case v.hi > w.hi:
		return 1
	case v.lo < w.lo:
		return -1
	case v.lo > w.lo:
		return 1
	}
	return 0
}

func (v u128) add(w u128) u128 {
	lo, c := bits.Add64(v.lo, w.lo, 0)
	hi, _ := bits.Add64(v.hi, w.hi, c)
	return u128{hi, lo}
}

func (v u128) sub(w u128) u128 {
	lo, b := bits.Sub64(v.lo, w.lo, 0)
	hi, _ := bits.Sub64(v.hi, w.hi, b)
	return u128{hi, lo}
}

func (v u128) inc() u128 { return v.add(u128{lo: 1}) }
func (v u128) dec() u128 { return v.sub(u128{lo: 1}) }

func (v u128) half() u128 { return u128{hi: v.hi >> 1, lo: v.lo>>1 | v.hi<<63} }

func (v u128) big() *big.Int {
	n := new(big.Int).SetUint64(v.hi)
	n.Lsh(n, 64)
	return n.Or(n, new(big.Int).SetUint64(v.lo))
}

func (v u128) String() string { return v.big().String() }

// span is an inclusive interval of addresses [lo, hi].
type span struct{ lo, hi u128 }

// size is the number of addresses in s (saturating at 2^128-1).
func (s span) size() u128 {
	d := s.hi.sub(s.lo)
	if d.hi == ^uint64(0) && d.lo == ^uint64(0) {
		return d
	}
	return d.inc()
}

func (s span) contains(v u128) bool { return s.lo.cmp(v) <= 0 && v.cmp(s.hi) <= 0 }

func minU(a, b u128) u128 {
	if a.cmp(b) <= 0 {
		return a
	}
	return b
}

func maxU(a, b u128) u128 {
	if a.cmp(b) >= 0 {
		return a
	}
	return b
}
