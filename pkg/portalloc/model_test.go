package portalloc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
)

// This file is an exhaustive model check of Plan in the style of TLC, at
// the size the issue asks for: 2 endpoints, up to 2 ports each, 2
// protocols, 3 dynamic and 2 static numbers, both modes, 2 hosts. Plan's
// own code runs unchanged over memView, an address table in a map.
//
// Breadth-first from the empty state, every endpoint applies every spec
// (every multiset of at most two entries: Plan's outcome does not depend on
// the order of entries, see below) on every host it may use, and every
// transition is checked:
//
//   - a rejection satisfies the seed's RejectJustified, with the host-port
//     rules: the spec is bad in itself, a static address is held by another
//     endpoint in a way that forbids it, or a protocol has fewer dynamic
//     numbers left than the spec needs; removal (the empty spec) never fails;
//   - an accepted step whose spec is the endpoint's current spec returns its
//     current ports (the seed's AllocateIdempotent);
//   - the next state satisfies AllocationsOK with the host-port rules: the
//     address table lists exactly the ports the endpoints hold, each port
//     fits its spec entry, no address is both an ingress and a host port, no
//     two ingress ports share an address, and no two host ports collide on
//     one host.
//
// Two reductions keep it to seconds, both sound because Plan treats the
// things they identify alike:
//
//   - symmetry: states that differ only by renaming the endpoints, the
//     hosts, the protocols or the two static numbers are one state (Plan
//     compares them only for equality; the dynamic numbers are not renamed,
//     since a dynamic search runs in number order);
//   - a step of one endpoint depends on the other endpoint only through the
//     addresses it holds (its ports and host), not through its spec; the
//     steps of an endpoint are computed and checked once per (own record,
//     other's holdings), up to symmetry, and reused for every state that
//     shares them.
//
// Entry order: the model's specs are multisets, listed in a fixed order.
// Plan assigns dynamic numbers ingress entries first, then host entries,
// each in spec order, and entries of one mode and protocol in this model
// are identical (one name, no host IP), so reordering entries only permutes
// identical entries. Host IPs are covered by the unit tests of hostClash.

// portModel is the world the checker explores.
type portModel struct {
	protocols []string
	numbers   []uint16 // index 0 is "dynamic" (0); then the static numbers; then the dynamic range
	lo, hi    uint16
	hosts     []string
	entries   []Port  // every spec entry and port: mode x protocol x number
	specs     [][]int // every multiset of at most two entries (as entry codes), the empty one first
	perms     [][]int // entry renamings: protocol swap x static-number swap
	rules     Rules
	code      map[Port]int
	renamed   map[uint32]*[8]uint32 // see renamings
	outcomes  map[stepKey]outcome   // see stepsOf
	plans     int                   // steps planned and checked
	// plain switches both reductions off (for TestModelCheckReductions).
	plain bool
}

// stepKey identifies a step by everything Plan and the checks read: the
// endpoint's record (32 bits), the host (1) and spec (9) it asks for, and
// the other endpoint's host and ports on the addresses the step can look
// at (see relevant and restrict: 14).
type stepKey uint64

func newStepKey(own rec, spec int, host uint8, oth uint32) stepKey {
	return stepKey(uint64(own.pack())<<32 | uint64(spec)<<23 | uint64(host)<<22 | uint64(oth))
}

// outcome is a checked step's result: rejected, or the next record.
type outcome struct {
	accepted bool
	next     rec
}

// The two endpoint names inside a step: the one applying a spec, and the
// other one.
const (
	me    = "e1"
	other = "e2"
)

// issueModel is the size the issue asks for.
func issueModel(rules Rules) *portModel {
	return newPortModel([]string{"tcp", "udp"}, []uint16{80, 81}, rules)
}

