package portalloc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// memView is a View over a map, for the model check and unit tests.
type memView map[Address]AddrState

func (m memView) State(a Address) (AddrState, error) { return m[a], nil }

func (m memView) NextFree(protocol string, lo, hi, from uint16, free func(uint16, AddrState) bool) (uint16, bool, error) {
	n := from
	for range int(hi-lo) + 1 {
		if free(n, m[Address{protocol, n}]) {
			return n, true, nil
		}
		if n == hi {
			n = lo
		} else {
			n++
		}
	}
	return 0, false, nil
}

// apply returns the view with a plan's changes written.
func (m memView) apply(ch map[Address]AddrState) memView {
	out := memView{}
	for a, s := range m {
		out[a] = s
	}
	for a, s := range ch {
		if s.empty() {
			delete(out, a)
		} else {
			out[a] = s
		}
	}
	return out
}

// The small model of the issue: 2 endpoints, up to 2 ports each, 2
// protocols, 3 dynamic and 2 static numbers, both modes, 2 hosts.
type model struct {
	protocols []string
	static    []uint16
	lo, hi    uint16
	hosts     []string
	ids       []string
	specs     [][]Port
	progress  bool
}

// newModel builds the model's spec space: every port (mode x protocol x
// {dynamic, each number}) and every multiset of two of them.
func newModel(protocols []string, static []uint16, lo, hi uint16) model {
	m := model{protocols: protocols, static: static, lo: lo, hi: hi, hosts: []string{"h1", "h2"}, ids: []string{"e1", "e2"}}
	numbers := append([]uint16{0}, static...)
	for n := lo; n <= hi; n++ {
		numbers = append(numbers, n)
	}
	var ports []Port
	for _, mode := range []Mode{Ingress, Host} {
		for _, proto := range protocols {
			for _, n := range numbers {
				ports = append(ports, Port{Mode: mode, Name: "web", Protocol: proto, Number: n})
			}
		}
	}
	m.specs = append(m.specs, nil)
	for i, a := range ports {
		m.specs = append(m.specs, []Port{a})
		for _, b := range ports[i:] {
			m.specs = append(m.specs, []Port{a, b})
		}
	}
	return m
}

// exhaustiveModel is the model checked exhaustively in make test: 2
// endpoints on 2 hosts, up to 2 ports each (as multisets: the allocator's
// outcome does not depend on entry order), both modes, one protocol, 2
// dynamic and 1 static number. Protocols never interact (an address is a
// protocol and a number), so one protocol covers every rule; the issue's
// full size (2 protocols, 3 dynamic and 2 static numbers) is walked at
// random in TestRandomWalkPorts.
func exhaustiveModel() model { return newModel([]string{"tcp"}, []uint16{80}, 30000, 30002) }

// world is one state of the model: the endpoints and the address table.
type world struct {
	eps   map[string]Endpoint
	addrs memView
}

func (w world) key() string {
	var b strings.Builder
	ids := make([]string, 0, len(w.eps))
	for id := range w.eps {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		e := w.eps[id]
		fmt.Fprintf(&b, "%s@%s%v%v;", id, e.Host, e.Spec, e.Ports)
	}
	return b.String()
}

// allocationsOK is the seed's AllocationsOK with the host-port rules.
func (m model) allocationsOK(w world) error {
	for a, s := range w.addrs {
		if s.Ingress != "" {
			e, ok := w.eps[s.Ingress]
			if !ok || !slices.ContainsFunc(e.Ports, func(p Port) bool { return p.Mode == Ingress && p.addr() == a }) {
				return fmt.Errorf("%s is allocated to %s in ingress mode, which does not use it", a, s.Ingress)
			}
			if len(s.Hosts) > 0 {
				return fmt.Errorf("%s is an ingress port of %s and a host port of %s", a, s.Ingress, s.Hosts[0].Endpoint)
			}
		}
		for i, u := range s.Hosts {
			e, ok := w.eps[u.Endpoint]
			if !ok || e.Host != u.Host || !slices.ContainsFunc(e.Ports, func(p Port) bool { return p.Mode == Host && p.addr() == a }) {
				return fmt.Errorf("%s is allocated to %s on %s in host mode, which does not use it", a, u.Endpoint, u.Host)
			}
			for _, v := range s.Hosts[:i] {
				if v.Host == u.Host && overlaps(v.IP, u.IP) {
					return fmt.Errorf("%s: host ports of %s and %s collide on %s", a, v.Endpoint, u.Endpoint, u.Host)
				}
			}
		}
	}
	for id, e := range w.eps {
		if len(e.Spec) != len(e.Ports) {
			return fmt.Errorf("%s has %d ports for %d entries", id, len(e.Ports), len(e.Spec))
		}
		for i, s := range e.Spec {
			p := e.Ports[i]
			if s.Number == 0 && (!mostlyEqual(s, p) || p.Number < m.lo || p.Number > m.hi) || s.Number != 0 && s != p || p.Number == 0 {
				return fmt.Errorf("%s port %d is %+v for spec %+v", id, i, p, s)
			}
			if !lists(w.addrs[p.addr()], id, p, e.Host) {
				return fmt.Errorf("%s port %+v is not in the address table", id, p)
			}
		}
	}
	return nil
}

