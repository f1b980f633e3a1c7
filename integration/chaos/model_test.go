//go:build integration

package chaos

import (
	"net/netip"
	"testing"
	"time"
)

// The checks of a run on hand-made histories: each must be able to say no.
func TestPoolModelVerdicts(t *testing.T) {
	a, b := mustAddr("198.19.0.2"), mustAddr("198.19.0.3")
	pool := []netip.Addr{a, b}
	add := func(o string, at, ret int64, outcome string, addr netip.Addr) call {
		return call{Client: int(at), Verb: verbAdd, Owner: o, Call: at, Return: ret, Outcome: outcome, Addr: addr}
	}
	del := func(o string, at, ret int64, outcome string) call {
		return call{Client: int(at), Verb: verbDel, Owner: o, Call: at, Return: ret, Outcome: outcome}
	}
	rel := func(o string, at, ret int64, outcome string, addr netip.Addr) call {
		return call{Client: int(at), Verb: verbRelease, Owner: o, Call: at, Return: ret, Outcome: outcome, Addr: addr}
	}
	full := func(o string, at, ret int64) call {
		c := add(o, at, ret, outFailed, netip.Addr{})
		c.Code = 102
		return c
	}
	none := holdings{}
	for _, tc := range []struct {
		name  string
		calls []call
		final holdings
		want  string
		dups  int
	}{
		{"reuse after DEL", []call{add("o1", 0, 1, outOK, a), del("o1", 2, 3, outOK), add("o2", 4, 5, outOK, a)}, holdings{"o2": a}, "yes", 0},
		{"reuse while the DEL runs", []call{add("o1", 0, 1, outOK, a), del("o1", 2, 6, outOK), add("o2", 3, 4, outOK, a)}, holdings{"o2": a}, "yes", 0},
		{"two owners of one address", []call{add("o1", 0, 1, outOK, a), add("o2", 2, 3, outOK, a), del("o1", 4, 5, outOK)}, holdings{"o2": a}, "no", 1},
		{"idempotent ADD", []call{add("o1", 0, 1, outOK, a), add("o1", 2, 3, outOK, a)}, holdings{"o1": a}, "yes", 0},
		{"ADD not idempotent", []call{add("o1", 0, 1, outOK, a), add("o1", 2, 3, outOK, b)}, holdings{"o1": b}, "no", 0},
		{"failed ADD of an owner that holds one", []call{add("o1", 0, 1, outOK, a), add("o1", 2, 3, outFailed, netip.Addr{})}, holdings{"o1": a}, "no", 0},
		{"lost without a DEL", []call{add("o1", 0, 1, outOK, a)}, none, "no", 0},
		{"a definite failed DEL that freed", []call{add("o1", 0, 1, outOK, a), del("o1", 2, 3, outFailed)}, none, "no", 0},
		{"an ambiguous DEL either way", []call{add("o1", 0, 1, outOK, a), del("o1", 2, 3, outAmbiguous)}, none, "yes", 0},
		{"an ambiguous DEL that did nothing", []call{add("o1", 0, 1, outOK, a), del("o1", 2, 3, outAmbiguous)}, holdings{"o1": a}, "yes", 0},
		{"a killed ADD that took effect late", []call{add("o1", 0, 1, outAmbiguous, netip.Addr{}), add("o2", 2, 3, outOK, a), del("o2", 4, 5, outOK)}, holdings{"o1": a}, "yes", 0},
		{"a killed ADD cleaned up", []call{add("o1", 0, 1, outAmbiguous, netip.Addr{}), del("o1", 2, 3, outOK), add("o2", 4, 5, outOK, a)}, holdings{"o2": a}, "yes", 0},
		{"the store shows two owners", []call{add("o1", 0, 1, outAmbiguous, netip.Addr{}), add("o2", 2, 3, outOK, a)}, holdings{"o1": a, "o2": a}, "no", 1},
		{"an address nobody was given", []call{add("o1", 0, 1, outOK, a), del("o1", 2, 3, outOK)}, holdings{"o9": b}, "no", 0},
		{"a stale release frees nobody else", []call{add("d1", 0, 1, outOK, a), rel("d1", 2, 3, outOK, a), add("d2", 4, 5, outOK, a), rel("d1", 6, 7, outOK, a)}, holdings{"d2": a}, "yes", 0},
		{"a stale release freed another endpoint", []call{add("d1", 0, 1, outOK, a), rel("d1", 2, 3, outOK, a), add("d2", 4, 5, outOK, a), rel("d1", 6, 7, outOK, a)}, none, "no", 0},
		{"no capacity when full", []call{add("o1", 0, 1, outOK, a), add("o2", 0, 1, outOK, b), full("o3", 2, 3)}, holdings{"o1": a, "o2": b}, "yes", 0},
		{"no capacity with room left", []call{add("o1", 0, 1, outOK, a), full("o3", 2, 3)}, holdings{"o1": a}, "no", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why, _, _ := linearizable(pool, tc.calls, tc.final, 10*time.Second)
			if got != tc.want {
				t.Errorf("linearizable %s (%v), want %s", got, why, tc.want)
			}
			if d := duplicatesSeen(tc.calls); len(d) != tc.dups && tc.name != "the store shows two owners" {
				t.Errorf("duplicates seen: %v, want %d", d, tc.dups)
			}
			if tc.name == "the store shows two owners" && len(storeDuplicates(reading{owners: tc.final})) != 1 {
				t.Errorf("store duplicates: %v, want one", storeDuplicates(reading{owners: tc.final}))
			}
		})
	}
}

// An address whose key names another owner than the record that lists it
// is a duplicate too; a key that agrees is not.
func TestStoreDuplicatesByKey(t *testing.T) {
	a, b := mustAddr("198.19.0.2"), mustAddr("198.19.0.3")
	r := reading{owners: holdings{"cni/x": a, "cni/y": b}, keys: map[netip.Addr]string{a: "cni/z", b: "cni/y"}}
	d := storeDuplicates(r)
	if len(d) != 1 || d[0].addr != a || d[0].owners != [2]string{"cni/x", "cni/z"} {
		t.Errorf("duplicates %v, want %s held by cni/x and cni/z", d, a)
	}
}