// newPortModel: 2 endpoints on 2 hosts, up to 2 ports each, both modes, 3
// dynamic numbers (30000-30002), one or two protocols and static numbers.
func newPortModel(protocols []string, static []uint16, rules Rules) *portModel {
	m := &portModel{protocols: protocols, numbers: append(append([]uint16{0}, static...), 30000, 30001, 30002), lo: 30000, hi: 30002,
		hosts: []string{"h1", "h2"}, rules: rules, code: map[Port]int{},
		renamed: map[uint32]*[8]uint32{}, outcomes: map[stepKey]outcome{}}
	for _, mode := range []Mode{Ingress, Host} {
		for _, proto := range m.protocols {
			for _, n := range m.numbers {
				m.code[Port{Mode: mode, Name: "web", Protocol: proto, Number: n}] = len(m.entries)
				m.entries = append(m.entries, Port{Mode: mode, Name: "web", Protocol: proto, Number: n})
			}
		}
	}
	m.specs = append(m.specs, nil)
	for a := range m.entries {
		m.specs = append(m.specs, []int{a})
		for b := a; b < len(m.entries); b++ {
			m.specs = append(m.specs, []int{a, b})
		}
	}
	for _, swapProto := range []bool{false, true} {
		for _, swapStatic := range []bool{false, true} {
			if swapProto && len(protocols) != 2 || swapStatic && len(static) != 2 {
				continue
			}
			perm := make([]int, len(m.entries))
			for c, p := range m.entries {
				if swapProto {
					p.Protocol = m.protocols[1-slices.Index(m.protocols, p.Protocol)]
				}
				if swapStatic && (p.Number == m.numbers[1] || p.Number == m.numbers[2]) {
					p.Number = m.numbers[1] + m.numbers[2] - p.Number
				}
				perm[c] = m.code[p]
			}
			m.perms = append(m.perms, perm)
		}
	}
	return m
}

// rec is one endpoint as the store keeps it, in entry codes: its host and
// up to two (spec entry, port) pairs, sorted.
type rec struct {
	present bool
	host    uint8
	n       uint8
	spec    [2]uint8
	port    [2]uint8
}

func (r rec) sorted() rec {
	if r.n == 2 && (r.spec[1] < r.spec[0] || r.spec[1] == r.spec[0] && r.port[1] < r.port[0]) {
		r.spec[0], r.spec[1] = r.spec[1], r.spec[0]
		r.port[0], r.port[1] = r.port[1], r.port[0]
	}
	return r
}

func (r rec) pack() uint32 {
	if !r.present {
		return 0
	}
	return 1<<31 | uint32(r.host)<<30 | uint32(r.n)<<28 | uint32(r.spec[0])<<21 | uint32(r.port[0])<<14 | uint32(r.spec[1])<<7 | uint32(r.port[1])
}

// holdings is what another endpoint's record shows a step: its host and
// ports, without its spec.
func (r rec) holdings() rec {
	r.spec = [2]uint8{}
	if r.n == 2 && r.port[1] < r.port[0] {
		r.port[0], r.port[1] = r.port[1], r.port[0]
	}
	return r
}

// rename applies entry renaming perm and host swap hs (both involutions).
func (r rec) rename(perm []int, hs uint8, holdingsOnly bool) rec {
	if !r.present {
		return r
	}
	r.host ^= hs
	for j := 0; j < int(r.n); j++ {
		if !holdingsOnly {
			r.spec[j] = uint8(perm[r.spec[j]])
		}
		r.port[j] = uint8(perm[r.port[j]])
	}
	if holdingsOnly {
		return r.holdings()
	}
	return r.sorted()
}

func (m *portModel) endpoint(r rec) (Endpoint, bool) {
	if !r.present {
		return Endpoint{}, false
	}
	e := Endpoint{Host: m.hosts[r.host]}
	for j := 0; j < int(r.n); j++ {
		e.Spec = append(e.Spec, m.entries[r.spec[j]])
		e.Ports = append(e.Ports, m.entries[r.port[j]])
	}
	return e, true
}