// rejectJustified: a rejection is explained by the spec itself, a static
// address in use by others, or too few dynamic numbers for a protocol.
func (m model) rejectJustified(w world, id, host string, spec []Port, err error) error {
	if ValidateSpec(spec) != nil || duplicates(spec) != nil {
		return nil
	}
	others := memView{}
	for a, s := range w.addrs {
		if t := s.without(id); !t.empty() {
			others[a] = t
		}
	}
	for _, p := range spec {
		if p.Number == 0 {
			continue
		}
		s := others[p.addr()]
		if s.Ingress != "" || p.Mode == Ingress && len(s.Hosts) > 0 {
			return nil
		}
		if _, clash := s.hostClash(host, p.HostIP); clash && p.Mode == Host {
			return nil
		}
	}
	for _, proto := range m.protocols {
		needIngress, needHost, availIngress, availHost := 0, 0, 0, 0
		for _, p := range spec {
			if p.Protocol == proto && p.Number == 0 {
				if p.Mode == Ingress {
					needIngress++
				} else {
					needHost++
				}
			}
		}
		for n := m.lo; n <= m.hi; n++ {
			s := others[Address{proto, n}]
			if s.Ingress != "" || slices.ContainsFunc(spec, func(p Port) bool { return p.Protocol == proto && p.Number == n }) {
				continue
			}
			if _, clash := s.hostClash(host, netip.Addr{}); !clash {
				availHost++
			}
			if len(s.Hosts) == 0 {
				availIngress++
			}
		}
		if needIngress > availIngress || needHost > availHost || needIngress+needHost > availHost {
			return nil
		}
	}
	return fmt.Errorf("rejection of %v for %s on %s is not justified: %v", spec, id, host, err)
}

// step runs one request on w and checks it: a rejection must be
// justified, re-applying a spec must keep the ports, and the next state
// must satisfy allocationsOK. It returns the next state (w itself after a
// rejection) and whether the request was accepted.
func (m model) step(w world, id, host string, spec []Port, rules Rules) (world, bool, error) {
	old, exists := w.eps[id]
	req := Request{Endpoint: id, Host: host, Old: old, Spec: spec, Lo: m.lo, Hi: m.hi, Start: m.lo, Rules: rules}
	res, err := Plan(w.addrs, req)
	if err != nil {
		if !errors.Is(err, ErrInUse) && !errors.Is(err, ErrDuplicate) && !errors.Is(err, ErrExhausted) {
			return w, false, fmt.Errorf("from %s: %v for %s: unexpected error %v", w.key(), spec, id, err)
		}
		if jerr := m.rejectJustified(w, id, host, spec, err); jerr != nil {
			return w, false, fmt.Errorf("from %s: %w", w.key(), jerr)
		}
		return w, false, nil
	}
	if exists && slices.Equal(old.Spec, spec) && !slices.Equal(old.Ports, res.Ports) {
		return w, false, fmt.Errorf("from %s: re-applying %v to %s changed its ports %v -> %v (not idempotent)", w.key(), spec, id, old.Ports, res.Ports)
	}
	next := world{eps: map[string]Endpoint{}, addrs: w.addrs.apply(res.Changes)}
	for k, v := range w.eps {
		next.eps[k] = v
	}
	if len(spec) == 0 {
		delete(next.eps, id) // removal
	} else {
		next.eps[id] = Endpoint{Host: host, Spec: spec, Ports: res.Ports}
	}
	if err := m.allocationsOK(next); err != nil {
		return w, false, fmt.Errorf("from %s applying %v to %s: %w", w.key(), spec, id, err)
	}
	return next, true, nil
}

