package portalloc

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
)

// Mode is how a port is published.
type Mode string

const (
	Ingress Mode = "ingress" // unique per address across the cluster, reachable on every host
	Host    Mode = "host"    // unique per (host, host IP, address)
)

// Protocols a port may use.
var Protocols = []string{"tcp", "udp", "sctp"}

// Port is one published port: an entry of a spec (Published 0 asks for a
// dynamic number) or an allocated port.
type Port struct {
	Mode     Mode       `json:"mode"`
	Name     string     `json:"name,omitempty"` // what the port is for (the container port): similar ports share it
	Protocol string     `json:"protocol"`
	Number   uint16     `json:"published,omitempty"`
	HostIP   netip.Addr `json:"hostIP,omitzero"` // host mode: the address bound; invalid: every address
}

// Address is a (protocol, port number) pair.
type Address struct {
	Protocol string
	Number   uint16
}

func (p Port) addr() Address { return Address{p.Protocol, p.Number} }

func (a Address) String() string { return fmt.Sprintf("%s/%d", a.Protocol, a.Number) }

// mostlyEqual: the seed's PortsMostlyEqual, equal but for the number.
func mostlyEqual(a, b Port) bool {
	a.Number, b.Number = 0, 0
	return a == b
}

// HostUse is one host-mode binding of an address.
type HostUse struct {
	Host     string     `json:"h"`
	IP       netip.Addr `json:"ip,omitzero"`
	Endpoint string     `json:"e"`
}

// AddrState is who holds one address.
type AddrState struct {
	Ingress     string    `json:"i,omitempty"`  // endpoint holding it in ingress mode
	IngressHost string    `json:"ih,omitempty"` // that endpoint's host (where others forward)
	Hosts       []HostUse `json:"hs,omitempty"`
}

func (s AddrState) empty() bool { return s.Ingress == "" && len(s.Hosts) == 0 }

// without returns s with endpoint's holdings removed.
func (s AddrState) without(endpoint string) AddrState {
	out := AddrState{}
	if s.Ingress != endpoint {
		out.Ingress, out.IngressHost = s.Ingress, s.IngressHost
	}
	for _, u := range s.Hosts {
		if u.Endpoint != endpoint {
			out.Hosts = append(out.Hosts, u)
		}
	}
	return out
}

// overlaps reports whether two host-mode bindings on one host collide:
// same IP, or either bound to every address.
func overlaps(a, b netip.Addr) bool { return !a.IsValid() || !b.IsValid() || a == b }

// hostClash returns a use on host that a binding to ip would collide with.
func (s AddrState) hostClash(host string, ip netip.Addr) (HostUse, bool) {
	for _, u := range s.Hosts {
		if u.Host == host && overlaps(u.IP, ip) {
			return u, true
		}
	}
	return HostUse{}, false
}

// Endpoint is what the store keeps of one endpoint: its owner kind (Kind),
// host, spec and ports (Ports[i] is Spec[i] allocated).
type Endpoint struct {
	Kind  string `json:"kind"`
	Host  string `json:"host"`
	Spec  []Port `json:"spec"`
	Ports []Port `json:"ports"`
}

// View answers what Plan needs to know about addresses. State returns an
// address's holders; NextFree returns the first number n >= from (wrapping
// within [lo, hi]) of protocol for which free(state) holds.
type View interface {
	State(a Address) (AddrState, error)
	NextFree(protocol string, lo, hi, from uint16, free func(uint16, AddrState) bool) (uint16, bool, error)
}

// Rules are the corrections of SwarmKit's allocator. Production uses
// AllRules; each field switched off gives back one XXX behaviour of the
// seed, for the tests that show the difference.
type Rules struct {
	GiveUpForcedOld        bool // XXX 1: an old dynamic port a static entry needs is not recovered
	DistinctSimilar        bool // XXX 2: similar dynamic entries get distinct numbers
	IngressAvoidsHostPorts bool // XXX 3: a dynamic ingress port avoids addresses host ports use anywhere
	RefuseHiddenHostPorts  bool // XXX 4: a host port on an address an ingress port holds is refused
	HostPortsUnique        bool // XXX 5: host ports on one host and host IP never collide
	StableRecovery         bool // XXX 6: the k-th similar entry recovers the k-th similar old port
}

// AllRules is the allocator ringipam ships.
var AllRules = Rules{true, true, true, true, true, true}