// table is the address table of the endpoints (their ports, as the store
// lists them).
func table(eps map[string]Endpoint) memView {
	t := memView{}
	for _, id := range []string{me, other} {
		e, ok := eps[id]
		if !ok {
			continue
		}
		for _, p := range e.Ports {
			s := t[p.addr()]
			if p.Mode == Ingress {
				s.Ingress, s.IngressHost = id, e.Host
			} else {
				s.Hosts = append(slices.Clone(s.Hosts), HostUse{Host: e.Host, IP: p.HostIP, Endpoint: id})
			}
			t[p.addr()] = s
		}
	}
	return t
}

// stateKey is a state's canonical form: the smallest packing over every
// renaming of hosts, protocols and static numbers, with the endpoints in
// either order.
func (m *portModel) stateKey(a, b rec) uint64 {
	if m.plain {
		return uint64(a.pack())<<32 | uint64(b.pack())
	}
	ra, rb := m.renamings(a), m.renamings(b)
	best := ^uint64(0)
	for i := range ra {
		x, y := ra[i], rb[i]
		if x > y {
			x, y = y, x
		}
		best = min(best, uint64(x)<<32|uint64(y))
	}
	return best
}

// renamings returns r packed under each renaming (perms x host swap),
// computed once per record.
func (m *portModel) renamings(r rec) *[8]uint32 {
	k := r.pack()
	if x, ok := m.renamed[k]; ok {
		return x
	}
	x := new([8]uint32)
	for i := range x {
		x[i] = k // unused slots (fewer renamings): the identity
	}
	for i, perm := range m.perms {
		for hs := uint8(0); hs < 2; hs++ {
			x[2*i+int(hs)] = r.rename(perm, hs, false).pack()
		}
	}
	m.renamed[k] = x
	return x
}

// stepsKey is the canonical form of (own record, other's holdings) and the
// renaming that leads there.
func (m *portModel) stepsKey(own, oth rec) (uint64, []int, uint8) {
	best := ^uint64(0)
	var bp []int
	var bh uint8
	for _, perm := range m.perms {
		for hs := uint8(0); hs < 2; hs++ {
			k := uint64(own.rename(perm, hs, false).pack())<<32 | uint64(oth.rename(perm, hs, true).pack())
			if k < best {
				best, bp, bh = k, perm, hs
			}
		}
	}
	return best, bp, bh
}

// checkStep runs one step on the address table t of a state (endpoint id
// holds old, if exists; it asks host for spec) and checks it. It returns
// the endpoint's next record (ok false when it is removed or rejected) and
// whether the step was accepted.
func checkStep(lo, hi uint16, protocols []string, t memView, id, host string, old Endpoint, exists bool, spec []Port, rules Rules) (next Endpoint, accepted bool, err error) {
	res, perr := Plan(t, Request{Endpoint: id, Host: host, Old: old, Spec: spec, Lo: lo, Hi: hi, Start: lo, Rules: rules})
	if perr != nil {
		if len(spec) == 0 {
			return Endpoint{}, false, fmt.Errorf("removing %s failed: %v", id, perr)
		}
		if !errors.Is(perr, ErrInUse) && !errors.Is(perr, ErrDuplicate) && !errors.Is(perr, ErrExhausted) {
			return Endpoint{}, false, fmt.Errorf("%v for %s on %s: unexpected error %v", spec, id, host, perr)
		}
		if jerr := rejectJustified(lo, hi, protocols, t, id, host, spec, perr); jerr != nil {
			return Endpoint{}, false, jerr
		}
		return Endpoint{}, false, nil
	}
	if exists && slices.Equal(old.Spec, spec) && !slices.Equal(old.Ports, res.Ports) {
		return Endpoint{}, false, fmt.Errorf("re-applying %v to %s changed its ports %v -> %v (AllocateIdempotent)", spec, id, old.Ports, res.Ports)
	}
	next = Endpoint{Host: host, Spec: spec, Ports: res.Ports}
	if err := allocationsOK(lo, hi, t, t.apply(res.Changes), id, next); err != nil {
		return Endpoint{}, false, fmt.Errorf("applying %v to %s on %s: %w", spec, id, host, err)
	}
	return next, true, nil
}

