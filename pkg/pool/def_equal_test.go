package pool

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"
)

// Def.Equal compares field by field; it must say what comparing the two
// normalized definitions' JSON (the form the store records) says, for
// definitions that differ in every field and in ways Normalize erases.
func TestDefEqualAgreesWithRecordedForm(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 12))
	pick := func(xs ...string) string { return xs[rng.IntN(len(xs))] }
	randomDef := func() Def {
		d := Def{Name: pick("a", "b"), Isolated: rng.IntN(4) == 0}
		for i := range 1 + rng.IntN(2) {
			base := fmt.Sprintf("198.18.%d.", 16*i)
			r := Range{Subnet: netip.MustParsePrefix(base + pick("0/20", "7/20", "0/21"))}
			if rng.IntN(2) == 0 {
				r.Start = netip.MustParseAddr(base + pick("1", "10"))
			}
			if rng.IntN(2) == 0 {
				r.End = netip.MustParseAddr(base + pick("200", "254"))
			}
			if rng.IntN(2) == 0 {
				r.Gateway = netip.MustParseAddr(base + pick("1", "2"))
			}
			d.Ranges = append(d.Ranges, r)
		}
		if n := rng.IntN(3); n > 0 {
			d.Exclude = append(d.Exclude, netip.MustParsePrefix("198.18.0."+pick("5/32", "8/30", "9/30")))
			if n > 1 {
				d.Exclude = append(d.Exclude, netip.MustParsePrefix("198.18.0.5/32"))
			}
		}
		return d
	}
	recordedForm := func(d Def) (string, bool) {
		n, err := d.Normalize()
		if err != nil {
			return "", false
		}
		b, err := json.Marshal(n)
		if err != nil {
			t.Fatal(err)
		}
		return string(b), true
	}
	var equal, differ int
	// variant returns d given another way: the same definition in a form
	// Normalize erases, or one field changed.
	variant := func(d Def) Def {
		v := Def{Name: d.Name, Isolated: d.Isolated, Ranges: append([]Range(nil), d.Ranges...), Exclude: append([]netip.Prefix(nil), d.Exclude...)}
		switch rng.IntN(8) {
		case 0: // ranges in the other order
			for i, j := 0, len(v.Ranges)-1; i < j; i, j = i+1, j-1 {
				v.Ranges[i], v.Ranges[j] = v.Ranges[j], v.Ranges[i]
			}
		case 1: // an exclusion given twice
			v.Exclude = append(v.Exclude, v.Exclude...)
		case 2: // the subnet written with host bits
			v.Ranges[0].Subnet = netip.PrefixFrom(v.Ranges[0].Subnet.Addr().Next().Next().Next(), v.Ranges[0].Subnet.Bits())
		case 3:
			v.Name += "x"
		case 4:
			v.Isolated = !v.Isolated
		case 5:
			v.Ranges[0].Gateway = netip.MustParseAddr("198.18.0.3")
		case 6:
			v.Ranges[0].End = netip.Addr{}
		case 7:
			v.Exclude = append(v.Exclude, netip.MustParsePrefix("198.18.0.77/32"))
		}
		return v
	}
	for i := range 4000 {
		a := randomDef()
		b := variant(a)
		if i%4 == 0 {
			b = randomDef()
		}
		ja, okA := recordedForm(a)
		jb, okB := recordedForm(b)
		want := okA && okB && ja == jb
		if got := a.Equal(b); got != want {
			t.Fatalf("Equal(%+v, %+v) = %v; their recorded forms %s and %s say %v", a, b, got, ja, jb, want)
		}
		if want {
			equal++
		} else {
			differ++
		}
	}
	if equal < 50 || differ < 50 {
		t.Fatalf("the generator covers too little: %d equal pairs, %d different", equal, differ)
	}
}
