package pool

import (
	"fmt"
	"net/netip"
	"testing"
)

// FuzzRingAgainstModel drives ring.assign and ring.tombstone with arbitrary
// operations on a small pool and compares every address's owner with a
// plain array model after each step; the ring's structure (check) must hold
// throughout. Each operation is 3 bytes: kind, low, high.
func FuzzRingAgainstModel(f *testing.F) {
	f.Add([]byte{0, 0, 61, 0, 30, 40, 1, 1, 0})
	f.Add([]byte{0, 10, 10, 0, 11, 11, 0, 5, 20, 1, 2, 0, 0, 0, 61})
	f.Add([]byte{0, 61, 0, 1, 0, 0, 0, 7, 7})
	def, _ := Def{Name: "f", Ranges: []Range{{Subnet: netip.MustParsePrefix("198.18.0.0/26")}}}.Normalize() // .1-.62
	f.Fuzz(func(t *testing.T, ops []byte) {
		r := newRing(def)
		n := int(r.space.size().lo)
		type cell struct {
			host string
			tomb bool
		}
		model := make([]cell, n)
		hosts := []string{"a", "b", "c", "d"}
		for i := 0; i+2 < len(ops) && i < 3*64; i += 3 {
			kind, lo, hi := ops[i], int(ops[i+1])%n, int(ops[i+2])%n
			if lo > hi {
				lo, hi = hi, lo
			}
			host := hosts[int(kind>>1)%len(hosts)]
			what := ""
			if kind&1 == 0 {
				what = fmt.Sprintf("assign %d-%d to %s", lo, hi, host)
				r = r.assign(r.space.lo.add(u128{lo: uint64(lo)}), r.space.lo.add(u128{lo: uint64(hi)}), host)
				for j := lo; j <= hi; j++ {
					model[j] = cell{host: host}
				}
			} else {
				what = "tombstone " + host
				r = r.tombstone(host)
				for j := range model {
					if model[j].host == host {
						model[j].tomb = true
					}
				}
			}
			if err := r.check(); err != nil {
				t.Fatalf("after %s: %v (%+v)", what, err, r.tokens)
			}
			for j := range model {
				tok := r.ownerOf(r.space.lo.add(u128{lo: uint64(j)}))
				if tok.Host != model[j].host || tok.Tomb != model[j].tomb {
					t.Fatalf("after %s: address %d is %q tomb=%v, model says %q tomb=%v (%+v)", what, j, tok.Host, tok.Tomb, model[j].host, model[j].tomb, r.tokens)
				}
			}
			for k := 1; k < len(r.tokens); k++ {
				if r.tokens[k].Host == r.tokens[k-1].Host && r.tokens[k].Tomb == r.tokens[k-1].Tomb {
					t.Fatalf("after %s: tokens %d and %d not merged (%+v)", what, k-1, k, r.tokens)
				}
			}
		}
	})
}