// allocationsOK is the seed's AllocationsOK with the host-port rules, for
// the state a step reaches: after is the stored table, before the table
// the step started from (whose other holders were consistent), e the
// stepping endpoint's new record (no spec: removed).
func allocationsOK(lo, hi uint16, before, after memView, id string, e Endpoint) error {
	// The endpoint's ports fit its spec.
	if len(e.Spec) != len(e.Ports) {
		return fmt.Errorf("%s has %d ports for %d entries", id, len(e.Ports), len(e.Spec))
	}
	for i, s := range e.Spec {
		p := e.Ports[i]
		if s.Number == 0 && (!mostlyEqual(s, p) || p.Number < lo || p.Number > hi) || s.Number != 0 && s != p {
			return fmt.Errorf("%s port %d is %+v for spec entry %+v", id, i, p, s)
		}
	}
	// The table lists exactly the endpoint's ports, and nobody else's
	// holdings changed.
	want := memView{}
	for a, s := range before {
		if t := s.without(id); !t.empty() {
			want[a] = t
		}
	}
	for _, p := range e.Ports {
		s := want[p.addr()]
		if p.Mode == Ingress {
			if s.Ingress != "" {
				return fmt.Errorf("%s is the ingress port of %s and of %s", p.addr(), s.Ingress, id)
			}
			s.Ingress, s.IngressHost = id, e.Host
		} else {
			s.Hosts = append(slices.Clone(s.Hosts), HostUse{Host: e.Host, IP: p.HostIP, Endpoint: id})
		}
		want[p.addr()] = s
	}
	if !sameTable(want, after) {
		return fmt.Errorf("the stored table %v is not the endpoints' ports %v", after, want)
	}
	// No address is an ingress and a host port; host ports never collide.
	for a, s := range after {
		if s.Ingress != "" && len(s.Hosts) > 0 {
			return fmt.Errorf("%s is an ingress port of %s and a host port of %s", a, s.Ingress, s.Hosts[0].Endpoint)
		}
		for i, u := range s.Hosts {
			for _, v := range s.Hosts[:i] {
				if v.Host == u.Host && overlaps(v.IP, u.IP) {
					return fmt.Errorf("%s: host ports of %s and %s collide on %s", a, v.Endpoint, u.Endpoint, u.Host)
				}
			}
		}
	}
	return nil
}

// sameTable compares two tables, the host uses of an address as a multiset.
func sameTable(a, b memView) bool {
	if len(a) != len(b) {
		return false
	}
	for k, x := range a {
		y, ok := b[k]
		if !ok || x.Ingress != y.Ingress || x.IngressHost != y.IngressHost || len(x.Hosts) != len(y.Hosts) {
			return false
		}
		for _, u := range x.Hosts {
			if slices.Index(x.Hosts, u) == slices.Index(y.Hosts, u) && slices.Contains(y.Hosts, u) {
				continue
			}
			cx, cy := 0, 0
			for _, v := range x.Hosts {
				if v == u {
					cx++
				}
			}
			for _, v := range y.Hosts {
				if v == u {
					cy++
				}
			}
			if cx != cy {
				return false
			}
		}
	}
	return true
}