// Request is one Allocate: endpoint (its id) on host replaces old by spec.
type Request struct {
	Endpoint string
	Host     string
	Old      Endpoint // the stored endpoint; zero for a new one
	Spec     []Port
	Lo, Hi   uint16 // the dynamic range
	// Start is where dynamic searches begin (within [Lo, Hi]); spreading
	// it per endpoint keeps concurrent hosts off the same numbers.
	Start uint16
	Rules Rules
}

// Result is Plan's proposal.
type Result struct {
	Ports   []Port                // the endpoint's new ports, in spec order
	Changes map[Address]AddrState // every address whose holders change, as they must be stored
	// Previous are the ports the endpoint held before (those its stored
	// record claims and their addresses list): what a data path set up for
	// the endpoint's previous request covers.
	Previous []Port
	// Findings are stored allocations that did not check out (a port the
	// endpoint record claims but its address does not list): reported,
	// neither recovered nor released.
	Findings []string
}

// ValidateSpec checks a spec on its own: known modes and protocols, a host
// IP only in host mode.
func ValidateSpec(spec []Port) error {
	for i, p := range spec {
		if p.Mode != Ingress && p.Mode != Host {
			return fmt.Errorf("%w: port %d: mode %q is neither ingress nor host", ErrInvalid, i, p.Mode)
		}
		if !slices.Contains(Protocols, p.Protocol) {
			return fmt.Errorf("%w: port %d: protocol %q is not one of %v", ErrInvalid, i, p.Protocol, Protocols)
		}
		if p.Mode == Ingress && p.HostIP.IsValid() {
			return fmt.Errorf("%w: port %d: an ingress port is published on every address of every host; it takes no hostIP", ErrInvalid, i)
		}
	}
	return nil
}

