package containernet

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/ringipam/ringipam/pkg/pool"
)

// This file is the pure core: it decides what a create asks of the pool and
// reads container networks back out of allocations. It does no I/O; the
// Manager and the model check in the tests both run it.

// Mode is which of the specification's three create operations a Spec asks
// for.
type Mode int

const (
	// FromPool is CNCreateFromPool: ip and gateway from the pool, subnet {ip}.
	FromPool Mode = iota + 1
	// FromPoolWithIP is CNCreateFromPoolWithSpecificIP.
	FromPoolWithIP
	// InSubnet is CNCreateSubnet: ip in a special subnet, gateway from the pool.
	InSubnet
)

func (m Mode) String() string {
	switch m {
	case FromPool:
		return "from-pool"
	case FromPoolWithIP:
		return "from-pool-with-ip"
	case InSubnet:
		return "in-subnet"
	}
	return "mode(" + strconv.Itoa(int(m)) + ")"
}

// Spec asks for one container network. Its fields select the operation, as
// the specification distinguishes them by their inputs:
//
//	Spec{Pool}                : FromPool
//	Spec{Pool, IP}            : FromPoolWithIP
//	Spec{Pool, Subnet, IP}    : InSubnet (IP is required)
type Spec struct {
	Pool   string       // main pool: the gateway, and a pooled ip, come from it
	IP     netip.Addr   // optional specific ip (required with Subnet)
	Subnet netip.Prefix // optional special subnet outside the pool
}

// Mode returns the operation s asks for.
func (s Spec) Mode() Mode {
	switch {
	case s.Subnet.IsValid():
		return InSubnet
	case s.IP.IsValid():
		return FromPoolWithIP
	}
	return FromPool
}

func (s Spec) String() string {
	switch s.Mode() {
	case InSubnet:
		return fmt.Sprintf("%s(%s, %s, %s)", InSubnet, s.Pool, s.Subnet, s.IP)
	case FromPoolWithIP:
		return fmt.Sprintf("%s(%s, %s)", FromPoolWithIP, s.Pool, s.IP)
	}
	return fmt.Sprintf("%s(%s)", FromPool, s.Pool)
}

// specialInfix separates a main pool's name from a special subnet in the
// name of the special subnet's pool. Pool names may not contain '/'.
const specialInfix = ":subnet:"

// SpecialPoolName is the name of the pool that holds the ips of special
// subnet subnet of main pool mainPool, for example
// "net1:subnet:198.19.7.0_24" or "net6:subnet:fd00:7::_64".
func SpecialPoolName(mainPool string, subnet netip.Prefix) string {
	s := subnet.Masked()
	return mainPool + specialInfix + s.Addr().String() + "_" + strconv.Itoa(s.Bits())
}

// isSpecialOf reports whether poolName names a special subnet pool of mainPool.
func isSpecialOf(mainPool, poolName string) bool {
	return strings.HasPrefix(poolName, mainPool+specialInfix)
}

// specialDef is the definition of special subnet subnet's pool.
func specialDef(mainPool string, subnet netip.Prefix) pool.Def {
	s := subnet.Masked()
	return pool.Def{Name: SpecialPoolName(mainPool, s), Ranges: []pool.Range{{Subnet: s}}}
}

// overlapsPool reports whether p overlaps a subnet of one of def's ranges.
// A special subnet must not: that is the seed's subnet ∩ pool = ∅, taken
// over whole range subnets so that a gateway from the pool can never fall
// inside a special subnet.
func overlapsPool(def pool.Def, p netip.Prefix) bool {
	for _, r := range def.Ranges {
		if r.Subnet.Overlaps(p) {
			return true
		}
	}
	return false
}

func familyOf(def pool.Def) string {
	if len(def.Ranges) > 0 && def.Ranges[0].Subnet.Addr().Is4() {
		return "IPv4"
	}
	return "IPv6"
}

func is4(def pool.Def) bool { return familyOf(def) == "IPv4" }