// rejectJustified is the seed's RejectJustified with the host-port rules:
// the spec is bad in itself; or a static entry's address is held by another
// endpoint in a way that forbids it (an ingress port anywhere; for an
// ingress entry a host port anywhere; for a host entry a host port on the
// same host and an overlapping host IP); or some protocol has fewer dynamic
// numbers left than the spec asks for.
func rejectJustified(lo, hi uint16, protocols []string, t memView, id, host string, spec []Port, err error) error {
	if ValidateSpec(spec) != nil || duplicates(spec) != nil {
		return nil
	}
	others := func(a Address) AddrState { return t[a].without(id) }
	for _, p := range spec {
		if p.Number == 0 {
			continue
		}
		s := others(p.addr())
		if s.Ingress != "" || p.Mode == Ingress && len(s.Hosts) > 0 {
			return nil
		}
		if _, clash := s.hostClash(host, p.HostIP); clash && p.Mode == Host {
			return nil
		}
	}
	for _, proto := range protocols {
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
		if needIngress+needHost == 0 {
			continue
		}
		for n := lo; n <= hi; n++ {
			s := others(Address{proto, n})
			if s.Ingress != "" || slices.ContainsFunc(spec, func(p Port) bool { return p.Protocol == proto && p.Number == n }) {
				continue
			}
			if _, clash := s.hostClash(host, netipAny); !clash {
				availHost++
			}
			if len(s.Hosts) == 0 {
				availIngress++
			}
		}
		if needIngress > availIngress || needIngress+needHost > availHost {
			return nil
		}
	}
	return fmt.Errorf("rejecting %v for %s on %s is not justified: %v", spec, id, host, err)
}

// addrBit is the bit of an entry's address (protocol, number) in a mask
// of the model's addresses; entries asking for a dynamic number have none.
func (m *portModel) addrBit(c int) uint16 {
	k := c % len(m.numbers)
	if k == 0 {
		return 0
	}
	proto := (c / len(m.numbers)) % len(m.protocols)
	return 1 << (proto*(len(m.numbers)-1) + k - 1)
}

// relevant is the mask of the addresses a step of own asking for spec can
// read: Plan reads own's old ports, the spec's static addresses and the
// dynamic range of each protocol the spec asks a dynamic number of; the
// checks read no more.
func (m *portModel) relevant(own rec, sc []int) uint16 {
	var mask uint16
	for j := 0; j < int(own.n); j++ {
		mask |= m.addrBit(int(own.port[j]))
	}
	for _, c := range sc {
		if m.entries[c].Number != 0 {
			mask |= m.addrBit(c)
			continue
		}
		base := (c / len(m.numbers)) % len(m.protocols) * len(m.numbers)
		for k := range m.numbers {
			if n := m.numbers[k]; n >= m.lo && n <= m.hi {
				mask |= m.addrBit(base + k)
			}
		}
	}
	return mask
}

// restrict packs the other endpoint's host and its ports on mask (14 bits).
func (m *portModel) restrict(oth rec, mask uint16) uint32 {
	if !oth.present {
		return 0
	}
	var out uint32
	for j := 0; j < int(oth.n); j++ {
		if m.addrBit(int(oth.port[j]))&mask != 0 {
			out = out<<6 | uint32(oth.port[j]) + 1
		}
	}
	if out == 0 {
		return 0
	}
	return 1<<13 | uint32(oth.host)<<12 | out
}

// stepsOf returns the records endpoint me (own) may reach next to the
// other endpoint's holdings oth. A step is planned and checked once per
// stepKey: states that differ only where the step cannot look share it.
func (m *portModel) stepsOf(own, oth rec) ([]rec, error) {
	var t memView
	var eps map[string]Endpoint
	old, exists := m.endpoint(own)
	hosts := []uint8{0, 1}
	if exists {
		hosts = []uint8{own.host}
	}
	var out []rec
	for _, h := range hosts {
		for si, sc := range m.specs {
			key := newStepKey(own, si, h, m.restrict(oth, m.relevant(own, sc)))
			o, seen := m.outcomes[key]
			if !seen || m.plain {
				if t == nil {
					eps = map[string]Endpoint{}
					if exists {
						eps[me] = old
					}
					if e, ok := m.endpoint(oth); ok {
						eps[other] = e
					}
					t = table(eps)
				}
				spec := make([]Port, len(sc))
				for j, c := range sc {
					spec[j] = m.entries[c]
				}
				m.plans++
				next, ok, err := checkStep(m.lo, m.hi, m.protocols, t, me, m.hosts[h], old, exists, spec, m.rules)
				if err != nil {
					return nil, fmt.Errorf("%w\n  in the state: %s holds %v on %s; %s holds %v on %s", err, me, old.Ports, old.Host, other, eps[other].Ports, eps[other].Host)
				}
				o.accepted = ok
				if ok && len(sc) > 0 {
					o.next = rec{present: true, host: h, n: uint8(len(sc))}
					for j, c := range sc {
						o.next.spec[j], o.next.port[j] = uint8(c), uint8(m.code[next.Ports[j]])
					}
					o.next = o.next.sorted()
				}
				m.outcomes[key] = o
			}
			if o.accepted {
				out = append(out, o.next)
			}
		}
	}
	return out, nil
}