// Plan decides req: the seed's Allocate, one proposal, with req.Rules.
func Plan(v View, req Request) (Result, error) {
	if err := ValidateSpec(req.Spec); err != nil {
		return Result{}, err
	}
	if req.Lo == 0 || req.Lo > req.Hi {
		return Result{}, fmt.Errorf("%w: dynamic range %d-%d", ErrInvalid, req.Lo, req.Hi)
	}
	me := req.Endpoint
	res := Result{Changes: map[Address]AddrState{}}
	state := func(a Address) (AddrState, error) {
		if s, ok := res.Changes[a]; ok {
			return s, nil
		}
		return v.State(a)
	}
	// Re-validate the stored ports: only those their address lists as this
	// endpoint's count as held, and only a record whose ports fit its spec
	// is recovered from.
	var held []Port
	dynamicOld := map[int]bool{} // held ports whose spec entry was dynamic
	fits := recordFits(req.Old)
	if !fits {
		res.Findings = append(res.Findings, fmt.Sprintf("endpoint %s: stored ports %v do not fit its stored spec %v: nothing is recovered from it", me, req.Old.Ports, req.Old.Spec))
	}
	for j, p := range req.Old.Ports {
		s, err := v.State(p.addr())
		if err != nil {
			return Result{}, err
		}
		if lists(s, me, p, req.Old.Host) {
			if fits && req.Old.Spec[j].Number == 0 {
				dynamicOld[len(held)] = true
			}
			held = append(held, p)
		} else {
			res.Findings = append(res.Findings, fmt.Sprintf("endpoint %s claims %s %s, which its address does not list", me, p.Mode, p.addr()))
		}
	}
	res.Previous = held
	// Release every held port; the new ones are added below.
	for _, p := range held {
		s, err := state(p.addr())
		if err != nil {
			return Result{}, err
		}
		res.Changes[p.addr()] = s.without(me)
	}
	if len(req.Spec) == 0 {
		return res, nil
	}
	if err := duplicates(req.Spec); err != nil {
		return Result{}, err
	}
	forced := map[Address]bool{}
	for _, p := range req.Spec {
		if p.Number != 0 {
			forced[p.addr()] = true
		}
	}
	// Step 1: recover dynamic entries from the old ports: an entry that is
	// in the old spec unchanged gets a similar old port back.
	ports := slices.Clone(req.Spec)
	recovered := map[int]bool{}
	used := map[int]bool{} // old ports already given back
	for i, s := range req.Spec {
		if s.Number != 0 || !slices.Contains(req.Old.Spec, s) {
			continue
		}
		if !req.Rules.StableRecovery && req.Rules.DistinctSimilar && earlierSimilarDynamic(req.Spec, i) {
			continue // the seed's "duplicate" rule: a later similar entry stays dynamic
		}
		for j, o := range held {
			if !dynamicOld[j] || !mostlyEqual(o, s) || (o.Mode == Host && req.Old.Host != req.Host) {
				continue
			}
			if req.Rules.GiveUpForcedOld && forced[o.addr()] {
				continue
			}
			if req.Rules.StableRecovery && used[j] {
				continue
			}
			ports[i].Number = o.Number
			used[j], recovered[i] = true, true
			break
		}
	}
	// Step 2: numbers asked for (static) or recovered, against the other
	// endpoints and against each other.
	taken := map[Address][]Port{} // this request's ports by address
	for i, p := range ports {
		if p.Number == 0 {
			continue
		}
		s, err := state(p.addr())
		if err != nil {
			return Result{}, err
		}
		err = admits(s, me, req.Host, p, req.Rules)
		if err == nil {
			if clash, ok := clashIn(taken[p.addr()], p, req.Rules); ok {
				err = &DuplicateError{A: clash, B: p}
			}
		}
		if err != nil {
			if recovered[i] && req.Rules.DistinctSimilar {
				ports[i].Number = 0 // a recovered number that no longer fits: pick afresh
				continue
			}
			return Result{}, err
		}
		taken[p.addr()] = append(taken[p.addr()], p)
	}
	// Step 3: dynamic numbers, ingress entries first: every number an
	// ingress entry may take a host entry may take too, not the other way
	// round, so this order never strands a host entry needlessly.
	var order []int
	for _, mode := range []Mode{Ingress, Host} {
		for i, p := range ports {
			if p.Number == 0 && p.Mode == mode {
				order = append(order, i)
			}
		}
	}
	for k := 0; k < len(order); k++ {
		i := order[k]
		p := ports[i]
		start := req.Start
		if start < req.Lo || start > req.Hi {
			start = req.Lo
		}
		n, ok, err := v.NextFree(p.Protocol, req.Lo, req.Hi, start, func(n uint16, stored AddrState) bool {
			a := Address{p.Protocol, n}
			s := stored
			if c, ok := res.Changes[a]; ok {
				s = c
			}
			q := p
			q.Number = n
			if admits(s, me, req.Host, q, req.Rules) != nil {
				return false
			}
			var others []Port
			for _, o := range taken[a] {
				if req.Rules.DistinctSimilar || !mostlyEqual(o, q) {
					others = append(others, o)
				}
			}
			_, clash := clashIn(others, q, req.Rules)
			return !clash
		})
		if err != nil {
			return Result{}, err
		}
		if !ok && p.Mode == Ingress {
			// A host entry that recovered its old number may give it up
			// for an ingress entry and pick another one itself.
			if j, ok2 := yieldable(ports, recovered, p.Protocol, req.Lo, req.Hi); ok2 {
				a := ports[j].addr()
				taken[a] = slices.DeleteFunc(taken[a], func(o Port) bool { return o == ports[j] })
				ports[j].Number = 0
				recovered[j] = false
				order = append(order, j)
				k--
				continue
			}
		}
		if !ok {
			return Result{}, &ExhaustedError{Protocol: p.Protocol, Lo: req.Lo, Hi: req.Hi}
		}
		ports[i].Number = n
		if clash, ok := clashIn(taken[ports[i].addr()], ports[i], req.Rules); ok {
			// Only without DistinctSimilar: SwarmKit gives similar entries
			// one number and then rejects the request.
			return Result{}, &DuplicateError{A: clash, B: ports[i]}
		}
		taken[ports[i].addr()] = append(taken[ports[i].addr()], ports[i])
	}
	// The new holdings.
	for _, p := range ports {
		s, err := state(p.addr())
		if err != nil {
			return Result{}, err
		}
		if p.Mode == Ingress {
			s.Ingress, s.IngressHost = me, req.Host
		} else {
			s.Hosts = append(slices.Clone(s.Hosts), HostUse{Host: req.Host, IP: p.HostIP, Endpoint: me})
		}
		res.Changes[p.addr()] = s
	}
	res.Ports = ports
	return res, nil
}

// recordFits reports whether a stored endpoint's ports are its spec
// allocated: one port per entry, a static entry's number kept, a dynamic
// entry given a number, nothing else changed.
func recordFits(e Endpoint) bool {
	if len(e.Spec) != len(e.Ports) {
		return false
	}
	for i, s := range e.Spec {
		p := e.Ports[i]
		if p.Number == 0 || !mostlyEqual(s, p) || s.Number != 0 && s.Number != p.Number {
			return false
		}
	}
	return true
}

