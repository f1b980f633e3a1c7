package routes

import (
	"net/netip"
	"testing"
)

// TestDigest: the digest depends on the destinations and next hops, in
// order, and on nothing else; no routes have one too.
func TestDigest(t *testing.T) {
	r := func(dst, via, host string) Route {
		return Route{Dst: netip.MustParsePrefix(dst), Via: netip.MustParseAddr(via), Host: host, Pool: "p"}
	}
	a := []Route{r("198.18.0.0/25", "198.18.9.2", "b"), r("198.18.0.128/25", "198.18.9.3", "c")}
	relabelled := []Route{r("198.18.0.0/25", "198.18.9.2", "x"), r("198.18.0.128/25", "198.18.9.3", "y")}
	relabelled[0].Pool = "q"
	if Digest(a) != Digest(relabelled) {
		t.Error("host and pool labels change the digest")
	}
	for name, other := range map[string][]Route{
		"one route fewer":   a[:1],
		"another next hop":  {a[0], r("198.18.0.128/25", "198.18.9.4", "c")},
		"another prefix":    {a[0], r("198.18.0.128/26", "198.18.9.3", "c")},
		"no routes":         nil,
		"the order swapped": {a[1], a[0]},
	} {
		if Digest(other) == Digest(a) {
			t.Errorf("%s: same digest", name)
		}
	}
	if d := Digest(nil); len(d) != 16 {
		t.Errorf("digest of no routes %q", d)
	}
}