// modelResult is what one exploration found.
type modelResult struct {
	states, steps, plans int
	// orbits is the number of states the canonical ones stand for (every
	// renaming of each), 0 in a plain run.
	orbits int
}

// check explores every reachable state; the error is the first violation.
func (m *portModel) check() (modelResult, error) {
	type state [2]rec
	var res modelResult
	seen := map[uint64]bool{m.stateKey(rec{}, rec{}): true}
	queue := []state{{}}
	res.orbits = 1
	steps := map[uint64][]rec{}
	for len(queue) > 0 {
		s := queue[0]
		queue = queue[1:]
		for i := range 2 {
			own, oth := s[i], s[1-i]
			k, perm, hs := m.stepsKey(own, oth.holdings())
			if m.plain {
				perm, hs = m.perms[0], 0 // the identity
			}
			nexts, ok := steps[k]
			if !ok || m.plain {
				var err error
				nexts, err = m.stepsOf(own.rename(perm, hs, false), oth.rename(perm, hs, true))
				res.plans = m.plans
				if err != nil {
					res.states = len(seen)
					return res, err
				}
				steps[k] = nexts
			}
			for _, n := range nexts {
				res.steps++
				n = n.rename(perm, hs, false) // renamings are involutions
				var next state
				next[i], next[1-i] = n, oth
				if k := m.stateKey(next[0], next[1]); !seen[k] {
					seen[k] = true
					queue = append(queue, next)
					if !m.plain {
						res.orbits += m.orbit(next)
					}
				}
			}
		}
	}
	res.states = len(seen)
	return res, nil
}

// orbit is the number of distinct states s stands for: its images under
// every renaming, the endpoints in either order.
func (m *portModel) orbit(s [2]rec) int {
	ra, rb := m.renamings(s[0]), m.renamings(s[1])
	images := map[uint64]bool{}
	for i := range ra {
		images[uint64(ra[i])<<32|uint64(rb[i])] = true
		images[uint64(rb[i])<<32|uint64(ra[i])] = true
	}
	return len(images)
}