// plan is what one create asks of the pool: the wants of its transaction,
// and the special subnet pool to define (idempotently) before it.
type plan struct {
	wants   []pool.Want
	special *pool.Def
}

// planCreate decides what spec asks of main pool def (normalized), given the
// special subnets live containers of the pool use. It rejects what the
// specification's preconditions rule out and the pool could not see.
func planCreate(def pool.Def, spec Spec, live []netip.Prefix) (plan, error) {
	if err := checkSpec(def, spec); err != nil {
		return plan{}, err
	}
	if err := checkLive(spec, live); err != nil {
		return plan{}, err
	}
	return wantsFor(spec), nil
}

// checkSpec validates spec against its main pool.
func checkSpec(def pool.Def, spec Spec) error {
	if spec.Pool != def.Name {
		return fmt.Errorf("%w: spec names pool %q, definition is of %q", ErrInvalid, spec.Pool, def.Name)
	}
	if strings.Contains(spec.Pool, specialInfix) {
		return fmt.Errorf("%w: pool %q: a main pool name may not contain %q", ErrInvalid, spec.Pool, specialInfix)
	}
	if spec.IP.IsValid() && (spec.IP.Is4() != is4(def) || spec.IP.Is4In6() || spec.IP.Zone() != "") {
		return fmt.Errorf("%w: ip %s is not a plain %s address as pool %s is", ErrInvalid, spec.IP, familyOf(def), def.Name)
	}
	switch spec.Mode() {
	case FromPoolWithIP:
		if !def.Contains(spec.IP) {
			return fmt.Errorf("%w: ip %s is not an address pool %s hands out (outside its ranges, a gateway or excluded); an ip outside the pool needs a special subnet",
				ErrInvalid, spec.IP, def.Name)
		}
	case InSubnet:
		s := spec.Subnet
		switch {
		case !spec.IP.IsValid():
			return fmt.Errorf("%w: special subnet %s needs the container's ip in it", ErrInvalid, s)
		case s.Addr().Is4() != is4(def) || s.Addr().Is4In6():
			return fmt.Errorf("%w: special subnet %s is not %s as pool %s is", ErrInvalid, s, familyOf(def), def.Name)
		case !s.Masked().Contains(spec.IP):
			return fmt.Errorf("%w: ip %s is not in special subnet %s", ErrInvalid, spec.IP, s.Masked())
		case overlapsPool(def, s):
			return fmt.Errorf("%w: special subnet %s overlaps pool %s; a special subnet must lie outside the pool", ErrInvalid, s.Masked(), def.Name)
		}
		sd, err := specialDef(spec.Pool, s).Normalize()
		if err != nil {
			return fmt.Errorf("%w: special subnet %s: %w", ErrInvalid, s.Masked(), err)
		}
		if !sd.Contains(spec.IP) {
			return fmt.Errorf("%w: ip %s is the network or broadcast address of special subnet %s", ErrInvalid, spec.IP, s.Masked())
		}
	}
	return nil
}

// checkLive rejects a special subnet that overlaps, without being equal to,
// one that live containers use: the seed's CNetPairValid allows only shared
// or disjoint subnets.
func checkLive(spec Spec, live []netip.Prefix) error {
	if spec.Mode() != InSubnet {
		return nil
	}
	s := spec.Subnet.Masked()
	for _, l := range live {
		if l != s && l.Overlaps(s) {
			return fmt.Errorf("%w: %s overlaps special subnet %s, which containers of pool %s use", ErrSubnetConflict, s, l, spec.Pool)
		}
	}
	return nil
}

// wantsFor turns a checked spec into pool wants: ip and gateway in one
// request, so that they are taken in one transaction.
func wantsFor(spec Spec) plan {
	gw := pool.Want{Pool: spec.Pool, Role: pool.RoleGateway}
	switch spec.Mode() {
	case InSubnet:
		d := specialDef(spec.Pool, spec.Subnet)
		return plan{wants: []pool.Want{{Pool: d.Name, Role: pool.RoleIP, Addr: spec.IP}, gw}, special: &d}
	case FromPoolWithIP:
		return plan{wants: []pool.Want{{Pool: spec.Pool, Role: pool.RoleIP, Addr: spec.IP}, gw}}
	}
	return plan{wants: []pool.Want{{Pool: spec.Pool, Role: pool.RoleIP}, gw}}
}