// yieldable returns a host entry of this request that recovered a dynamic
// number of protocol (in [lo, hi]) and may pick another one.
func yieldable(ports []Port, recovered map[int]bool, protocol string, lo, hi uint16) (int, bool) {
	for j, p := range ports {
		if recovered[j] && p.Mode == Host && p.Protocol == protocol && p.Number >= lo && p.Number <= hi {
			return j, true
		}
	}
	return 0, false
}

// lists reports whether address state s records port p of endpoint me on host.
func lists(s AddrState, me string, p Port, host string) bool {
	if p.Mode == Ingress {
		return s.Ingress == me
	}
	for _, u := range s.Hosts {
		if u.Endpoint == me && u.Host == host && u.IP == p.HostIP {
			return true
		}
	}
	return false
}

func earlierSimilarDynamic(spec []Port, i int) bool {
	for j := range i {
		if spec[j].Number == 0 && mostlyEqual(spec[j], spec[i]) {
			return true
		}
	}
	return false
}

// admits says whether port p (number set) of endpoint me on host may take
// its address given the address's stored state s (me's own old holdings
// are released already).
func admits(s AddrState, me, host string, p Port, r Rules) error {
	s = s.without(me)
	if s.Ingress != "" && (p.Mode == Ingress || r.RefuseHiddenHostPorts) {
		return &InUseError{Addr: p.addr(), Holder: s.Ingress, Host: s.IngressHost, Mode: Ingress}
	}
	switch p.Mode {
	case Ingress:
		if len(s.Hosts) > 0 && r.IngressAvoidsHostPorts {
			u := s.Hosts[0]
			return &InUseError{Addr: p.addr(), Holder: u.Endpoint, Host: u.Host, Mode: Host}
		}
	case Host:
		if u, clash := s.hostClash(host, p.HostIP); clash && r.HostPortsUnique {
			return &InUseError{Addr: p.addr(), Holder: u.Endpoint, Host: u.Host, Mode: Host}
		}
	}
	return nil
}

// clashIn returns a port of this request at the same address that p
// collides with.
func clashIn(others []Port, p Port, r Rules) (Port, bool) {
	for _, o := range others {
		switch {
		case o.Mode == Ingress || p.Mode == Ingress:
			return o, true
		case r.HostPortsUnique && overlaps(o.HostIP, p.HostIP):
			return o, true
		}
	}
	return Port{}, false
}

// duplicates refuses a spec that asks for one address twice in a way that
// cannot be honoured: two static ingress entries, a static ingress and a
// static host entry, or two static host entries on overlapping host IPs.
func duplicates(spec []Port) error {
	for i, a := range spec {
		for _, b := range spec[:i] {
			if a.Number == 0 || b.Number == 0 || a.addr() != b.addr() {
				continue
			}
			if a.Mode == Ingress || b.Mode == Ingress || overlaps(a.HostIP, b.HostIP) {
				return &DuplicateError{A: b, B: a}
			}
		}
	}
	return nil
}

// Errors.
var (
	ErrInvalid   = errors.New("invalid port specification")
	ErrInUse     = errors.New("port already in use")
	ErrDuplicate = errors.New("port asked twice in one request")
	ErrExhausted = errors.New("dynamic port range exhausted")
	ErrTryAgain  = errors.New("try again later")
	// ErrCorrupt: a stored record cannot be read (reported, never used).
	ErrCorrupt = errors.New("stored port record is corrupt")
)

// InUseError names who holds an address.
type InUseError struct {
	Addr   Address
	Mode   Mode // the holder's mode
	Holder string
	Host   string
}

func (e *InUseError) Error() string {
	return fmt.Sprintf("port %s is already published in %s mode by %s on host %s", e.Addr, e.Mode, e.Holder, e.Host)
}

func (e *InUseError) Unwrap() error { return ErrInUse }

// DuplicateError names the two entries of one request that collide.
type DuplicateError struct{ A, B Port }

func (e *DuplicateError) Error() string {
	return fmt.Sprintf("port %s is asked twice in one request (%s %q and %s %q)", e.B.addr(), e.A.Mode, e.A.Name, e.B.Mode, e.B.Name)
}

func (e *DuplicateError) Unwrap() error { return ErrDuplicate }

// ExhaustedError says which protocol's dynamic range is full.
type ExhaustedError struct {
	Protocol string
	Lo, Hi   uint16
}

func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("no free %s port left in the dynamic range %d-%d", e.Protocol, e.Lo, e.Hi)
}

func (e *ExhaustedError) Unwrap() error { return ErrExhausted }