// check explores every reachable state of the model under rules and
// returns the first violation, with the number of states visited.
func (m model) check(rules Rules) (int, error) {
	start := world{eps: map[string]Endpoint{}, addrs: memView{}}
	seen := map[string]bool{start.key(): true}
	queue := []world{start}
	plans := 0
	began := time.Now()
	for len(queue) > 0 {
		w := queue[0]
		queue = queue[1:]
		if m.progress && len(seen)%2000 == 0 {
			fmt.Printf("states %d queue %d plans %d in %v\n", len(seen), len(queue), plans, time.Since(began))
		}
		for _, id := range m.ids {
			old, exists := w.eps[id]
			var hosts []string
			if exists {
				hosts = []string{old.Host}
			} else {
				hosts = m.hosts
			}
			for _, host := range hosts {
				for _, spec := range m.specs {
					plans++
					next, ok, err := m.step(w, id, host, spec, rules)
					if err != nil {
						return len(seen), err
					}
					if k := next.key(); ok && !seen[k] {
						seen[k] = true
						queue = append(queue, next)
					}
				}
			}
			if exists { // removal never fails
				if _, err := Plan(w.addrs, Request{Endpoint: id, Host: old.Host, Old: old, Lo: m.lo, Hi: m.hi, Rules: rules}); err != nil {
					return len(seen), fmt.Errorf("removing %s failed: %v", id, err)
				}
			}
		}
	}
	return len(seen), nil
}

func TestModelCheckPorts(t *testing.T) {
	m := exhaustiveModel()
	m.progress = os.Getenv("PORTS_PROGRESS") != ""
	n, err := m.check(AllRules)
	t.Logf("port allocator model check: %d states visited, %d specs per endpoint", n, len(m.specs))
	if err != nil {
		t.Fatal(err)
	}
}

// Each rule switched off (one SwarmKit XXX behaviour back) is caught by the
// model check.
func TestModelCheckCatchesEachXXX(t *testing.T) {
	m := exhaustiveModel()
	for name, r := range map[string]func(*Rules){
		"1 recovers an old port a static entry needs":     func(r *Rules) { r.GiveUpForcedOld = false },
		"2 similar dynamic entries share a number":        func(r *Rules) { r.DistinctSimilar = false },
		"3 dynamic ingress shadows a host port":           func(r *Rules) { r.IngressAvoidsHostPorts = false },
		"4 host port hidden by an ingress port accepted":  func(r *Rules) { r.RefuseHiddenHostPorts = false },
		"5 host ports collide on one host":                func(r *Rules) { r.HostPortsUnique = false },
		"6 a later similar entry is not recovered stably": func(r *Rules) { r.StableRecovery = false },
	} {
		t.Run(name, func(t *testing.T) {
			rules := AllRules
			r(&rules)
			n, err := m.check(rules)
			if err == nil {
				t.Fatalf("the broken allocator passed the model check (%d states)", n)
			}
			t.Logf("caught after %d states: %v", n, err)
		})
	}
}

// TestRandomWalkPorts walks the full-size model (2 protocols, 3
// dynamic and 2 static numbers) at random, checking the same properties on
// every step.
func TestRandomWalkPorts(t *testing.T) {
	m := newModel([]string{"tcp", "udp"}, []uint16{80, 81}, 30000, 30002)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	w := world{eps: map[string]Endpoint{}, addrs: memView{}}
	for step := range 20000 {
		id := m.ids[rng.IntN(len(m.ids))]
		old, exists := w.eps[id]
		host := m.hosts[rng.IntN(len(m.hosts))]
		if exists {
			host = old.Host
		}
		spec := m.specs[rng.IntN(len(m.specs))]
		if exists && rng.IntN(4) == 0 {
			spec = old.Spec // re-apply: must be idempotent
		}
		next, _, err := m.step(w, id, host, spec, AllRules)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		w = next
	}
}