// Record is one container network of a main pool as read from the store,
// not validated: CheckNet judges it. Fields missing in the store are zero.
type Record struct {
	Owner   pool.Owner
	Host    string
	IP      netip.Addr
	Subnet  netip.Prefix
	GW      netip.Addr
	Special bool   // the ip is held in a special subnet pool
	Problem string // what did not decode (an owner holding two ips, ...)
}

// Net returns the record as a ContainerNet, or why it is not one.
func (r Record) Net() (ContainerNet, error) { return New(r.IP, r.Subnet, r.GW) }

// SubnetOf returns the special subnet a special subnet pool holds.
type SubnetOf func(poolName string) (netip.Prefix, bool)

// recordOf decodes a's container network in main pool mainPool. ok is false
// when a holds nothing of that network (neither an ip nor a gateway).
func recordOf(mainPool string, a pool.Allocation, subnetOf SubnetOf) (Record, bool) {
	r := Record{Owner: a.Owner, Host: a.Host}
	var ips []string
	found := false
	for _, x := range a.Addrs {
		switch {
		case x.Pool == mainPool && x.Role == pool.RoleGateway:
			r.GW, found = x.Addr, true
		case x.Pool == mainPool && x.Role == pool.RoleIP:
			r.IP, r.Subnet, r.Special, found = x.Addr, HostPrefix(x.Addr), false, true
			ips = append(ips, x.Addr.String())
		case isSpecialOf(mainPool, x.Pool) && x.Role == pool.RoleIP:
			r.IP, r.Special, found = x.Addr, true, true
			r.Subnet = netip.Prefix{}
			if s, ok := subnetOf(x.Pool); ok {
				r.Subnet = s
			} else {
				r.Problem = "special subnet pool " + x.Pool + " has no known definition"
			}
			ips = append(ips, x.Addr.String())
		}
	}
	if len(ips) > 1 {
		r.Problem = "holds several ips: " + strings.Join(ips, ", ")
	}
	return r, found
}

// recordsOf decodes every container network of mainPool in allocs, in
// owner order.
func recordsOf(mainPool string, allocs []pool.Allocation, subnetOf SubnetOf) []Record {
	var out []Record
	for _, a := range allocs {
		if r, ok := recordOf(mainPool, a, subnetOf); ok {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b Record) int { return strings.Compare(a.Owner.String(), b.Owner.String()) })
	return out
}

// allocatedIn is the seed's alloc: every address of mainPool held by anyone.
func allocatedIn(mainPool string, allocs []pool.Allocation) map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	for _, a := range allocs {
		for _, x := range a.Addrs {
			if x.Pool == mainPool {
				out[x.Addr] = true
			}
		}
	}
	return out
}

// liveSpecials returns the distinct special subnets recs use.
func liveSpecials(recs []Record) []netip.Prefix {
	var out []netip.Prefix
	for _, r := range recs {
		if r.Special && r.Subnet.IsValid() && !slices.Contains(out, r.Subnet) {
			out = append(out, r.Subnet)
		}
	}
	return out
}

// State is one main pool's stored state as the seed's Net schema sees it:
// the pool, its allocated addresses and its container networks.
type State struct {
	Pool       pool.Def
	Alloc      map[netip.Addr]bool
	Containers []Record
}

// StateOf builds the State of main pool def from every allocation of the
// store. subnetOf resolves special subnet pools.
func StateOf(def pool.Def, allocs []pool.Allocation, subnetOf SubnetOf) State {
	return State{Pool: def, Alloc: allocatedIn(def.Name, allocs), Containers: recordsOf(def.Name, allocs, subnetOf)}
}
