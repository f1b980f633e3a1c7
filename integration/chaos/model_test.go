//go:build integration

package chaos

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ringipam/ringipam/pkg/cni/portmap"
	"github.com/ringipam/ringipam/pkg/portalloc"
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
		{"an endpoint asked for again after its release", []call{add("d1", 0, 1, outOK, a), rel("d1", 2, 3, outAmbiguous, a), add("d1", 4, 5, outOK, b)}, holdings{"d1": b}, "yes", 0},
		{"a new address while the old one is held", []call{add("d1", 0, 1, outOK, a), rel("d1", 2, 3, outFailed, a), add("d1", 4, 5, outOK, b)}, holdings{"d1": b}, "no", 0},
		{"failures of owners that never held one", []call{add("o3", 0, 1, outFailed, netip.Addr{}), del("o3", 2, 3, outOK), add("o1", 4, 5, outOK, a)}, holdings{"o1": a}, "yes", 0},
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
	if len(d) != 1 || d[0].what != a.String() || d[0].owners != [2]string{"cni/x", "cni/z"} {
		t.Errorf("duplicates %v, want %s held by cni/x and cni/z", d, a)
	}
}

// The port checks on hand-made runs: each finding must be counted. (Named
// TestChaos… so that the suite's short command runs it too.)
func TestChaosPortJudge(t *testing.T) {
	p, q := portalloc.Address{Protocol: "tcp", Number: 30000}, portalloc.Address{Protocol: "tcp", Number: 30001}
	ip := mustAddr("198.19.0.2")
	add := func(o string, at, ret int64, outcome string, port portalloc.Address) call {
		return call{Client: int(at), Host: "h0", Verb: verbAdd, Owner: o, Call: at, Return: ret, Outcome: outcome, Port: port, Addr: ip}
	}
	del := func(o string, at, ret int64, outcome string) call {
		return call{Client: int(at), Host: "h0", Verb: verbDel, Owner: o, Call: at, Return: ret, Outcome: outcome}
	}
	full := func(o string, at, ret int64) call {
		c := add(o, at, ret, outFailed, portalloc.Address{})
		c.Code = 102
		return c
	}
	rule := func(port portalloc.Address, to netip.Addr) portmap.Rule {
		return portmap.Rule{Protocol: port.Protocol, HostPort: port.Number, ContainerIP: to, ContainerPort: containerPort}
	}
	// holds is a reading where each owner's record lists its port, on h0,
	// and each port's key names its owner.
	holds := func(kv ...any) portReading {
		r := portReading{owners: map[string][]portalloc.Address{}, hosts: map[string]string{}, keys: map[portalloc.Address][]string{}}
		for i := 0; i < len(kv); i += 2 {
			o, a := kv[i].(string), kv[i+1].(portalloc.Address)
			r.owners[o], r.hosts[o] = append(r.owners[o], a), "h0"
			r.keys[a] = append(r.keys[a], o)
		}
		return r
	}
	live1 := map[string]livePort{"cni/o1": {port: p, host: "h0", addr: ip}}
	fwd1 := map[string]map[string][]portmap.Rule{"h0": {"cni/o1": {rule(p, ip)}}}
	type want struct{ published, duplicates, leaks, lost, unclear, falseExhausts int }
	for _, tc := range []struct {
		name string
		run  portRun
		want want
	}{
		{"clean", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p), add("cni/o1", 2, 3, outOK, p)},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 1}},
		{"reuse after DEL", portRun{calls: []call{add("cni/o2", 0, 1, outOK, p), del("cni/o2", 2, 3, outOK), add("cni/o1", 4, 5, outOK, p)},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 2}},
		{"two owners in the history", portRun{calls: []call{add("cni/o2", 0, 1, outOK, p), add("cni/o1", 2, 3, outOK, p), del("cni/o2", 4, 5, outOK)},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 2, duplicates: 1}},
		{"two records of one port", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p)},
			final: holds("cni/o1", p, "cni/o2", p), after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 1, duplicates: 1}},
		{"a record whose key names another", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p)},
			final: portReading{owners: map[string][]portalloc.Address{"cni/o1": {p}}, keys: map[portalloc.Address][]string{p: {"cni/o2"}}},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 1, duplicates: 1}},
		{"a record left after GC", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p), add("cni/o2", 0, 1, outAmbiguous, portalloc.Address{})},
			after: holds("cni/o1", p, "cni/o2", q), forwards: fwd1, live: live1, size: 2}, want{published: 1, leaks: 1}},
		{"a key left after GC", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p)},
			after:    portReading{owners: map[string][]portalloc.Address{"cni/o1": {p}}, hosts: map[string]string{"cni/o1": "h0"}, keys: map[portalloc.Address][]string{p: {"cni/o1"}, q: {"cni/o2"}}},
			forwards: fwd1, live: live1, size: 2}, want{published: 1, leaks: 1}},
		{"a forward left after GC", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p)},
			after: holds("cni/o1", p), forwards: map[string]map[string][]portmap.Rule{"h0": {"cni/o1": {rule(p, ip)}}, "h1": {"mark port/x/y/eth0": {rule(q, ip)}}},
			live: live1, size: 2}, want{published: 1, leaks: 1}},
		{"a live port gone", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p)},
			after: holds(), forwards: fwd1, live: live1, size: 2}, want{published: 1, lost: 1}},
		{"a replay that moved the port", portRun{calls: []call{add("cni/o1", 0, 1, outOK, q), add("cni/o1", 2, 3, outOK, p)},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 1, lost: 1}},
		// portmap-ingress's failed ADD releases what the attachment held
		// (its forwards could not be installed): the port is free for
		// another owner, and the next ADD may return another one.
		{"a failed repeated ADD released the port", portRun{calls: []call{add("cni/o2", 0, 1, outOK, p), add("cni/o2", 2, 3, outAmbiguous, portalloc.Address{}),
			add("cni/o1", 4, 5, outOK, p), add("cni/o2", 6, 7, outOK, q)},
			after:    holds("cni/o1", p, "cni/o2", q),
			forwards: map[string]map[string][]portmap.Rule{"h0": {"cni/o1": {rule(p, ip)}, "cni/o2": {rule(q, ip)}}},
			live:     map[string]livePort{"cni/o1": {port: p, host: "h0", addr: ip}, "cni/o2": {port: q, host: "h0", addr: ip}}, size: 2},
			want{published: 2}},
		{"two owners, the first one's failed ADD after", portRun{calls: []call{add("cni/o2", 0, 1, outOK, p), add("cni/o1", 2, 3, outOK, p),
			add("cni/o2", 4, 5, outAmbiguous, portalloc.Address{})},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 2, duplicates: 1}},
		{"a live port without its forward", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p)},
			after: holds("cni/o1", p), forwards: map[string]map[string][]portmap.Rule{"h0": {"cni/o1": {rule(p, mustAddr("198.19.0.3"))}}},
			live: live1, size: 2}, want{published: 1, lost: 1}},
		{"an unclear failure", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p), {Verb: verbAdd, Owner: "cni/o2", Outcome: outFailed, Code: 999, Unclear: "CNI code 999"}},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 1, unclear: 1}},
		{"range full", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p), add("cni/o2", 0, 1, outOK, q), del("cni/o2", 4, 5, outOK), full("cni/o3", 2, 3)},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 2}},
		{"range full with room left", portRun{calls: []call{add("cni/o1", 0, 1, outOK, p), full("cni/o3", 2, 3)},
			after: holds("cni/o1", p), forwards: fwd1, live: live1, size: 2}, want{published: 1, falseExhausts: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := judgePorts(tc.run)
			got := want{v.published, v.duplicates, v.leaks, v.lost, v.unclear, v.falseExhausts}
			if got != tc.want {
				t.Errorf("got %+v, want %+v; notes:\n%s", got, tc.want, strings.Join(v.notes, "\n"))
			}
		})
	}
}