func TestModelCheckPorts(t *testing.T) {
	began := time.Now()
	res, err := issueModel(AllRules).check()
	msg := fmt.Sprintf("port allocator model check: %d states visited (up to renaming endpoints, hosts, protocols and static numbers; %d states in all), %d steps, %d distinct steps planned and checked, in %v; AllocationsOK, RejectJustified and AllocateIdempotent hold",
		res.states, res.orbits, res.steps, res.plans, time.Since(began).Round(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Log(msg)
	if testing.Verbose() {
		fmt.Println(msg)
	}
	if res.states < 10000 {
		t.Fatalf("only %d states: the model is not exploring", res.states)
	}
}

// The two reductions lose nothing: on a smaller model (one protocol, one
// static number, so that the plain run is quick) the plain exploration,
// without symmetry or shared steps, visits exactly the states the reduced
// one stands for, and both find the allocator correct.
func TestModelCheckReductions(t *testing.T) {
	reduced, err := newPortModel([]string{"tcp"}, []uint16{80}, AllRules).check()
	if err != nil {
		t.Fatal(err)
	}
	m := newPortModel([]string{"tcp"}, []uint16{80}, AllRules)
	m.plain = true
	plain, err := m.check()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("reduced: %d states standing for %d, %d steps planned; plain: %d states, %d steps planned", reduced.states, reduced.orbits, reduced.plans, plain.states, plain.plans)
	if plain.states != reduced.orbits {
		t.Fatalf("the plain run visits %d states, the reduced one stands for %d", plain.states, reduced.orbits)
	}
}

// Each rule switched off (one SwarmKit XXX behaviour back) is caught by the
// model check.
func TestModelCheckCatchesEachXXX(t *testing.T) {
	for _, tc := range []struct {
		name string
		off  func(*Rules)
		want string // in the report
	}{
		{"1 recovers an old port a static entry needs", func(r *Rules) { r.GiveUpForcedOld = false }, "not justified"},
		{"2 similar dynamic entries share a number", func(r *Rules) { r.DistinctSimilar = false }, "not justified"},
		{"3 dynamic ingress shadows a host port", func(r *Rules) { r.IngressAvoidsHostPorts = false }, "is an ingress port of"},
		{"4 host port hidden by an ingress port accepted", func(r *Rules) { r.RefuseHiddenHostPorts = false }, "is an ingress port of"},
		{"5 host ports collide on one host", func(r *Rules) { r.HostPortsUnique = false }, "collide on"},
		{"6 a later similar entry is not recovered stably", func(r *Rules) { r.StableRecovery = false }, "AllocateIdempotent"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rules := AllRules
			tc.off(&rules)
			res, err := issueModel(rules).check()
			if err == nil {
				t.Fatalf("the broken allocator passed the model check (%d states)", res.states)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("reported %v; want a report mentioning %q", err, tc.want)
			}
			t.Logf("caught after %d states, %d distinct steps: %v", res.states, res.plans, err)
		})
	}
}

// walk is the random walk and the fuzz target's world: both endpoints,
// their specs from the model's, every step checked as in the model check.
type walk struct {
	m   *portModel
	eps map[string]Endpoint
}

func newWalk() *walk { return &walk{m: issueModel(AllRules), eps: map[string]Endpoint{}} }

// step lets endpoint id (me or other) apply the model's spec number si,
// on host hi when it does not exist yet.
func (w *walk) step(id string, hi, si int) error {
	old, exists := w.eps[id]
	host := w.m.hosts[hi%len(w.m.hosts)]
	if exists {
		host = old.Host
	}
	sc := w.m.specs[si%len(w.m.specs)]
	spec := make([]Port, len(sc))
	for j, c := range sc {
		spec[j] = w.m.entries[c]
	}
	next, ok, err := checkStep(w.m.lo, w.m.hi, w.m.protocols, table(w.eps), id, host, old, exists, spec, AllRules)
	switch {
	case err != nil:
		return fmt.Errorf("from %v: %w", w.eps, err)
	case ok && len(spec) == 0:
		delete(w.eps, id)
	case ok:
		w.eps[id] = next
	}
	return nil
}

// TestRandomWalkPorts walks the model at random, re-applying an
// endpoint's own spec every fourth step; useful with -count to look beyond
// the symmetry argument of the exhaustive check.
func TestRandomWalkPorts(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	w := newWalk()
	for step := range 20000 {
		id := []string{me, other}[rng.IntN(2)]
		si := rng.IntN(len(w.m.specs))
		if old, ok := w.eps[id]; ok && rng.IntN(4) == 0 {
			si = w.m.specIndex(old.Spec)
		}
		if err := w.step(id, rng.IntN(2), si); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
	}
}

// specIndex is the index of spec in m.specs.
func (m *portModel) specIndex(spec []Port) int {
	return slices.IndexFunc(m.specs, func(sc []int) bool {
		if len(sc) != len(spec) {
			return false
		}
		for j, c := range sc {
			if m.entries[c] != spec[j] {
				return false
			}
		}
		return true
	})
}

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
	out := make(memView, len(m)+len(ch))
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

var netipAny netip.Addr // a host-mode binding to every address
